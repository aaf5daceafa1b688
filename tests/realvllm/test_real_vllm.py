"""The gateway in front of two real vLLM CPU engines (a prefill and a decode engine, NixlConnector),
driven by the official ``openai`` client as an application would drive it.

Which path a request took is proven from the engines' own Prometheus counters, not from the
gateway's word: on the decode engine a P/D request adds one NIXL transfer and its prompt tokens
to ``prompt_tokens_by_source_total{source="external_kv_transfer"}``, a direct request adds its
prompt tokens to ``source="local_compute"`` and nothing to either NIXL counter. The weights are
random, so nothing here looks at generated text; ``ignore_eos`` makes token counts exact.

Every prompt starts with a fresh uuid, so its first KV block (128 tokens) is new to both engines'
prefix caches and the token counts below are exact, not "at least".
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest

from tests.promtext import sample

from . import engines as E
from .conftest import ADAPTER, THRESHOLD, Gateway, Pair

pytestmark = [pytest.mark.realvllm, pytest.mark.e2e]

MAX_TOKENS = 8
SAMPLING = {"max_tokens": MAX_TOKENS, "extra_body": {"ignore_eos": True}}
WORDS = (
    "the prefill pool computes the prompt once and the decode pool streams tokens while kv blocks "
    "move over nixl from one engine to another with a handle named by the gateway"
)


@pytest.fixture
def client(gateway: Gateway) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=E.REQUEST_TIMEOUT_S) as c:
        yield c


# -- prompts of an exact length, measured by the engine itself -----------------------------------

_WORDS = WORDS.split(" ")


def _filler(n_words: int) -> str:
    rng = random.Random(n_words)
    return " ".join(rng.choice(_WORDS) for _ in range(n_words))


def _exact(count, target: int, approx_words: int) -> str:
    """A text whose engine token count is exactly ``target``: uuid, ~1.8 tokens per filler word,
    then " x" pads (the byte-level pre-tokenizer never merges across spaces: one pad, one token)."""
    head, words = uuid.uuid4().hex, _filler(approx_words).split()
    text = " ".join([head, *words])
    n = count(text)
    while n > target and words:
        words.pop()
        text = " ".join([head, *words])
        n = count(text)
    for _ in range(8):
        if n >= target:
            break
        text += " x" * (target - n)
        n = count(text)
        while n > target and text.endswith(" x"):
            text = text[:-2]
            n = count(text)
    if n != target:
        raise AssertionError(f"could not build a prompt of exactly {target} tokens (got {n})")
    return text


def chat_messages(pair: Pair, tokens: int) -> list[dict]:
    def count(text: str) -> int:
        return pair.decode.tokenize_chat([{"role": "user", "content": text}])

    return [{"role": "user", "content": _exact(count, tokens, max(0, tokens - 60) // 2)}]


def completion_prompt(pair: Pair, tokens: int) -> str:
    return _exact(pair.decode.tokenize, tokens, max(0, tokens - 40) // 2)


# -- the engines' and the gateway's counters --------------------------------------------------------


@dataclass(frozen=True)
class Counters:
    xfers: float
    failed: float
    external: float
    decode_local: float
    prefill_prompt: float
    gw_pd: float
    gw_direct: float


def counters(pair: Pair, gw: Gateway) -> Counters:
    d, p = pair.decode.metrics(), pair.prefill.metrics()
    g = httpx.get(gw.url + "/metrics", timeout=10).text
    return Counters(
        xfers=sample(d, E.XFER_COUNT),
        failed=sample(d, E.XFER_FAILED),
        external=sample(d, E.PROMPT_BY_SOURCE, source="external_kv_transfer"),
        decode_local=sample(d, E.PROMPT_BY_SOURCE, source="local_compute"),
        prefill_prompt=sample(p, E.PROMPT_BY_SOURCE),
        gw_pd=sample(g, "pdgate_requests_total", path="pd", status="200"),
        gw_direct=sample(g, "pdgate_requests_total", path="direct", status="200"),
    )


def expect_pd(pair: Pair, gw: Gateway, before: Counters, prompt_tokens: int) -> None:
    """One P/D request: the decode engine pulled exactly this prompt's KV from the prefill engine."""
    want = (before.xfers + 1, before.external + prompt_tokens, before.gw_pd + 1)
    now = before

    # Engine counters are published with the engine's stats, and the gateway counts a stream once
    # its last byte is sent: both a moment after the client has the response.
    def settled() -> bool:
        nonlocal now
        now = counters(pair, gw)
        return (now.xfers, now.external, now.gw_pd) == want

    assert E.wait_until(settled), f"decode engine after a P/D request: {now}, expected xfers/external {want}"
    assert now.failed == 0, f"NIXL transfers failed: {now.failed}"
    assert now.decode_local == before.decode_local  # nothing prefilled locally on the decode engine
    assert now.prefill_prompt == before.prefill_prompt + prompt_tokens  # the prefill engine did it
    assert now.gw_direct == before.gw_direct
    # The prefill engine frees the blocks once the decode engine says it has read them.
    assert E.wait_until(lambda: pair.prefill.metric(E.KV_USAGE) == 0, timeout=10), (
        f"prefill engine still holds KV: {E.KV_USAGE}={pair.prefill.metric(E.KV_USAGE)}"
    )


