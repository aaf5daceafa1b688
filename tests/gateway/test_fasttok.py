"""The tiktoken fast path (``gateway.fasttok``) returns exactly the HF tokenizer's ids where it is
used, and is refused for every setting its proof does not cover."""

from __future__ import annotations

import copy
import json
import random
from typing import Any

import orjson
import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from gateway import fasttok
from gateway.config import ModelConfig
from gateway.protocol import parse_body
from gateway.tokenizer import ModelTokenizer

LLAMA3_PATTERN = fasttok._LLAMA3
ADVERSARIAL = [
    "", " ", "  ", "\n", "\r\n", "\t \n", " " * 100, "\n" * 33, "'s", "'S", "'\u017f", "''s", "x's'll'D",
    "a1b22c333d4444", "1234567890" * 5, "=" * 300, "ab" * 300, "é" * 50, "hello\u00a0world\u2003x",
    "\x0b\x0c\x85\u2028\u2029",
    "don't STOP'RE 'VE 'Ll", "  def f():\n\t\treturn  x  \n\n\n", "ﬁ ǅ ẞ ß İ \u0131",
    "Ελληνικά Кириллица עברית العربية",
    "中文🙂 mixed", "emoji 👍🏽 only beyond", "trailing spaces   ", "   leading",
]
ALPHABET = (
    [chr(c) for c in range(32, 127)] + list("\n\r\t \u00a0\u2003\u2028éüß\u017fİ\u0131Ωжשع\u0966ไ—…“”\u2019€½²")
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
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|begin|>", "<|eot|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if alphabet else [],
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    return tok


def load(spec: dict[str, Any]) -> tuple[fasttok.FastEncoder | None, str]:
    return fasttok.load(spec, json.dumps(spec))


@pytest.fixture(scope="module")
def base() -> dict[str, Any]:
    return json.loads(small_bpe().to_str())


def test_small_bpe_is_exact(base: dict[str, Any]) -> None:
    encoder, why = load(base)
    assert encoder is not None, why
    hf = Tokenizer.from_str(json.dumps(base))
    rng = random.Random(1)
    for text in [*ADVERSARIAL, *corpus()[:5], *random_texts(rng, 300)]:
        got = encoder.encode(text)
        if got is None:  # code points beyond the checked range: the caller encodes with HF
            assert any(ord(ch) >= fasttok._CHECKED_LIMIT for ch in text)
            continue
        assert got == hf.encode(text, add_special_tokens=False).ids, text


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
                req = parse_body(orjson.dumps({"model": "m", "prompt": prompt, "add_special_tokens": add}),
                                 "completion")
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
    "regex": (_set(("pre_tokenizer", "pretokenizers", 0, "pattern", "Regex"), r"\w+|\s+|[^\w\s]+"),
              "unknown pre-tokenizer regex"),
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
    trainer = trainers.BpeTrainer(vocab_size=500, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    encoder, why = load(json.loads(tok.to_str()))
    assert encoder is not None, why
    for text in [*ADVERSARIAL, *random_texts(random.Random(5), 100)]:
        got = encoder.encode(text)
        assert got is None or got == tok.encode(text, add_special_tokens=False).ids, text


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
