"""End to end: real sim processes on loopback, driven over HTTP like a gateway (or an app) would."""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import orjson
import pytest

from gateway.engines.legs import PREFILL_KV_PARAMS
from tests.procs import free_port, wait_for
from tests.promtext import sample
from tests.sim.helpers import post, sse_events

pytestmark = pytest.mark.e2e

PREFILL_KV = PREFILL_KV_PARAMS  # what the gateway's prefill leg sends
PROMPT = "The decode pool streams tokens while the prefill pool computes the KV cache. " * 4
KV_FIELDS = [
    "do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id", "remote_request_id",
    "remote_host", "remote_port", "tp_size", "dcp_size", "pp_size", "remote_num_tokens",
    "remote_blocks_expiry_time", "transfer_mode", "remote_prefill_cached_tokens",
]  # fmt: skip
INTERNAL_ERROR = {"error": {"message": "Internal server error", "type": "InternalServerError", "param": None,
                            "code": 500}}  # fmt: skip


def prefill_leg(sim, body: dict, request_id: str, path: str = "/v1/completions") -> dict:
    leg = {**body, "stream": False, "max_tokens": 1, "kv_transfer_params": PREFILL_KV}
    leg.pop("stream_options", None)
    r = post(sim, path, leg, request_id)
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def test_full_handshake_by_hand(sims):
    p, d = sims["prefill"], sims["decode"]
    p.clear()
    d.clear()
    body = {"model": "sim", "prompt": PROMPT, "max_tokens": 7}
    expected = post(d, "/v1/completions", body).json()["choices"][0]["text"]  # decode-only run
    ext0 = d.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    hits0 = d.metric("vllm:prefix_cache_hits_total")
    xfer0 = d.metric("vllm:nixl_xfer_time_seconds_count")

    kv = prefill_leg(p, body, "req-pd-1")
    assert list(kv) == KV_FIELDS
    assert kv["remote_engine_id"] == "prefill-e2e" and kv["remote_port"] == p.kv_port
    assert kv["remote_host"] == "127.0.0.1" and kv["remote_request_id"].startswith("cmpl-req-pd-1-0-")
    n_prompt = len(PROMPT.encode()) // 4  # 4 bytes per token without a tokenizer
    assert kv["remote_num_tokens"] == n_prompt and len(kv["remote_block_ids"][0]) == -(-n_prompt // 16)
    assert p.metric("vllm:kv_cache_usage_perc") > 0  # blocks held for the decode engine

    r = post(d, "/v1/completions", {**body, "kv_transfer_params": kv}, "req-pd-1")
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["id"] == "cmpl-req-pd-1" and out["kv_transfer_params"] is None
    assert out["choices"][0]["text"] == expected  # the KV that arrived was this prompt's
    assert out["usage"] == {"prompt_tokens": n_prompt, "total_tokens": n_prompt + 7, "completion_tokens": 7,
                            "prompt_tokens_details": None, "completion_tokens_details": None}  # fmt: skip

    assert wait_for(lambda: p.metric("vllm:kv_cache_usage_perc") == 0)
    # The decode-only run left the prompt's full blocks in the decode engine's prefix cache: the
    # decode leg reuses them (at most prompt - 1 tokens) and pulls only the rest, as vLLM does.
    local = (n_prompt - 1) // 16 * 16
    assert d.metric("vllm:prefix_cache_hits_total") - hits0 == local
    assert d.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer") - ext0 == n_prompt - local
    assert d.metric("vllm:nixl_xfer_time_seconds_count") - xfer0 == 1
    assert d.metric("vllm:nixl_num_failed_transfers_total") == 0
    [pre] = [x for x in p.requests() if x["request_id"] == "req-pd-1"]
    [dec] = [x for x in d.requests() if x["request_id"] == "req-pd-1"]
    assert pre["headers"]["x-request-id"] == dec["headers"]["x-request-id"] == "req-pd-1"
    assert (pre["kind"], dec["kind"], pre["status"], dec["status"]) == ("prefill", "decode", "completed", "completed")
    assert pre["internal_ids"] == [kv["remote_request_id"]] and pre["kv_transfer_params"] == kv
    assert dec["body"]["kv_transfer_params"] == kv  # the body exactly as received


def test_chat_handshake_with_a_streamed_decode_leg(sims):
    p, d = sims["prefill"], sims["decode"]
    body = {"model": "sim", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 5}
    expected = post(d, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    kv = prefill_leg(p, body, "req-chat-1", "/v1/chat/completions")
    assert kv["remote_request_id"].startswith("chatcmpl-req-chat-1-")
    r = post(
        d,
        "/v1/chat/completions",
        {**body, "stream": True, "stream_options": {"include_usage": True}, "kv_transfer_params": kv},
        "req-chat-1",
    )
    assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream; charset=utf-8"
    events = sse_events(r.text)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-2])
    assert text == expected
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 5
    assert wait_for(lambda: p.metric("vllm:kv_cache_usage_perc") == 0)