def expect_direct(pair: Pair, gw: Gateway, before: Counters, prompt_tokens: int) -> None:
    """One direct request: the decode engine prefilled it itself; no KV moved."""
    want = before.decode_local + prompt_tokens
    now = before

    def settled() -> bool:
        nonlocal now
        now = counters(pair, gw)
        return (now.decode_local, now.gw_direct) == (want, before.gw_direct + 1)

    assert E.wait_until(settled), f"decode engine after a direct request: {now}, expected local_compute {want}"
    assert (now.xfers, now.external, now.failed) == (before.xfers, before.external, 0)
    assert now.prefill_prompt == before.prefill_prompt  # the prefill engine never saw it
    assert now.gw_pd == before.gw_pd


def expect(pair: Pair, gw: Gateway, before: Counters, path: str, prompt_tokens: int) -> None:
    (expect_pd if path == "pd" else expect_direct)(pair, gw, before, prompt_tokens)


# -- tests --------------------------------------------------------------------------------------------


def test_gateway_lists_the_model_the_engines_serve(vllm_pair, client):
    """And the LoRA adapter both engines load at start, as vLLM lists it (parent: the base model)."""
    listed = client.models.list().data
    assert [m.id for m in listed] == [E.MODEL_NAME, ADAPTER]
    assert (listed[1].parent, listed[1].root) == (E.MODEL_NAME, str(vllm_pair.adapters[ADAPTER]))
    for eng in (vllm_pair.prefill, vllm_pair.decode):
        served = httpx.get(eng.url + "/v1/models", timeout=10).json()["data"]
        assert [(m["id"], m["max_model_len"]) for m in served] == [(E.MODEL_NAME, E.MAX_MODEL_LEN), (ADAPTER, None)]


@pytest.mark.parametrize(
    ("tokens", "path"), [(THRESHOLD, "pd"), (THRESHOLD - 1, "direct")], ids=["at-threshold", "one-below"]
)
def test_chat_routing_at_the_threshold(vllm_pair, gateway, client, tokens, path):
    """Both sides of the threshold: the gateway's own chat-template token count equals the engine's
    (one token off either way and one of the two requests would take the other path)."""
    messages = chat_messages(vllm_pair, tokens)
    before = counters(vllm_pair, gateway)
    raw = client.chat.completions.with_raw_response.create(model=E.MODEL_NAME, messages=messages, **SAMPLING)
    out = raw.parse()
    assert raw.headers["x-pdgate-path"] == path
    assert out.usage.prompt_tokens == tokens and out.usage.completion_tokens == MAX_TOKENS
    assert out.choices[0].finish_reason == "length"
    # vLLM takes X-Request-Id as its request id: the decode leg carried the gateway's id.
    assert out.id == f"chatcmpl-{raw.headers['x-request-id']}"
    expect(vllm_pair, gateway, before, path, tokens)


@pytest.mark.parametrize(
    ("tokens", "path"), [(THRESHOLD, "pd"), (THRESHOLD - 1, "direct")], ids=["at-threshold", "one-below"]
)
def test_completions_routing_at_the_threshold(vllm_pair, gateway, client, tokens, path):
    prompt = completion_prompt(vllm_pair, tokens)
    before = counters(vllm_pair, gateway)
    raw = client.completions.with_raw_response.create(model=E.MODEL_NAME, prompt=prompt, **SAMPLING)
    out = raw.parse()
    assert raw.headers["x-pdgate-path"] == path
    assert out.usage.prompt_tokens == tokens and out.usage.completion_tokens == MAX_TOKENS
    assert out.id == f"cmpl-{raw.headers['x-request-id']}"
    expect(vllm_pair, gateway, before, path, tokens)


