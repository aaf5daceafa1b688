"""The stream shapes of the generation routes (sim.streaming), against real sim processes: chunk
keys in vLLM's order, continuous and final usage, the chat role chunk, the fingerprint."""

from __future__ import annotations

import pytest

from tests.sim.helpers import post, sse_events

pytestmark = pytest.mark.e2e


def test_completion_stream_shape(sims):
    b = sims["tok"]
    body = {"model": "tiny", "prompt": "def main():", "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    events = sse_events(post(b, "/v1/completions", body, "stream-1").text)
    chunks, usage, done = events[:-2], events[-2], events[-1]
    assert done == "[DONE]" and len(chunks) == 4
    for i, c in enumerate(chunks, 1):
        assert list(c) == ["id", "object", "created", "model", "choices", "usage"]
        assert c["id"] == "cmpl-stream-1" and c["object"] == "text_completion" and c["model"] == "tiny"
        [choice] = c["choices"]
        assert list(choice) == ["index", "text", "logprobs", "finish_reason", "stop_reason", "prompt_token_ids",
                                "token_ids"]  # fmt: skip
        assert choice["finish_reason"] == ("length" if i == 4 else None)
        assert c["usage"]["completion_tokens"] == i
    assert list(usage) == ["id", "object", "created", "model", "choices", "usage", "system_fingerprint"]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
    assert usage["system_fingerprint"].startswith("vllm-0.32.0-")
    full = post(b, "/v1/completions", {**body, "stream": False, "stream_options": None}).json()
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]
    # without include_usage the final content chunk carries the fingerprint instead
    events = sse_events(post(b, "/v1/completions", {**body, "stream_options": None}).text)
    assert "system_fingerprint" in events[-2] and "usage" not in events[-2]


def test_chat_stream_shape(sims):
    b = sims["tok"]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3, "stream": True}
    events = sse_events(post(b, "/v1/chat/completions", body).text)
    first, chunks, done = events[0], events[1:-1], events[-1]
    assert list(first) == ["id", "object", "created", "model", "choices", "prompt_token_ids", "prompt_text"]
    assert first["object"] == "chat.completion.chunk" and first["id"].startswith("chatcmpl-")
    assert first["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}]  # fmt: skip
    assert [list(c["choices"][0]) for c in chunks[:-1]] == [["index", "delta", "logprobs", "finish_reason",
                                                              "token_ids"]] * 2  # fmt: skip
    last = chunks[-1]["choices"][0]
    assert list(last) == ["index", "delta", "logprobs", "finish_reason", "stop_reason", "token_ids"]
    assert last["finish_reason"] == "length" and done == "[DONE]"