def test_unknown_handle_reads_the_blocks_anyway_like_nixl(sims):
    """vLLM's pull reads remote blocks by id without checking whose they are: an unknown
    remote_request_id is no error. The decode runs on whatever the blocks hold, and the prefill
    engine counts a notification for a request it does not know."""
    p, d = sims["prefill"], sims["decode"]
    body = {"prompt": PROMPT, "max_tokens": 6}
    expected = post(d, "/v1/completions", body).json()["choices"][0]["text"]
    kv = prefill_leg(p, body, "req-unknown")
    after0 = p.metric("vllm:nixl_num_notifications_after_expiry_total")
    bogus = {**kv, "remote_request_id": "cmpl-never-issued-0-deadbeef"}
    r = post(d, "/v1/completions", {**body, "kv_transfer_params": bogus})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected  # the blocks hold this KV
    assert wait_for(lambda: p.metric("vllm:nixl_num_notifications_after_expiry_total") == after0 + 1)
    # blocks that hold another prompt's KV: still 200, but the text is not the right one
    other = prefill_leg(p, {"prompt": "Some other prompt entirely, " * 9, "max_tokens": 1}, "req-other")
    r = post(d, "/v1/completions", {**body, "kv_transfer_params": {**other, "remote_request_id": "nope"}})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] != expected
    for handle in (kv, other):  # release both
        assert post(d, "/v1/completions", {**body, "kv_transfer_params": handle}).status_code == 200
    assert wait_for(lambda: p.metric("vllm:kv_cache_usage_perc") == 0)


def test_expired_handle(sims):
    p, d = sims["expiring"], sims["decode"]
    body = {"prompt": "short prompt for an engine whose KV expires fast", "max_tokens": 4}
    expected = post(d, "/v1/completions", body).json()["choices"][0]["text"]
    expired0 = p.metric("vllm:nixl_num_kv_expired_reqs_total")
    late0 = p.metric("vllm:nixl_num_notifications_after_expiry_total")
    kv = prefill_leg(p, body, "req-expired")
    assert wait_for(lambda: p.metric("vllm:nixl_num_kv_expired_reqs_total") == expired0 + 1)
    assert p.metric("vllm:kv_cache_usage_perc") == 0
    # Released but not yet reused: the blocks still hold this prompt's KV, so the late pull
    # "works" (as with vLLM); the prefill engine counts the late notification.
    r = post(d, "/v1/completions", {**body, "kv_transfer_params": kv})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected
    assert wait_for(lambda: p.metric("vllm:nixl_num_notifications_after_expiry_total") == late0 + 1)


@pytest.mark.parametrize("stream", [False, True])
def test_wrong_engine_id_fails_like_vllm(sims, stream):
    p, d = sims["prefill"], sims["decode"]
    body = {"prompt": PROMPT, "max_tokens": 4}
    kv = prefill_leg(p, body, f"req-wrong-engine-{stream}")
    failed0 = d.metric("vllm:nixl_num_failed_transfers_total")
    errors0 = d.metric("vllm:request_success_total", finished_reason="error")
    usage = p.metric("vllm:kv_cache_usage_perc")
    r = post(d, "/v1/completions", {**body, "stream": stream, "kv_transfer_params": {**kv, "remote_engine_id": "x"}})
    if stream:
        assert r.status_code == 200
        assert r.text == "data: " + json.dumps(INTERNAL_ERROR) + "\n\ndata: [DONE]\n\n"
    else:
        assert r.status_code == 500 and r.json() == INTERNAL_ERROR
    assert d.metric("vllm:nixl_num_failed_transfers_total") == failed0 + 1
    assert d.metric("vllm:request_success_total", finished_reason="error") == errors0 + 1
    assert p.metric("vllm:kv_cache_usage_perc") == usage  # no handshake, no notification: blocks stay
    assert post(d, "/v1/completions", {**body, "kv_transfer_params": kv}).status_code == 200  # clean up
    assert wait_for(lambda: p.metric("vllm:kv_cache_usage_perc") == 0)


