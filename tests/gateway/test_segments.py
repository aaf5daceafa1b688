"""Reusing token ids of text between added tokens (``SegmentEncoder``) gives exactly the ids of
encoding the whole text, on the project's test tokenizer, a Llama-3-style 64k tokenizer and
tokenizers built to hit each rule; settings where that is not provable turn reuse off."""

from __future__ import annotations

import random
import threading
from typing import Any

import orjson
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from gateway.config import ModelConfig
from gateway.request.protocol import parse_body
from gateway.tokenization.segments import SegmentEncoder
from gateway.tokenization.tokenizer import ModelTokenizer

WORDS = [
    "hello",
    "world",
    " the",
    "  ",
    "\n",
    "\n\n",
    "\t",
    "é",
    "ü",
    "日本",
    "🙂",
    "x=1",
    "def f():",
    "'s",
    "123456",
    "<",
    "|",
    ">",
    "<|",
    "|>",
    "eot",
    "_id",
    "<|eot",
    "id|>",
    "\r\n",
    " ",
    ".",
    ",",
    "don't",
    "ÀÉ",
]


def random_text(rng: random.Random, specials: list[str], n: int = 30) -> str:
    pieces = [rng.choice(specials) if specials and rng.random() < 0.15 else rng.choice(WORDS) for _ in range(n)]
    return "".join(pieces)


def random_conversation(rng: random.Random, specials: list[str], turns: int) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": random_text(rng, specials, rng.randint(0, 40))}]
    for i in range(turns):
        role = "user" if i % 2 == 0 else "assistant"
        messages.append({"role": role, "content": random_text(rng, specials, rng.randint(0, 60))})
    return messages


def chat(messages: list[dict[str, str]], **extra: Any):
    return parse_body(orjson.dumps({"model": "m", "messages": messages, **extra}), "chat")


def completion(prompt: str, **extra: Any):
    return parse_body(orjson.dumps({"model": "m", "prompt": prompt, **extra}), "completion")


def pair(path: str) -> tuple[ModelTokenizer, ModelTokenizer]:
    """The same tokenizer with reuse on and off."""
    cfg = ModelConfig(name="m", tokenizer=path, max_model_len=1 << 20)
    on = ModelTokenizer.load(cfg)
    return on, ModelTokenizer(on.hf, cfg, on.renderer, reuse_tokens=0)


@pytest.fixture(scope="module")
def tiny(tokenizer_dir) -> tuple[ModelTokenizer, ModelTokenizer]:
    return pair(str(tokenizer_dir))


@pytest.fixture(scope="module")
def llama3(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelTokenizer, ModelTokenizer]:
    from bench.decision_inputs import build_llama3_tokenizer

    return pair(str(build_llama3_tokenizer(tmp_path_factory.mktemp("llama3"))))


@pytest.mark.parametrize("name", ["tiny", "llama3"])
def test_reused_ids_equal_whole_text_ids(name: str, request: pytest.FixtureRequest) -> None:
    on, off = request.getfixturevalue(name)
    assert on.segments.enabled, on.segments.reason
    specials = [t.content for t in on.hf.backend_tokenizer.get_added_tokens_decoder().values()][:12]
    rng = random.Random(name)
    for _ in range(60):
        messages = random_conversation(rng, specials, rng.randint(1, 8))
        # Turn after turn, as a client sends them: later turns reuse the earlier ones' segments.
        for end in range(1, len(messages) + 1):
            req = chat(messages[:end])
            assert on.prompt_ids(req) == off.prompt_ids(req)
        prompt = random_text(rng, specials, 40)
        for add in (True, False):
            req = completion(prompt, add_special_tokens=add)
            assert on.prompt_ids(req) == off.prompt_ids(req)
            assert on.prompt_ids(req) == off.prompt_ids(req)  # from the cache this time
    assert on.segments.cached_tokens() > 0


def test_llama3_style_reuses_previous_turns(llama3: tuple[ModelTokenizer, ModelTokenizer]) -> None:
    on, off = llama3
    messages = [
        {"role": "system", "content": "You are helpful. " * 50},
        {"role": "user", "content": "Explain this code:\n" + "def f(x):\n    return x * 2\n" * 40},
    ]
    spy = Spy(on.hf.backend_tokenizer)
    tok = ModelTokenizer(on.hf, on.cfg)
    tok.segments = SegmentEncoder(spy)
    assert tok.prompt_ids(chat(messages))[0] == off.prompt_ids(chat(messages))[0]
    spy.chars = 0
    turn = [*messages, {"role": "assistant", "content": "It doubles x."}, {"role": "user", "content": "Why?"}]
    assert tok.prompt_ids(chat(turn))[0] == off.prompt_ids(chat(turn))[0]
    assert spy.chars == len("\n\nIt doubles x.") + len("\n\nWhy?")  # only the new messages' text


class Spy:
    """A backend tokenizer that counts the characters it is asked to encode."""

    def __init__(self, backend: Tokenizer) -> None:
        self._backend = backend
        self.chars = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def encode(self, text: str, add_special_tokens: bool = True) -> Any:
        self.chars += len(text)
        return self._backend.encode(text, add_special_tokens=add_special_tokens)


