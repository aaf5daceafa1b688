"""The gateway renders and counts prompts the way vLLM 0.32 does, through engine_model.chat (the
real-engine suite checks the counts against a real engine; these tests pin each rule, mostly by
decoding what was counted). This module has the whole path: rendering end to end, model-specific
renderers, truncation and lengths, event-loop safety; each step's own rules are in
test_chat_messages.py, test_chat_template.py and test_chat_kwargs.py."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import threading
from pathlib import Path

import pytest

from gateway.config import ModelConfig, TokenizerConfig
from gateway.http.errors import APIError
from gateway.tokenization import reference
from gateway.tokenization.reference import detect_renderer
from gateway.tokenization.tokenizer import ModelTokenizer, Tokenizers
from tests.engine_model.chat_helpers import make, req, user

# -- rendering end to end --------------------------------------------------------------------------


def test_chat_ids_match_transformers_rendering(tok, reference_hf):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    ids = tok.prompt_ids(req({"messages": messages}))[0]
    text = reference_hf.apply_chat_template(
        [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in messages],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert ids == reference_hf.encode(text, add_special_tokens=False)
    assert text.endswith("<|assistant|>\n")


# -- model-specific renderers (F12) ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "mode", "renderer"),
    [
        ({"architectures": ["DeepseekV32ForCausalLM"]}, "auto", "deepseek_v32"),
        ({"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"]}, "auto", "harmony"),
        ({"architectures": ["LlamaForCausalLM"]}, "cohere", "cohere"),
        ({"architectures": ["LlamaForCausalLM"]}, "auto", None),
    ],
)
def test_model_specific_renderers_are_detected(tokenizer_dir, tmp_path, caplog, config, mode, renderer):
    folder = tmp_path / "model"
    shutil.copytree(tokenizer_dir, folder)
    (folder / "config.json").write_text(json.dumps(config))
    cfg = ModelConfig(name="m", tokenizer=str(folder), max_model_len=64, tokenizer_mode=mode)
    assert detect_renderer(cfg) == renderer
    with caplog.at_level(logging.WARNING, logger="gateway.tokenization.tokenizer"):
        tok = ModelTokenizer.load(cfg)
    assert tok.prompt_ids(req({"messages": user("hi")})).approximate_reason == renderer
    assert ("approximate" in caplog.text) == (renderer is not None)


# -- truncation and lengths (F13, F14, P7) ----------------------------------------------------------


@pytest.fixture(scope="module")
def bos_dir(tokenizer_dir, tmp_path_factory):
    """The test tokenizer with a post-processor that adds BOS and EOS, like many models'."""
    from tokenizers import Tokenizer, processors

    folder = tmp_path_factory.mktemp("bos")
    shutil.copytree(tokenizer_dir, folder, dirs_exist_ok=True)
    rust = Tokenizer.from_file(str(folder / "tokenizer.json"))
    rust.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)])
    rust.save(str(folder / "tokenizer.json"))
    return folder


TEXT = "one two three four five six seven eight nine ten"


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("keep", [1, 2, 5])
def test_truncation_keeps_special_tokens_like_the_tokenizer(bos_dir, side, keep):
    """Without truncation_side vLLM has the tokenizer truncate (the text is cut, BOS/EOS stay); with
    it, vLLM slices the encoded prompt."""
    from transformers import AutoTokenizer

    tok = ModelTokenizer.load(ModelConfig(name="b", tokenizer=str(bos_dir), max_model_len=64))
    ref = AutoTokenizer.from_pretrained(str(bos_dir), truncation_side="left")
    full = ref(TEXT)["input_ids"]
    want = ref(TEXT, truncation=True, max_length=keep)["input_ids"]
    want = want[-keep:]  # vLLM's own slice after the tokenizer's (left, its default side)
    assert tok.prompt_ids(req({"prompt": TEXT, "truncate_prompt_tokens": keep}, "completion"))[0] == want
    sliced = full[-keep:] if side == "left" else full[:keep]
    got = tok.prompt_ids(req({"prompt": TEXT, "truncate_prompt_tokens": keep, "truncation_side": side}, "completion"))
    assert got[0] == sliced


def test_add_special_tokens_is_honoured_for_chat(bos_dir):
    tok = ModelTokenizer.load(ModelConfig(name="b", tokenizer=str(bos_dir), max_model_len=64))
    plain = tok.prompt_ids(req({"messages": user("hi")}))[0]
    assert tok.prompt_ids(req({"messages": user("hi"), "add_special_tokens": True}))[0] == [1, *plain, 2]


def test_truncate_prompt_tokens_edge_values(hf):
    tok = make(hf, max_model_len=32)
    long = {"prompt": "word " * 100}
    with pytest.raises(APIError, match="decoder prompt cannot be empty"):
        tok.prompt_ids(req(long | {"truncate_prompt_tokens": 0, "truncation_side": "left"}, "completion"))
    # -1: the whole context, less one token when the request asks for output (completions default to 16)
    assert len(tok.prompt_ids(req(long | {"truncate_prompt_tokens": -1}, "completion"))[0]) == 31
    chat_long = {"messages": user("word " * 100), "truncate_prompt_tokens": -1}
    assert len(tok.prompt_ids(req(chat_long | {"max_tokens": 4}))[0]) == 31
    with pytest.raises(APIError, match="max_tokens must be at least 1"):  # 32 tokens leave no room
        tok.prompt_ids(req(chat_long))
    with pytest.raises(APIError, match="cannot be greater than max_model_len = 32"):
        tok.prompt_ids(req(long | {"truncate_prompt_tokens": 33}, "completion"))