def test_unreachable_side_channel_fails_after_the_handshake_timeout(sims):
    d = sims["decode"]
    kv = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2]],
          "remote_engine_id": "gone", "remote_request_id": "cmpl-x-0-00000000", "remote_host": "127.0.0.1",
          "remote_port": free_port(), "tp_size": 1}  # fmt: skip
    failed0 = d.metric("vllm:nixl_num_failed_transfers_total")
    t0 = time.monotonic()
    r = post(d, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "kv_transfer_params": kv})
    assert r.status_code == 500 and r.json() == INTERNAL_ERROR
    assert 0.4 <= time.monotonic() - t0 < 3  # --kv-handshake-timeout 0.5
    assert d.metric("vllm:nixl_num_failed_transfers_total") == failed0 + 1
    assert d.state()["free_blocks"] == d.state()["total_blocks"]


def test_roles_refuse_misrouted_legs(sims):
    p, d = sims["prefill"], sims["decode"]
    r = post(d, "/v1/completions", {"prompt": "x", "kv_transfer_params": PREFILL_KV})
    assert r.status_code == 400 and "refuses prefill legs" in r.json()["error"]["message"]
    kv = {"do_remote_prefill": True, "remote_block_ids": [[1]], "remote_engine_id": "e",
          "remote_request_id": "r", "remote_host": "127.0.0.1", "remote_port": 1}  # fmt: skip
    r = post(p, "/v1/completions", {"prompt": "x", "kv_transfer_params": kv})
    assert r.status_code == 400 and "refuses decode legs" in r.json()["error"]["message"]
    for sim in (p, d):  # plain requests go anywhere, and say kv_transfer_params: null
        out = post(sim, "/v1/completions", {"prompt": "x", "max_tokens": 2}).json()
        assert out["kv_transfer_params"] is None and out["choices"][0]["finish_reason"] == "length"


def test_prompt_too_long(sims):
    p = sims["expiring"]  # --max-model-len 128
    r = post(p, "/v1/completions", {"prompt": list(range(200))})
    assert r.status_code == 400
    assert r.json() == {"error": {
        "message": "This model's maximum context length is 128 tokens. However, your prompt contains 200 input "
                   "tokens, which exceeds this limit even without any output tokens. Please reduce the length of "
                   "the input prompt. (parameter=input_tokens, value=200)",
        "type": "BadRequestError", "param": "input_tokens", "code": 400}}  # fmt: skip
    r = post(p, "/v1/chat/completions", {"messages": [{"role": "user", "content": "w" * 1000}], "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_tokens"
    [rec] = [x for x in p.requests() if x["endpoint"] == "/v1/chat/completions"][-1:]
    assert rec["status"] == "failed" and rec["http_status"] == 400


def test_openai_client_parses_everything(sims, sim_tokenizer_dir):
    from transformers import AutoTokenizer

    b = sims["tok"]
    tok = AutoTokenizer.from_pretrained(str(sim_tokenizer_dir))
    msgs = [{"role": "user", "content": "How do I reverse a list in Python?"}]
    n_chat = len(tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False))
    with openai.OpenAI(base_url=b.url + "/v1", api_key="x", max_retries=0) as client:
        assert [m.id for m in client.models.list().data] == ["tiny"]
        out = client.completions.create(model="tiny", prompt="import os", max_tokens=5)
        assert out.object == "text_completion" and out.usage.prompt_tokens == len(tok.encode("import os"))
        assert out.usage.completion_tokens == 5 and out.choices[0].finish_reason == "length"
        assert out.choices[0].text and out.system_fingerprint.startswith("vllm-")
        chunks = list(client.completions.create(model="tiny", prompt="import os", max_tokens=5, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text
        chat = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6)
        assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
        assert chat.usage.prompt_tokens == n_chat and chat.usage.completion_tokens == 6
        stream = client.chat.completions.create(
            model="tiny", messages=msgs, max_tokens=6, stream=True, stream_options={"include_usage": True}
        )
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
        assert chunks[-1].usage.prompt_tokens == n_chat
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="nope", prompt="x")
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="tiny", prompt="x", max_tokens=10**6)
        # output token ids are real vocabulary entries that decode to the text
        raw = client.completions.create(model="tiny", prompt="x", max_tokens=4, extra_body={"return_token_ids": True})
        assert tok.decode(raw.choices[0].token_ids) == raw.choices[0].text


def test_request_id_headers(sims):
    b, p = sims["tok"], sims["prefill"]
    r = post(b, "/v1/completions", {"prompt": "x", "max_tokens": 1}, "my-id")
    assert r.headers["x-request-id"] == "my-id" and r.json()["id"] == "cmpl-my-id"
    r = post(b, "/v1/completions", {"prompt": "x", "max_tokens": 1})
    assert len(r.headers["x-request-id"]) == 32  # uuid4 hex, as vLLM's middleware
    assert b.http.get(b.url + "/health").headers["x-request-id"]
    r = post(p, "/v1/completions", {"prompt": "x", "max_tokens": 1}, "my-id")
    assert "x-request-id" not in r.headers and r.json()["id"] == "cmpl-my-id"  # off by default, like vLLM