# -- the rules, on tokenizers built for them ---------------------------------------------------------

CORPUS = ["hello world <a> the quick brown fox", "don't stop 123 é ü 日本 🙂", "def f(x):\n\treturn x\n"] * 20


def build(
    *, normalizer: Any = None, pre_tokenizer: Any = None, model: Any = None, added: list[AddedToken]
) -> Tokenizer:
    tok = Tokenizer(model or models.BPE(unk_token="[UNK]"))
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer or pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet() if tok.pre_tokenizer.__class__.__name__ != "Metaspace" else []
    if isinstance(tok.model, models.BPE):
        tok.train_from_iterator(
            CORPUS,
            trainers.BpeTrainer(
                vocab_size=400, special_tokens=["[UNK]"], initial_alphabet=alphabet, show_progress=False
            ),
        )
    tok.add_tokens(added)
    return tok


def check_equal(tok: Tokenizer, texts_from: list[str], rounds: int = 400, seed: int = 0) -> SegmentEncoder:
    enc = SegmentEncoder(tok)
    rng = random.Random(seed)
    for _ in range(rounds):
        pieces = [rng.choice(texts_from) for _ in range(rng.randint(0, 25))]
        text = "".join(pieces)
        for add in (False, True):
            want = tok.encode(text, add_special_tokens=add).ids
            assert enc.encode(text, add) == want, (text, add)
            assert enc.encode(text, add) == want, (text, add)  # cached
    return enc


def test_overlapping_added_tokens_match_leftmost_longest() -> None:
    added = [AddedToken(t, special=True, normalized=False) for t in ("<a>", "<a><b>", "a><", "<b>", "b")]
    tok = build(added=added)
    enc = check_equal(tok, ["<", "a", ">", "b", " ", "<a>", "<b>", "x", "\n"])
    assert enc.enabled


def test_normalizer_and_normalized_added_tokens() -> None:
    added = [
        AddedToken("[SEP]", special=True, normalized=False),
        AddedToken("Hello", normalized=True),
        AddedToken("wor", normalized=True),
    ]
    norm = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase(), normalizers.Strip()])
    tok = build(normalizer=norm, added=added)
    enc = check_equal(tok, ["HELLO", "hello", " ", "[SEP]", "[sep]", "World", "ﬁ", "  x ", "\n", "wor"])
    assert enc.enabled


def test_metaspace_always_is_reused_and_first_is_refused() -> None:
    added = [AddedToken("<s>", special=True, normalized=False), AddedToken("</s>", special=True, normalized=False)]
    pieces = ["<s>", "</s>", " hi", "there", "  ", "▁x", "\n"]
    always = build(pre_tokenizer=pre_tokenizers.Metaspace(prepend_scheme="always"), added=added)
    assert check_equal(always, pieces).enabled
    first = build(pre_tokenizer=pre_tokenizers.Metaspace(prepend_scheme="first"), added=added)
    enc = check_equal(first, pieces)  # still exact: it encodes whole texts
    assert not enc.enabled and "prepend_scheme" in (enc.reason or "")
    # Why: encoded alone, the text after <s> would get a leading ▁ it does not get in place.
    text = "<s>hi"
    assert first.encode(text, add_special_tokens=False).ids != (
        first.encode("<s>", add_special_tokens=False).ids + first.encode("hi", add_special_tokens=False).ids
    )


@pytest.mark.parametrize("flag", ["lstrip", "rstrip", "single_word"])
def test_stripping_or_single_word_added_tokens_are_refused(flag: str) -> None:
    tok = build(added=[AddedToken("<m>", special=True, normalized=False, **{flag: True})])
    enc = check_equal(tok, ["<m>", " ", "a", "  b ", "\n"])
    assert not enc.enabled and flag in (enc.reason or "")


def test_encode_special_tokens_and_dropout_are_refused() -> None:
    tok = build(added=[AddedToken("<m>", special=True, normalized=False)])
    tok.encode_special_tokens = True
    assert not SegmentEncoder(tok).enabled
    dropout = build(model=models.BPE(dropout=0.5, unk_token="[UNK]"), added=[AddedToken("<m>", special=True)])
    assert SegmentEncoder(dropout).reason == "BPE dropout"


@pytest.mark.parametrize(
    "post",
    [
        lambda s, e: processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", s), ("</s>", e)]),
        lambda s, e: processors.BertProcessing(("</s>", e), ("<s>", s)),
        lambda s, e: processors.RobertaProcessing(("</s>", e), ("<s>", s)),
        lambda s, e: processors.Sequence(
            [
                processors.ByteLevel(),
                processors.TemplateProcessing(single="<s> <s> $A </s>", special_tokens=[("<s>", s), ("</s>", e)]),
            ]
        ),
    ],
)
def test_post_processor_affixes(post: Any) -> None:
    added = [AddedToken(t, special=True, normalized=False) for t in ("<s>", "</s>")]
    tok = build(added=added)
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    tok.post_processor = post(bos, eos)
    enc = check_equal(tok, ["<s>", "</s>", "hello", " world", "\n"])
    assert enc.enabled
    assert enc.encode("<s>hello", True)[:2] == [bos, bos] and enc.encode("hello", True)[-1] == eos


