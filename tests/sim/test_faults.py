"""Fault injection (engine_model.faults): the spec, the runtime route, and what a client sees for each fault.

In-process tests (httpx's ASGI transport; P/D pairs talk over the real TCP side channel) cover the
spec, error answers and failed KV pulls; real sim processes cover what only a socket shows: a hang,
a slow first byte or stream, a dropped connection, a crash.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time

import httpx
import pytest

from engine_model.config import SimConfig
from engine_model.faults import ConnectionDropped, Faults, FaultSpecError, FaultySend, Plan
from gateway.engines.legs import PREFILL_KV_PARAMS
from sim.app import create_app
from sim.cli import build_parser, config_from_args
from tests.procs import ProcGroup, free_port, wait_for
from tests.sim.conftest import metric, start_sims
from tests.waiting import until

PROMPT = "Fault injection makes the simulator fail on purpose, exactly when a test wants it to. " * 3
PREFILL_KV = PREFILL_KV_PARAMS  # what the gateway's prefill leg sends
INTERNAL_ERROR = {"error": {"message": "Internal server error", "type": "InternalServerError", "param": None,
                            "code": 500}}  # fmt: skip
RETRYABLE_ERROR = {"error": {"message": "Request failed; please retry", "type": "ServiceUnavailableError",
                             "param": None, "code": 503}}  # fmt: skip
STREAM_ERROR = "data: " + json.dumps(INTERNAL_ERROR) + "\n\ndata: [DONE]\n\n"


# ---------------------------------------------------------------------- the spec


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ([], "must be a JSON object"),
        ({"explode": {}}, "unknown fault 'explode'"),
        ({"error": {"status": 404}}, "error.status must be 500 or 503"),
        ({"error": {"on": "sometimes"}}, "unknown request kind 'sometimes'"),
        ({"error": {"on": []}}, "non-empty list"),
        ({"hang": {"count": 0}}, "hang.count must be at least 1"),
        ({"drop": {"after_chunks": 1.5}}, "drop.after_chunks must be an integer"),
        ({"slow": {}}, "first_byte_delay or chunk_delay above 0"),
        ({"slow": {"chunk_delay": -1}}, "slow.chunk_delay must be at least 0"),
        ({"error": {"probability": 2}}, "between 0.0 and 1.0"),
        ({"kv_refuse": {"on": "decode"}}, "kv_refuse: unknown key 'on'"),
        ({"drop": {"after": 2}}, "drop: unknown key 'after'"),
        ({"seed": "x"}, "seed must be an integer"),
    ],
)
def test_bad_specs_are_refused_with_the_reason(spec, message):
    with pytest.raises(FaultSpecError, match=message):
        Faults(spec)


def test_count_and_scope_fail_exactly_the_next_matching_requests():
    f = Faults({"error": {"on": ["decode", "direct"], "count": 2, "status": 503}})
    assert f.plan("prefill").error_status is None  # out of scope: does not use up the count
    assert [f.plan("decode").error_status, f.plan("plain").error_status, f.plan("decode").error_status] == [
        503,
        503,
        None,
    ]
    snap = f.snapshot()
    assert snap["faults"]["error"] == {"status": 503, "on": ["decode", "direct"], "count": 2, "remaining": 0,
                                       "probability": 1.0}  # fmt: skip
    assert snap["injected"] == {"error": 2, "hang": 0, "slow": 0, "drop": 0, "kv_refuse": 0}


def test_error_is_drawn_before_hang_and_slow_combines_with_drop():
    f = Faults({"error": {"count": 1}, "hang": {"count": 1}, "slow": {"chunk_delay": 0.1}, "drop": {}})
    first, second, third = f.plan("plain"), f.plan("plain"), f.plan("plain")
    assert (first.error_status, first.hang, first.applied) == (500, False, ["error"])
    assert (second.hang, second.applied) == (True, ["hang"])  # hang's count was still there
    assert (third.chunk_delay, third.drop_after, third.applied) == (0.1, 0, ["slow", "drop"])


def test_probability_is_reproducible_with_a_seed():
    def pattern(seed: int) -> list[bool]:
        f = Faults({"seed": seed, "error": {"probability": 0.3}})
        return [f.plan("plain").error_status is not None for _ in range(400)]

    a = pattern(7)
    assert a == pattern(7) and a != pattern(8)
    assert 0.2 < sum(a) / len(a) < 0.4
    f = Faults({"seed": 1, "kv_refuse": {"probability": 0.5, "count": 3}})
    assert sum(f.refuse_kv_read() for _ in range(100)) == 3  # count caps a probabilistic fault


def test_cli_flags():
    p = build_parser()
    cfg = config_from_args(p.parse_args(["--faults", '{"seed": 3, "hang": {"on": "decode"}}',
                                         "--kv-load-failure-policy", "recompute"]))  # fmt: skip
    assert cfg.faults == {"seed": 3, "hang": {"on": "decode"}} and cfg.kv_load_failure_policy == "recompute"
    with pytest.raises(ValueError, match="not valid JSON"):
        config_from_args(p.parse_args(["--faults", "{oops"]))
    with pytest.raises(ValueError, match="faults: unknown fault 'boom'"):
        config_from_args(p.parse_args(["--faults", '{"boom": {}}']))
    assert config_from_args(p.parse_args([])).kv_load_failure_policy == "fail"


# ---------------------------------------------------------------------- the response shaper


class Recorder:
    def __init__(self) -> None:
        self.messages: list[dict] = []

    async def __call__(self, message: dict) -> None:
        self.messages.append(message)

    def bodies(self) -> list[bytes]:
        return [m["body"] for m in self.messages if m["type"] == "http.response.body"]


def sse_body(*names: str) -> bytes:
    return b"".join(b"data: " + n.encode() + b"\n\n" for n in names)


async def feed(send: FaultySend, *bodies: bytes) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    for i, body in enumerate(bodies):
        await send({"type": "http.response.body", "body": body, "more_body": i < len(bodies) - 1})


@pytest.mark.parametrize(("after", "sent"), [(0, []), (2, [b"a", b"b"]), (4, [b"a", b"b", b"c", b"d"]),
                                             (99, [b"a", b"b", b"c", b"d"])])  # fmt: skip
async def test_drop_cuts_a_stream_after_k_events_and_never_sends_the_last(after, sent):
    rec = Recorder()
    send = FaultySend(rec, Plan(drop_after=after), stream=True, closed=asyncio.Event())
    with pytest.raises(ConnectionDropped):
        await feed(send, sse_body("a"), sse_body("b", "c"), sse_body("d", "[DONE]"))
    assert rec.messages[0]["type"] == "http.response.start"  # the status line went out
    assert b"".join(rec.bodies()) == sse_body(*(s.decode() for s in sent))


async def test_drop_cuts_a_full_body_in_half():
    rec = Recorder()
    send = FaultySend(rec, Plan(drop_after=0), stream=False, closed=asyncio.Event())
    with pytest.raises(ConnectionDropped):
        await feed(send, b"0123456789")
    assert rec.messages[1] == {"type": "http.response.body", "body": b"01234", "more_body": True}


async def test_chunk_delay_sends_one_event_at_a_time_and_stops_when_the_client_leaves():
    rec = Recorder()
    closed = asyncio.Event()
    send = FaultySend(rec, Plan(chunk_delay=0.01), stream=True, closed=closed)
    await feed(send, sse_body("a", "b"), sse_body("c", "[DONE]"))
    assert rec.bodies() == [sse_body(x) for x in ("a", "b", "c", "[DONE]")]
    assert [m.get("more_body") for m in rec.messages[1:]] == [True, True, True, False]
    slow = FaultySend(Recorder(), Plan(first_byte_delay=30), stream=False, closed=closed)
    asyncio.get_running_loop().call_later(0.05, closed.set)
    t0 = time.monotonic()
    await feed(slow, b"{}")  # ends as soon as the client is gone, sends nothing
    assert time.monotonic() - t0 < 5 and slow.send.messages == []


# ---------------------------------------------------------------------- in-process engines


@contextlib.asynccontextmanager
async def client(**kw):
    app = create_app(SimConfig(**kw))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://sim") as c:
            c.app = app
            yield c


async def prefill(p: httpx.AsyncClient, body: dict) -> dict:
    r = await p.post("/v1/completions", json={**body, "max_tokens": 1, "kv_transfer_params": PREFILL_KV})
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


async def sim_metric(c: httpx.AsyncClient, name: str, **labels: str) -> float:
    return metric((await c.get("/metrics")).text, name, **labels)


async def test_faults_route_get_put_delete_and_state():
    async with client() as c:
        assert (await c.get("/sim/faults")).json() == {
            "faults": {"seed": None},
            "injected": {"error": 0, "hang": 0, "slow": 0, "drop": 0, "kv_refuse": 0},
        }
        r = await c.put("/sim/faults", json={"seed": 5, "drop": {"after_chunks": 3, "on": ["decode"], "count": 2}})
        assert r.status_code == 200
        assert r.json()["faults"] == {"seed": 5, "drop": {"after_chunks": 3, "on": ["decode"], "count": 2,
                                                          "remaining": 2, "probability": 1.0}}  # fmt: skip
        bad = await c.put("/sim/faults", json={"drop": {"after_chunks": -1}})
        assert bad.status_code == 400 and "drop.after_chunks must be at least 0" in bad.json()["detail"]
        bad = await c.put("/sim/faults", content=b"{nope")
        assert bad.status_code == 400 and "not valid JSON" in bad.json()["detail"]
        assert (await c.get("/sim/faults")).json()["faults"]["drop"]["after_chunks"] == 3  # unchanged
        assert (await c.get("/sim/state")).json()["faults"]["faults"]["seed"] == 5
        assert (await c.delete("/sim/faults")).json()["faults"] == {"seed": None}


async def test_error_fault_answers_vllm_error_bodies_then_stops():
    async with client(faults={"error": {"count": 1}}) as c:  # the start-up state (--faults)
        body = {"prompt": "abcd", "max_tokens": 2}  # one token
        r = await c.post("/v1/completions", json=body)
        assert r.status_code == 500 and r.json() == INTERNAL_ERROR
        assert (await c.post("/v1/completions", json=body)).status_code == 200  # count spent
        await c.put("/sim/faults", json={"error": {"status": 503, "count": 1}})
        r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                       "stream": True})  # fmt: skip
        assert r.status_code == 503 and r.json() == RETRYABLE_ERROR  # an HTTP error, not an SSE stream
        recs = (await c.get("/sim/requests")).json()["requests"]
        assert [(x["status"], x["http_status"], x["fault"]) for x in recs] == [
            ("failed", 500, "error"),
            ("completed", 200, None),
            ("failed", 503, "error"),
        ]
        assert (await c.get("/sim/faults")).json()["injected"]["error"] == 2
        assert await sim_metric(c, "vllm:prompt_tokens_total") == 1  # failed requests never reached the engine


async def test_error_fault_on_a_decode_leg_releases_the_prefill_blocks():
    async with client(role="prefill", engine_id="P") as p, client(role="decode") as d:
        kv = await prefill(p, {"prompt": PROMPT})
        assert len((await p.get("/sim/state")).json()["held"]) == 1
        await d.put("/sim/faults", json={"error": {"on": ["decode"], "count": 1}})
        r = await d.post("/v1/completions", json={"prompt": PROMPT, "kv_transfer_params": kv})
        assert r.status_code == 500 and r.json() == INTERNAL_ERROR

        async def released() -> bool:
            return (await p.get("/sim/state")).json()["held"] == {}

        await until(released, timeout=3)


@pytest.mark.parametrize("stream", [False, True])
async def test_kv_refuse_fails_the_decode_leg_like_a_failed_nixl_read(stream):
    async with client(role="prefill", engine_id="P", kv_expiry=0.5) as p, client(role="decode") as d:
        await p.put("/sim/faults", json={"kv_refuse": {"count": 1}})
        body = {"prompt": PROMPT, "max_tokens": 3}
        kv = await prefill(p, body)
        r = await d.post("/v1/completions", json={**body, "stream": stream, "kv_transfer_params": kv})
        if stream:
            assert r.status_code == 200 and r.text == STREAM_ERROR  # vLLM: error event, then [DONE]
        else:
            assert r.status_code == 500 and r.json() == INTERNAL_ERROR
        assert await sim_metric(d, "vllm:nixl_num_failed_transfers_total") == 1
        assert await sim_metric(d, "vllm:request_success_total", finished_reason="error") == 1
        assert (await d.get("/sim/state")).json()["free_blocks"] == (await d.get("/sim/state")).json()["total_blocks"]
        assert (await p.get("/sim/faults")).json()["injected"]["kv_refuse"] == 1
        [rec] = (await d.get("/sim/requests")).json()["requests"]
        assert rec["status"] == "failed" and "refused the read" in rec["error"]
        # The failed read carries no notification: the prefill blocks wait for their expiry.
        assert len((await p.get("/sim/state")).json()["held"]) == 1

        async def expired() -> bool:
            return await sim_metric(p, "vllm:nixl_num_kv_expired_reqs_total") == 1

        await until(expired, timeout=3)
        assert (await p.get("/sim/state")).json()["held"] == {}
        kv = await prefill(p, body)  # the fault is spent: the next pull works
        assert (await d.post("/v1/completions", json={**body, "kv_transfer_params": kv})).status_code == 200


async def test_kv_refuse_with_the_recompute_policy_prefills_locally():
    async with (
        client(role="prefill", engine_id="P", kv_expiry=0.5, faults={"kv_refuse": {}}) as p,
        client(role="decode", kv_load_failure_policy="recompute") as d,
        client() as ref,
    ):
        body = {"prompt": PROMPT, "max_tokens": 5}
        expected = (await ref.post("/v1/completions", json=body)).json()["choices"][0]["text"]
        kv = await prefill(p, body)
        r = await d.post("/v1/completions", json={**body, "kv_transfer_params": kv})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected
        n_prompt = r.json()["usage"]["prompt_tokens"]
        assert await sim_metric(d, "vllm:nixl_num_failed_transfers_total") == 1
        assert await sim_metric(d, "vllm:prompt_tokens_by_source_total", source="local_compute") == n_prompt
        assert await sim_metric(d, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 0
        st = (await d.get("/sim/state")).json()
        assert st["free_blocks"] == st["total_blocks"] and st["running"] == st["waiting"] == 0


async def test_crash_route_answers_then_exits():
    async with client() as c:
        calls: list[int] = []
        c.app.state.sim.exit = calls.append
        r = await c.post("/sim/crash")
        assert r.status_code == 200 and r.json()["crashing"] is True and calls == [1]


# ---------------------------------------------------------------------- real processes


@pytest.fixture(scope="module")
def fault_sims(tmp_path_factory: pytest.TempPathFactory):
    """prefill/decode: a P/D pair (prefill blocks expire after 1 s); both: a plain engine whose
    tokens take 10 ms. Each test sets its faults; they are cleared after it."""
    group = ProcGroup(tmp_path_factory.mktemp("fault-sim-logs"))
    http = httpx.Client(timeout=30)
    try:
        yield start_sims(
            group,
            {
                "prefill": "--role prefill --kv-expiry 1 --engine-id fault-prefill",
                "decode": "--role decode",
                "both": "--decode-time-per-token 0.01",
            },
            http,
        )
    finally:
        http.close()
        group.stop_all()


@pytest.fixture
def sims_(fault_sims):
    yield fault_sims
    for sim in fault_sims.values():
        sim.http.delete(sim.url + "/sim/faults")


def set_faults(sim, spec: dict) -> None:
    r = sim.http.put(sim.url + "/sim/faults", json=spec)
    assert r.status_code == 200, r.text


def last_record(sim) -> dict:
    return sim.requests()[-1]


def idle(sim) -> bool:
    st = sim.state()
    return st["running"] == 0 and st["waiting"] == 0 and st["free_blocks"] == st["total_blocks"]


def read_raw_until_dropped(url: str, body: dict) -> bytes:
    data = b""
    with (
        httpx.Client(timeout=10) as c,
        pytest.raises(httpx.RemoteProtocolError),
        c.stream("POST", url, json=body) as resp,
    ):
        assert resp.status_code == 200
        for chunk in resp.iter_raw():
            data += chunk
    return data


@pytest.mark.e2e
def test_hang_never_answers_and_forgets_the_request_when_the_client_leaves(sims_):
    b = sims_["both"]
    set_faults(b, {"hang": {"count": 1}})
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(b.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=0.5)
    assert wait_for(lambda: last_record(b)["status"] == "aborted", timeout=2)
    assert last_record(b)["fault"] == "hang" and idle(b)
    assert b.http.post(b.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
    assert b.http.get(b.url + "/sim/faults").json()["injected"]["hang"] == 1


@pytest.mark.e2e
def test_a_hung_decode_leg_releases_the_prefill_blocks_when_its_client_leaves(sims_):
    p, d = sims_["prefill"], sims_["decode"]
    set_faults(d, {"hang": {"on": ["decode"], "count": 1}})
    expired0 = p.metric("vllm:nixl_num_kv_expired_reqs_total")
    body = {"prompt": PROMPT, "max_tokens": 3}
    r = p.http.post(p.url + "/v1/completions", json={**body, "max_tokens": 1, "kv_transfer_params": PREFILL_KV})
    kv = r.json()["kv_transfer_params"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(d.url + "/v1/completions", json={**body, "kv_transfer_params": kv}, timeout=0.3)
    assert wait_for(lambda: p.state()["held"] == {}, timeout=0.6)  # released when the client left...
    assert p.metric("vllm:nixl_num_kv_expired_reqs_total") == expired0  # ...not by the 1 s expiry


@pytest.mark.e2e
def test_slow_first_byte_and_slow_chunks(sims_):
    b = sims_["both"]
    body = {"prompt": "slow", "max_tokens": 4, "stream": True}
    set_faults(b, {"slow": {"first_byte_delay": 2.0, "count": 1}})
    with pytest.raises(httpx.ReadTimeout):  # not even the status line within 0.3 s
        httpx.post(b.url + "/v1/completions", json=body, timeout=httpx.Timeout(5, read=0.3))
    assert wait_for(lambda: last_record(b)["status"] == "aborted", timeout=2) and idle(b)
    set_faults(b, {"slow": {"chunk_delay": 2.0, "count": 1}})
    got: list[bytes] = []
    with (
        httpx.Client(timeout=httpx.Timeout(5, read=0.3)) as c,
        pytest.raises(httpx.ReadTimeout),
        c.stream("POST", b.url + "/v1/completions", json=body) as resp,
    ):
        for chunk in resp.iter_raw():
            got.append(chunk)
    assert len(got) == 1 and got[0].count(b"data: ") == 1  # one event, then nothing within 0.3 s
    assert wait_for(lambda: idle(b), timeout=2)
    r = b.http.post(b.url + "/v1/completions", json=body)  # the fault is spent
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")


@pytest.mark.e2e
def test_drop_closes_a_stream_after_k_chunks(sims_):
    b = sims_["both"]
    set_faults(b, {"drop": {"after_chunks": 2, "on": ["direct"], "count": 1}})
    data = read_raw_until_dropped(b.url + "/v1/completions", {"prompt": "drop", "max_tokens": 8, "stream": True})
    events = [e for e in data.split(b"\n\n") if e]
    assert len(events) == 2 and all(json.loads(e[6:])["object"] == "text_completion" for e in events)
    assert wait_for(lambda: last_record(b)["status"] == "dropped", timeout=2)
    assert last_record(b)["fault"] == "drop" and wait_for(lambda: idle(b), timeout=2)
    assert b.http.get(b.url + "/sim/faults").json()["injected"]["drop"] == 1


@pytest.mark.e2e
def test_drop_cuts_a_full_response_before_its_end(sims_):
    p = sims_["prefill"]
    set_faults(p, {"drop": {"on": ["prefill"], "count": 1}})
    leg = {"prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": PREFILL_KV}
    with pytest.raises(httpx.RemoteProtocolError, match=r"incomplete|peer closed"):
        httpx.post(p.url + "/v1/completions", json=leg, timeout=5)
    assert wait_for(lambda: last_record(p)["status"] == "dropped", timeout=2)
    # The prefill finished before its answer was cut: its blocks wait for a pull, then expire.
    assert wait_for(lambda: p.state()["held"] == {}, timeout=3)


@pytest.mark.e2e
def test_kv_refuse_between_real_engines(sims_):
    p, d = sims_["prefill"], sims_["decode"]
    set_faults(p, {"kv_refuse": {"count": 1}})
    failed0 = d.metric("vllm:nixl_num_failed_transfers_total")
    body = {"prompt": PROMPT, "max_tokens": 3}
    kv = p.http.post(p.url + "/v1/completions", json={**body, "max_tokens": 1, "kv_transfer_params": PREFILL_KV})
    r = d.http.post(d.url + "/v1/completions", json={**body, "stream": True,
                                                    "kv_transfer_params": kv.json()["kv_transfer_params"]})  # fmt: skip
    assert r.status_code == 200 and r.text == STREAM_ERROR
    assert d.metric("vllm:nixl_num_failed_transfers_total") == failed0 + 1
    assert p.http.get(p.url + "/sim/faults").json()["injected"]["kv_refuse"] == 1
    assert wait_for(lambda: p.state()["held"] == {}, timeout=3)  # the 1 s expiry


@pytest.mark.e2e
def test_crash_exits_at_once_and_cuts_open_streams(tmp_path):
    group = ProcGroup(tmp_path)
    port = free_port()
    args = ["--decode-time-per-token", "0.02", "--faults", '{"error": {"status": 503, "count": 1}}']
    proc = group.start("crash", [sys.executable, "-m", "sim", "--port", str(port), *args])
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_http(url + "/health", timeout=60)
        body = {"prompt": "crash", "max_tokens": 500, "stream": True}
        assert httpx.post(url + "/v1/completions", json=body).status_code == 503  # --faults at start-up
        with httpx.Client(timeout=10) as c, c.stream("POST", url + "/v1/completions", json=body) as resp:
            it = resp.iter_raw()
            next(it)  # the stream is running
            assert httpx.post(url + "/sim/crash").json()["crashing"] is True
            with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
                for _ in it:
                    pass
        assert proc.popen.wait(5) == 1
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health")
    finally:
        group.stop_all()