STREAM_CASES = [("pd", 1500), ("direct", 60)]


@pytest.mark.parametrize(("path", "tokens"), STREAM_CASES, ids=[c[0] for c in STREAM_CASES])
def test_chat_streaming_with_usage(vllm_pair, gateway, client, path, tokens):
    messages = chat_messages(vllm_pair, tokens)
    before = counters(vllm_pair, gateway)
    with client.chat.completions.with_streaming_response.create(
        model=E.MODEL_NAME, messages=messages, stream=True, stream_options={"include_usage": True}, **SAMPLING
    ) as resp:
        assert resp.headers["x-pdgate-path"] == path
        assert resp.headers["content-type"].startswith("text/event-stream")
        chunks = list(resp.parse())
    with_choices = [c for c in chunks if c.choices]
    assert with_choices and with_choices[-1].choices[0].finish_reason == "length"
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (tokens, MAX_TOKENS)
    expect(vllm_pair, gateway, before, path, tokens)


@pytest.mark.parametrize(("path", "tokens"), STREAM_CASES, ids=[c[0] for c in STREAM_CASES])
def test_completions_streaming_with_usage(vllm_pair, gateway, client, path, tokens):
    prompt = completion_prompt(vllm_pair, tokens)
    before = counters(vllm_pair, gateway)
    with client.completions.with_streaming_response.create(
        model=E.MODEL_NAME, prompt=prompt, stream=True, stream_options={"include_usage": True}, **SAMPLING
    ) as resp:
        assert resp.headers["x-pdgate-path"] == path
        chunks = list(resp.parse())
    with_choices = [c for c in chunks if c.choices]
    # vLLM may put two tokens in one chunk (detokenizing split bytes), so count chunks loosely.
    assert 1 <= len(with_choices) <= MAX_TOKENS and with_choices[-1].choices[0].finish_reason == "length"
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (tokens, MAX_TOKENS)
    expect(vllm_pair, gateway, before, path, tokens)


def test_errors_match_the_engines(vllm_pair, gateway, client):
    """What a client sees through the gateway is what it would see from vLLM itself."""
    direct = openai.OpenAI(base_url=vllm_pair.decode.url + "/v1", api_key="unused", max_retries=0)
    too_long = completion_prompt(vllm_pair, 600) * 4  # > max_model_len
    full = completion_prompt(vllm_pair, E.MAX_MODEL_LEN)  # no room for even one output token
    cases = [
        (openai.NotFoundError, {"model": "no-such-model", "prompt": "hi", "max_tokens": 1}),
        (openai.BadRequestError, {"model": E.MODEL_NAME, "prompt": too_long, "max_tokens": 1}),
        (openai.BadRequestError, {"model": E.MODEL_NAME, "prompt": full, "max_tokens": 1}),
    ]
    before = counters(vllm_pair, gateway)
    with direct:
        for exc, body in cases:
            with pytest.raises(exc) as via_engine:
                direct.completions.create(**body)
            with pytest.raises(exc) as via_gateway:
                client.completions.create(**body)
            assert via_gateway.value.status_code == via_engine.value.status_code
    after = counters(vllm_pair, gateway)
    assert (after.xfers, after.failed) == (before.xfers, 0)
    assert E.wait_until(lambda: vllm_pair.prefill.metric(E.KV_USAGE) == 0, timeout=10)


def test_client_kv_transfer_params_never_reach_the_engine(vllm_pair, gateway, client):
    """A decode engine given ``do_remote_prefill`` without a real handle dies (vLLM 0.32: an
    assertion in its scheduler kills the engine core and the server exits). The gateway must
    strip the field: the request is served normally and the engine stays up."""
    messages = chat_messages(vllm_pair, 60)
    before = counters(vllm_pair, gateway)
    out = client.chat.completions.create(
        model=E.MODEL_NAME,
        messages=messages,
        max_tokens=MAX_TOKENS,
        extra_body={"ignore_eos": True, "kv_transfer_params": {"do_remote_prefill": True}},
    )
    assert out.usage.prompt_tokens == 60
    assert httpx.get(vllm_pair.decode.url + "/health", timeout=10).status_code == 200
    expect_direct(vllm_pair, gateway, before, 60)