def test_cache_is_bounded_and_thread_safe(llama3: tuple[ModelTokenizer, ModelTokenizer]) -> None:
    backend = llama3[0].hf.backend_tokenizer
    enc = SegmentEncoder(backend, max_tokens=2000)
    specials = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    rng = random.Random(9)
    texts = [random_text(rng, specials, 120) for _ in range(60)]
    want = [backend.encode(t, add_special_tokens=False).ids for t in texts]
    errors: list[str] = []

    def worker(seed: int) -> None:
        r = random.Random(seed)
        for _ in range(300):
            i = r.randrange(len(texts))
            if enc.encode(texts[i]) != want[i]:
                errors.append(texts[i])

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert 0 < enc.cached_tokens() <= 2000


def test_fast_reason_is_said_once() -> None:
    """Where neither fast source takes a tokenizer (the proof, or ranks read off its vocabulary), the
    reason both give is said once; segmenting stays on."""
    tok = build(normalizer=normalizers.Lowercase(), added=[AddedToken("<m>", special=True, normalized=False)])
    enc = SegmentEncoder(tok, fast=True)
    assert enc.enabled and not enc.fast
    assert enc.fast_reason == "a normalizer"
    assert enc.run_time_check is None


def test_reuse_off() -> None:
    tok = build(added=[AddedToken("<m>", special=True, normalized=False)])
    enc = SegmentEncoder(tok, max_tokens=0)
    assert enc.reason == "disabled"
    assert enc.encode("a<m>b") == tok.encode("a<m>b", add_special_tokens=False).ids
    assert enc.cached_tokens() == 0


# -- reusing a recent text's ids up to one of its added tokens -----------------------------------------


def test_common_prefix() -> None:
    from gateway.tokenization.segments import _common_prefix

    rng = random.Random(4)
    for _ in range(500):
        a = "".join(rng.choice("ab") for _ in range(rng.choice([0, 3, 50, 3000])))
        b = a[: rng.randrange(len(a) + 1)] + "".join(rng.choice("ab") for _ in range(rng.randrange(5)))
        want = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        assert _common_prefix(a, b) == want == _common_prefix(b, a)


def test_next_text_reuses_the_previous_ones_ids_exactly() -> None:
    """Texts growing (and branching) piece by piece, with added tokens that overlap and one that
    starts inside the previous text and ends past it: always the whole text's ids."""
    added = [
        AddedToken(t, special=True, normalized=False) for t in ("<a>", "<a><b>", "a><", "<b>", "b", "<a><b><c>", "<c>")
    ]
    tok = build(added=added)
    pieces = ["<", "a", ">", "b", "c", " ", "<a>", "<b>", "<c>", "x", "\n", "hello", " world"]
    rng = random.Random(8)
    for post in (
        None,
        processors.TemplateProcessing(
            single="<c> $A <b>", special_tokens=[("<c>", tok.token_to_id("<c>")), ("<b>", tok.token_to_id("<b>"))]
        ),
    ):
        tok.post_processor = post
        enc = SegmentEncoder(tok)
        assert enc.enabled
        reusable, hits = enc._reusable, []

        def counted(text: str, reusable: Any = reusable, hits: list[bool] = hits) -> Any:
            got = reusable(text)
            hits.append(got[0] is not None)
            return got

        enc._reusable = counted  # type: ignore[method-assign]
        texts = ["#" * 300]  # shorter texts are not kept for reuse
        for _ in range(1500):
            base = rng.choice(texts[-4:])
            if rng.random() < 0.2:
                base = base[: rng.randrange(250, len(base) + 1)]
            text = base + "".join(rng.choice(pieces) for _ in range(rng.randint(1, 6)))
            texts.append(text)
            add = rng.random() < 0.3
            assert enc.encode(text, add) == tok.encode(text, add_special_tokens=add).ids, (base, text)
        assert sum(hits) > 500  # most texts reused a previous one's ids
    # The case the margin is for: "<a>" ends the previous text, "<a><b>" is a match in the next.
    enc = SegmentEncoder(tok)
    assert enc.encode("x" * 300 + "<a>") == tok.encode("x" * 300 + "<a>", add_special_tokens=False).ids
    text = "x" * 300 + "<a><b>y"
    assert enc.encode(text) == tok.encode(text, add_special_tokens=False).ids


def test_recent_texts_are_bounded(llama3: tuple[ModelTokenizer, ModelTokenizer]) -> None:
    backend = llama3[0].hf.backend_tokenizer
    enc = SegmentEncoder(backend, max_tokens=3000)
    rng = random.Random(2)
    specials = ["<|start_header_id|>", "<|eot_id|>"]
    text = ""
    for _ in range(200):
        text = (text if rng.random() < 0.7 else "#" * 256) + random_text(rng, specials, 20)
        assert enc.encode(text) == backend.encode(text, add_special_tokens=False).ids
        assert enc._recent.tokens <= 3000
    assert enc._recent.tokens == sum(len(r.ids) for recs in enc._recent._data.values() for r in recs)