def test_prompt_length_and_truncation(tok, reference_hf):
    long = req({"prompt": "word " * 200}, "completion")
    with pytest.raises(APIError) as info:
        tok.prompt_ids(long)
    assert info.value.code == "context_length_exceeded"
    cut = req({"truncate_prompt_tokens": 10, "truncation_side": "left", "prompt": "word " * 200}, "completion")
    assert tok.prompt_ids(cut)[0] == reference_hf.encode("word " * 200)[-10:]


def test_token_ids_are_not_checked_against_the_vocabulary(tok):
    """F14: the engine knows the model's (possibly padded) vocabulary; the gateway does not."""
    assert tok.prompt_ids(req({"prompt": [1, 2, tok.backend.get_vocab_size() + 100]}, "completion"))[0] == [
        1,
        2,
        tok.backend.get_vocab_size() + 100,
    ]


def test_text_too_long_for_any_tokenization_is_refused_before_tokenizing(hf):
    tok = make(hf, max_model_len=8)
    assert tok.max_chars_per_token == max(len(t) for t in hf.get_vocab())
    limit = 8 * tok.max_chars_per_token
    calls = []
    tok.backend = _CountingBackend(tok.backend, calls)
    with pytest.raises(APIError, match=f"contains {limit + 1} characters \\(more than {limit} characters"):
        tok.prompt_ids(req({"prompt": "x" * (limit + 1)}, "completion"))
    assert calls == []  # refused without tokenizing
    # with truncation vLLM cuts the text first instead
    ids = tok.prompt_ids(
        req({"prompt": "x" * (limit * 3), "truncate_prompt_tokens": 4, "truncation_side": "left"}, "completion")
    )
    assert len(ids[0]) == 4 and calls == [limit]


class _CountingBackend:
    def __init__(self, inner, calls: list[int]) -> None:
        self._inner, self._calls = inner, calls

    def encode(self, text: str, add_special_tokens: bool = True):
        self._calls.append(len(text))
        return self._inner.encode(text, add_special_tokens=add_special_tokens)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


# -- event loop safety (P5, P6) ---------------------------------------------------------------------


class _ThreadRecorder(ModelTokenizer):
    def __init__(self, inner: ModelTokenizer) -> None:
        self.__dict__.update(inner.__dict__)
        self.threads: list[int] = []

    def prompt_ids(self, req):
        self.threads.append(threading.get_ident())
        return super().prompt_ids(req)


async def test_large_bodies_are_tokenized_on_a_worker_thread(tok):
    recorder = _ThreadRecorder(tok)
    toks = Tokenizers([recorder], TokenizerConfig(inline_max_bytes=256))
    try:
        loop_thread = threading.get_ident()
        small = req({"prompt": "hi"}, "completion")
        # token ids count 0 characters but still cost work: the body's size decides
        large = req({"prompt": [1000] * 60}, "completion")
        assert small.raw_size <= 256 < large.raw_size
        for r in (small, large):
            await toks.prompt_ids(recorder, r)
        assert recorder.threads[0] == loop_thread
        assert loop_thread not in recorder.threads[1:]
    finally:
        toks.close()


def test_inline_limit_config_is_in_bytes():
    # a thread hop costs more CPU than tokenizing a few KB in place (docs/benchmarks.md "Tokenizing inline")
    assert TokenizerConfig().inline_max_bytes == 4096
    assert "inline_max_chars" not in TokenizerConfig.model_fields


def test_tokenizers_run_concurrently_without_sharing_state(tok):
    """The pool's threads share one Rust tokenizer: it is used read-only (truncation cuts each call's own
    encoding; no call configures the tokenizer, issue 27)."""

    async def main():
        toks = Tokenizers([tok], TokenizerConfig(inline_max_bytes=0, workers=2))
        try:
            bodies = [
                {"messages": user("word " * 20), "truncate_prompt_tokens": 3},
                {"messages": user("word " * 20)},
            ] * 10
            return await asyncio.gather(*(toks.prompt_ids(tok, req(b)) for b in bodies))
        finally:
            toks.close()

    results = asyncio.run(main())
    assert {len(r[0]) for r in results[::2]} == {3}
    assert len({len(r[0]) for r in results[1::2]}) == 1 and len(results[1][0]) > 3


def test_renderer_warning_is_silent_for_plain_models(tokenizer_dir):
    assert detect_renderer(ModelConfig(name="m", tokenizer=str(Path(tokenizer_dir)), max_model_len=8)) is None


def test_tokenizer_json_truncation_and_padding_settings_are_ignored(tokenizer_dir, tmp_path):
    """transformers switches a tokenizer.json's own truncation/padding off on every call (and so
    does vLLM's tokenizing); the gateway, encoding with the Rust tokenizer directly, must too."""
    from tokenizers import Tokenizer

    folder = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, folder)
    rust = Tokenizer.from_file(str(folder / "tokenizer.json"))
    rust.enable_truncation(max_length=3)
    rust.enable_padding(length=50, pad_id=3, pad_token="<pad>")
    rust.save(str(folder / "tokenizer.json"))
    cfg = ModelConfig(name="t", tokenizer=str(folder), max_model_len=64)
    tok, ref = ModelTokenizer.load(cfg), reference.load(cfg).hf
    assert tok.prompt_ids(req({"prompt": TEXT}, "completion"))[0] == ref(TEXT)["input_ids"]
    assert 3 < len(ref(TEXT)["input_ids"]) < 50