# -- prompt-token parity: the gateway's count is the engine's ---------------------------------------

_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3, "big": 123456789012345678901}'},
}
_BILLING = "x-anthropic-billing-header: cc_version=2.1; cch=0f3a9"
PARITY_CASES = {
    "system-multi-turn": {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a prime."},
            {"role": "assistant", "content": "Seven."},
            {"role": "user", "content": "Another one?"},
        ]
    },
    "content-parts": {
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": _BILLING}, {"type": "text", "text": "Be kind."}]},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "first"},
                    {"type": "input_text", "text": "second"},
                    {"type": "text", "text": ""},
                    {"type": "refusal", "refusal": "third"},
                    {"type": "thinking", "thinking": "fourth"},
                ],
            },
        ]
    },
    "developer-role": {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "developer", "content": "Answer in French."},
            {"role": "system", "content": _BILLING + "\nsystem rules"},
        ]
    },
    "tool-calls-and-results": {
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [_CALL]},
            {
                "role": "tool",
                "tool_call_id": "call_1",
                "content": [{"type": "text", "text": "sunny"}, {"type": "text", "text": "21C"}],
            },
            {"role": "user", "content": "Thanks", "name": "ann", "task": "chat"},
        ]
    },
    "tools-given": {"messages": [{"role": "user", "content": "Weather?"}], "tools": [_TOOL], "tool_choice": "none"},
    "kwargs-tools-override": {
        "messages": [{"role": "user", "content": "Weather?"}],
        "tools": [_TOOL],
        "tool_choice": "none",
        "chat_template_kwargs": {"tools": [{"name": "other"}]},
    },
    "empty-tool-calls": {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello", "tool_calls": []},
            {"role": "user", "content": "bye"},
        ]
    },
    "null-content": {
        "messages": [
            {"role": "user", "content": "ping"},
            {"role": "assistant", "content": None, "reasoning_content": "hm"},
            {"role": "user", "content": "pong"},
        ]
    },
    "continue-final-message": {
        "messages": [{"role": "user", "content": "Count to five."}, {"role": "assistant", "content": "one two"}],
        "add_generation_prompt": False,
        "continue_final_message": True,
    },
    "chat-template-kwargs": {
        "messages": [{"role": "user", "content": "hello"}],
        "chat_template_kwargs": {"enable_thinking": False, "custom_flag": "x"},
    },
    # (tokenize/truncation/max_length in chat_template_kwargs: the gateway refuses them, issue 27)
}


def _engine_count(pair: Pair, body: dict) -> int:
    r = pair.decode.http.post(pair.decode.url + "/tokenize", json={"model": E.MODEL_NAME, **body})
    assert r.status_code == 200, r.text
    return r.json()["count"]


@pytest.mark.parametrize("case", list(PARITY_CASES), ids=list(PARITY_CASES))
def test_chat_prompt_tokens_match_the_engine(vllm_pair, gateway, case):
    """The gateway's own count (x-pdgate-prompt-tokens) equals the engine's /tokenize count for the
    same conversation and options, and the engine's usage for the request the gateway relayed."""
    body = PARITY_CASES[case]
    want = _engine_count(vllm_pair, body)
    r = httpx.post(
        gateway.url + "/v1/chat/completions",
        timeout=E.REQUEST_TIMEOUT_S,
        json={"model": E.MODEL_NAME, "max_tokens": 1, **body},
    )
    assert r.status_code == 200, r.text
    assert int(r.headers["x-pdgate-prompt-tokens"]) == want
    assert r.json()["usage"]["prompt_tokens"] == want


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_completion_prompt_tokens_match_the_engine(vllm_pair, gateway, add_special_tokens):
    body = {"prompt": "def main():\n    return 0\n", "add_special_tokens": add_special_tokens}
    want = _engine_count(vllm_pair, body)
    r = httpx.post(
        gateway.url + "/v1/completions",
        timeout=E.REQUEST_TIMEOUT_S,
        json={"model": E.MODEL_NAME, "max_tokens": 1, **body},
    )
    assert r.status_code == 200, r.text
    assert int(r.headers["x-pdgate-prompt-tokens"]) == want == r.json()["usage"]["prompt_tokens"]