def test_models_health_version_metrics(sims):
    p = sims["prefill"]
    r = p.http.get(p.url + "/health")
    assert r.status_code == 200 and r.content == b""
    assert p.http.get(p.url + "/version").json() == {"version": "0.32.0"}
    [card] = p.http.get(p.url + "/v1/models").json()["data"]
    assert card["id"] == "sim" and card["max_model_len"] == 8192 and card["owned_by"] == "vllm"
    assert card["object"] == "model" and card["permission"][0]["object"] == "model_permission"
    text = p.metrics()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_count", "vllm:e2e_request_latency_seconds_sum",
                 "vllm:request_queue_time_seconds_count", "vllm:request_prefill_time_seconds_count",
                 "vllm:nixl_xfer_time_seconds_count", "vllm:nixl_bytes_transferred_count",
                 "vllm:nixl_num_failed_transfers_total", "vllm:nixl_num_kv_expired_reqs_total"):  # fmt: skip
        assert f"\n{name}{{" in text, name
    assert "vllm:cache_config_info{" in text and 'num_gpu_blocks="8192"' in text and 'block_size="16"' in text
    assert p.metric("vllm:request_success_total", finished_reason="length") >= 1
    assert p.http.get(p.url + "/nope").json() == {"detail": "Not Found"}


def _hang_up_after(port: int, path: str, body: dict, seconds: float) -> None:
    payload = orjson.dumps(body)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(
            b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (path.encode(), len(payload), payload)
        )
        time.sleep(seconds)


def test_disconnect_while_prefilling_aborts_and_frees_blocks(sims):
    s = sims["slow"]  # 5 ms per prompt token: ~1.3 s of prefill
    s.clear()
    _hang_up_after(s.port, "/v1/completions", {"prompt": "y" * 1000, "max_tokens": 5}, 0.3)
    assert wait_for(lambda: [r["status"] for r in s.requests()] == ["aborted"], timeout=1.0)
    st = s.state()
    assert st["running"] == 0 and st["free_blocks"] == st["total_blocks"]
    assert s.metric("vllm:kv_cache_usage_perc") == 0


def test_disconnect_mid_stream_aborts(sims):
    s = sims["slow"]  # 50 ms per token
    s.clear()
    with httpx.Client(timeout=10) as c, c.stream(
        "POST", s.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "stream": True},
    ) as resp:  # fmt: skip
        next(resp.iter_raw())
    assert wait_for(lambda: [r["status"] for r in s.requests()] == ["aborted"], timeout=1.0)
    [rec] = s.requests()
    assert rec["finish_reasons"] == ["abort"] and rec["stream"] is True
    assert s.state()["free_blocks"] == s.state()["total_blocks"]


def test_queued_requests_show_as_waiting(sims):
    s = sims["slow"]  # one running slot, 50 ms per token: each request runs ~1 s
    body = {"prompt": "z", "max_tokens": 20}

    def one_running_one_waiting() -> bool:
        # One scrape for both gauges: between the first request's end and the second's
        # admission the engine briefly shows waiting=1, running=0.
        text = s.metrics()
        return (sample(text, "vllm:num_requests_running"), sample(text, "vllm:num_requests_waiting")) == (1, 1)

    # The pool is shut down (its requests finished) before the client closes, even on failure.
    with httpx.Client(timeout=10) as c, ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(c.post, s.url + "/v1/completions", json=body) for _ in range(2)]
        assert wait_for(one_running_one_waiting, timeout=5)
        assert [f.result().status_code for f in futures] == [200, 200]
    assert s.metric("vllm:num_requests_waiting") == 0


def test_aborted_queued_decode_leg_releases_prefill_blocks(sims):
    p, s = sims["prefill"], sims["slow"]  # slow: role both, one running slot
    body = {"prompt": PROMPT, "max_tokens": 3}
    kv = prefill_leg(p, body, "req-queued")
    assert p.metric("vllm:kv_cache_usage_perc") > 0
    busy_body = {"prompt": "a", "max_tokens": 20}
    with httpx.Client(timeout=10) as c, ThreadPoolExecutor(1) as pool:
        busy = pool.submit(c.post, s.url + "/v1/completions", json=busy_body)
        assert wait_for(lambda: s.metric("vllm:num_requests_running") == 1, timeout=2)
        _hang_up_after(s.port, "/v1/completions", {**body, "kv_transfer_params": kv}, 0.2)
        assert wait_for(lambda: p.metric("vllm:kv_cache_usage_perc") == 0, timeout=2)
        assert busy.result().status_code == 200
