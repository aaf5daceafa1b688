"""A request's chat_template_kwargs configure the template, never the tokenizer, and are bounded
before any work (issue 27, point 4: 150 bytes of kwargs made the tokenizer pad to 10M ids)."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import orjson
import pytest

from engine_model import chat
from gateway.config import ModelConfig, TokenizerConfig
from gateway.http.errors import APIError
from gateway.request.protocol import parse_body
from gateway.tokenization.tokenizer import ModelTokenizer, Tokenizers

SHOW_FLAGS = "{% for m in messages %}{{ m.content }}{% endfor %}|{{ enable_thinking }}|{{ flavour }}"


@pytest.fixture(scope="module")
def hf(tokenizer_dir):
    return ModelTokenizer.load(ModelConfig(name="tiny", tokenizer=str(tokenizer_dir), max_model_len=64)).hf  # lean


def make(hf, **cfg: Any) -> ModelTokenizer:
    return ModelTokenizer(hf, ModelConfig(name="tiny", tokenizer="unused", max_model_len=4096, **cfg))


def chat_req(kwargs: Any, **extra: Any):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": kwargs}
    return parse_body(orjson.dumps(body | extra), "chat")


def refused(tok: ModelTokenizer, kwargs: Any) -> APIError:
    with pytest.raises(APIError) as err:
        tok.prompt_ids(chat_req(kwargs))
    assert err.value.status == 400 and err.value.param == "chat_template_kwargs", err.value.message
    assert err.value.body()["error"]["type"] == "invalid_request_error"
    return err.value


def rendered(tok: ModelTokenizer, kwargs: Any) -> str:
    return str(tok.backend.decode(tok.prompt_ids(chat_req(kwargs))[0], skip_special_tokens=False))


# -- what passes to the template ----------------------------------------------------------------


def test_only_what_the_template_reads_reaches_it(hf):
    """Like vLLM, kwargs the template does not read are dropped silently (clients send e.g.
    enable_thinking to every model); those it reads are rendered."""
    tok = make(hf, chat_template=SHOW_FLAGS)
    assert rendered(tok, {"enable_thinking": False, "flavour": "hot", "unused": "x" * 100}) == "hi|False|hot"
    args = chat.render_args(
        {"enable_thinking": 1, "unused": 2, "documents": [], "continue_final_message": True}, SHOW_FLAGS
    )
    assert args.kwargs == {"enable_thinking": 1, "documents": [], "continue_final_message": True, "return_dict": False}


@pytest.mark.parametrize("name", ["messages", "conversation", "self"])
def test_the_calls_own_arguments_are_refused(hf, name):
    err = refused(make(hf), {name: []})
    assert name in err.message


@pytest.mark.parametrize("name", sorted(chat.TOKENIZER_CALL_KWARGS))
def test_every_tokenizer_call_kwarg_is_refused_unless_default(hf, name):
    tok = make(hf)
    err = refused(tok, {name: 7})
    assert name in err.message and "truncate_prompt_tokens" in err.message
    for default in (None, False, "auto"):
        tok.prompt_ids(chat_req({name: default}))


# -- bounds, checked before any work ------------------------------------------------------------


def nested(depth: int) -> dict[str, Any]:
    """chat_template_kwargs whose nesting is ``depth`` (the object itself is 1)."""
    value: Any = 1
    for _ in range(depth - 1):
        value = [value]
    return {"a": value}


def test_nesting_is_bounded(hf):
    tok = make(hf, chat_template_kwargs_max_depth=4)
    tok.prompt_ids(chat_req(nested(4)))
    assert "chat_template_kwargs_max_depth" in refused(tok, nested(5)).message
    # the default allows a tools list with nested JSON schemas, not a 900-deep object (sent as
    # JSON text: orjson reads 1,024 levels but writes only 254)
    raw = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"a": '
    deep = parse_body(raw + b"[" * 900 + b"]" * 900 + b"}}", "chat")
    with pytest.raises(APIError, match="nested deeper than 16"):
        make(hf).prompt_ids(deep)


def test_key_count_is_bounded(hf):
    tok = make(hf, chat_template_kwargs_max_keys=3)
    tok.prompt_ids(chat_req({"a": 1, "b": 2, "c": 3}))
    assert "chat_template_kwargs_max_keys" in refused(tok, {"a": 1, "b": 2, "c": 3, "d": 4}).message
    assert "at most 32" in refused(make(hf), {f"k{i}": i for i in range(33)}).message


def test_size_is_bounded(hf):
    tok = make(hf, chat_template_kwargs_max_bytes=100)
    tok.prompt_ids(chat_req({"flavour": "x" * 80}))
    assert "chat_template_kwargs_max_bytes" in refused(tok, {"flavour": "x" * 101}).message
    # many small members count too: a list of a million zeros is refused without visiting them
    assert "larger than 100 bytes" in refused(tok, {"a": [0] * 1_000_000}).message
    assert "larger than 100 bytes" in refused(tok, {"a": [{"k": "v"}] * 30}).message


@pytest.mark.parametrize(
    "value",
    [
        {"a": "x" * 50},
        {"a": [1, 2.5, -3, True, None, "é"]},
        {"tools": [{"name": "f", "parameters": {"type": "object"}}]},
        {},
        {"a": {}},
        {"a": []},
    ],
)
def test_size_counts_the_compact_json_text(value):
    size, _ = chat._json_size(value, 16, 1 << 20)
    assert size == len(orjson.dumps(value).decode())  # characters (no escapes here)


def test_config_rejects_impossible_bounds():
    with pytest.raises(ValueError, match="chat_template_kwargs_max_depth"):
        ModelConfig(name="m", tokenizer="t", max_model_len=8, chat_template_kwargs_max_depth=0)


# -- the tokenizer is shared, never copied ------------------------------------------------------


def test_concurrent_requests_never_copy_the_tokenizer(hf, monkeypatch):
    """Before issue 27 each tokenizing template call deep-copied the tokenizer (one copy per
    concurrent call); now every call renders text and the threads share one tokenizer."""
    copied: list[str] = []
    real = copy.deepcopy

    def spy(obj: Any, memo: Any = None) -> Any:
        copied.append(type(obj).__name__)
        return real(obj, memo)

    monkeypatch.setattr(copy, "deepcopy", spy)
    tok = make(hf, chat_template=SHOW_FLAGS)
    bodies = [
        chat_req({"enable_thinking": True}),
        chat_req({"tokenize": False, "flavour": "mild"}),
        chat_req({"flavour": "hot"}, truncate_prompt_tokens=2),
        chat_req({"tokenize": True, "truncation": True, "max_length": 2}),  # what used to copy it
    ] * 8

    async def main() -> list[Any]:
        toks = Tokenizers([tok], TokenizerConfig(inline_max_bytes=0, workers=4))
        try:
            return await asyncio.gather(*(toks.prompt_ids(tok, r) for r in bodies), return_exceptions=True)
        finally:
            toks.close()

    results = asyncio.run(main())
    assert len({tuple(r[0]) for r in results[0::4]}) == 1 and len(results[2][0]) == 2
    assert all(isinstance(r, APIError) and r.param == "chat_template_kwargs" for r in results[3::4])
    assert not [name for name in copied if "Tokenizer" in name]
    assert tok.backend.padding is None and tok.backend.truncation is None
