"""The parts that make several worker processes one gateway, each on its own: the shared admission
gate (two gates on one shared array, as two workers hold them), the metrics merge, and the hub with
two workers' buses (learned blocks, forgotten engines, in-flight counts, metrics on request)."""

from __future__ import annotations

import asyncio
import ctypes
import multiprocessing
import os
import time

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from gateway.cluster.workerbus import Hub, WorkerBus
from gateway.engines.pools import Pools
from gateway.fairness.admission import SharedGate
from gateway.ops.metricsmerge import merge
from policies.beliefs.prefix_index import PrefixIndex
from tests.promtext import sample


def shared_gates(limit: int, workers: int = 2) -> list[SharedGate]:
    ctx = multiprocessing.get_context("spawn")
    slots, lock = ctx.RawArray(ctypes.c_int64, workers), ctx.Lock()
    return [SharedGate(limit, slots, lock, w, poll_s=0.001) for w in range(workers)]


async def test_the_limit_counts_every_workers_slots() -> None:
    a, b = shared_gates(3)
    assert await a.enter(0) and await a.enter(0) and await b.enter(0)
    assert not await b.enter(0.02)  # three held in all: the fourth waits, then is refused
    assert (a.in_flight, b.in_flight, b.queued) == (2, 1, 0)


async def test_a_slot_freed_by_one_worker_goes_to_the_other_workers_waiter() -> None:
    a, b = shared_gates(1)
    assert await a.enter(0)
    waiting = asyncio.create_task(b.enter(5.0))
    await asyncio.sleep(0.01)
    assert not waiting.done() and b.queued == 1
    a.leave()
    assert await asyncio.wait_for(waiting, 1.0)
    assert (a.in_flight, b.in_flight) == (0, 1)
    b.leave()
    assert b.in_flight == 0
    for g in (a, b):
        g.close()


async def test_within_a_worker_a_freed_slot_passes_to_its_own_waiter_first() -> None:
    a, b = shared_gates(1)
    assert await a.enter(0)
    mine = asyncio.create_task(a.enter(5.0))
    await asyncio.sleep(0.005)
    a.leave()
    assert await asyncio.wait_for(mine, 1.0)
    assert a.in_flight == 1 and not await b.enter(0.01)
    for g in (a, b):
        g.close()


async def test_a_client_that_leaves_while_queued_takes_no_slot() -> None:
    a, b = shared_gates(1)
    assert await a.enter(0)
    waiting = asyncio.create_task(b.enter(5.0))
    await asyncio.sleep(0.005)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    a.leave()
    await asyncio.sleep(0.01)
    assert (a.in_flight, b.in_flight, b.queued) == (0, 0, 0)
    for g in (a, b):
        g.close()


def exposition(requests: float, healthy: int, kv_events: float, connected: int, in_flight: int) -> bytes:
    r = CollectorRegistry()
    Counter("pdgate_requests", "", ["status"], registry=r).labels("200").inc(requests)
    Histogram("pdgate_request_duration_seconds", "", buckets=(0.1, 1.0), registry=r).observe(0.05 * requests)
    Gauge("pdgate_pool_healthy_endpoints", "", ["pool"], registry=r).labels("decode").set(healthy)
    Counter("pdgate_kv_events", "", ["engine"], registry=r).labels("e1").inc(kv_events)
    Gauge("pdgate_kv_events_connected", "", ["engine"], registry=r).labels("e1").set(connected)
    Gauge("pdgate_pool_in_flight_requests", "", ["pool"], registry=r).labels("decode").set(in_flight)
    return generate_latest(r)


def test_merged_metrics_sum_each_workers_work_and_count_shared_observations_once() -> None:
    text = merge([exposition(3, 2, 10, 1, 4), exposition(5, 2, 10, 0, 1)]).decode()
    assert sample(text, "pdgate_requests_total", status="200") == 8
    assert sample(text, "pdgate_request_duration_seconds_count") == 2  # one observation each
    assert sample(text, "pdgate_request_duration_seconds_bucket", le="0.1") == 0  # 0.15 s and 0.25 s
    assert sample(text, "pdgate_request_duration_seconds_bucket", le="1.0") == 2
    assert sample(text, "pdgate_request_duration_seconds_sum") == pytest.approx(0.4)
    assert sample(text, "pdgate_pool_in_flight_requests", pool="decode") == 5
    assert sample(text, "pdgate_pool_healthy_endpoints", pool="decode") == 2  # not 4
    assert sample(text, "pdgate_kv_events_total", engine="e1") == 10  # each worker applied the same events
    assert sample(text, "pdgate_kv_events_connected", engine="e1") == 0  # one worker's feed is down


def test_a_silent_workers_last_answer_keeps_its_counts_but_not_its_gauges() -> None:
    """A worker that died mid-request: its requests stay counted (a sum that went down would read
    as a counter reset), its in-flight gauge no longer shows requests nobody serves."""
    text = merge([exposition(3, 2, 10, 1, 4)], stale=[exposition(5, 2, 10, 1, 7)]).decode()
    assert sample(text, "pdgate_requests_total", status="200") == 8
    assert sample(text, "pdgate_request_duration_seconds_count") == 2
    assert sample(text, "pdgate_pool_in_flight_requests", pool="decode") == 4  # the live worker's alone
    assert sample(text, "pdgate_pool_healthy_endpoints", pool="decode") == 2


def test_merging_one_exposition_changes_no_value() -> None:
    one = exposition(3, 2, 10, 1, 4)
    for name, labels in (
        ("pdgate_requests_total", {"status": "200"}),
        ("pdgate_kv_events_total", {"engine": "e1"}),
        ("pdgate_request_duration_seconds_sum", {}),
    ):
        assert sample(merge([one]).decode(), name, **labels) == sample(one.decode(), name, **labels)


@pytest.fixture
def hub():
    h = Hub()
    h.start()
    yield h
    h.stop()


async def buses(
    hub: Hub, share_routing: bool = True, usages: list | None = None, texts: list | None = None
) -> list[tuple[WorkerBus, Pools, PrefixIndex]]:
    made = []
    n = len(texts) if texts else 2
    for w in range(n):
        pools = Pools([], ["http://d1", "http://d2"])
        index = PrefixIndex()
        bus = WorkerBus(
            hub.address, w, n, pools, index, share_routing=share_routing, usage=usages[w] if usages else None
        )
        await bus.start(texts[w] if texts else lambda w=w: exposition(w + 1, 1, 0, 1, 0))
        made.append((bus, pools, index))
    await asyncio.sleep(0.3)  # subscriptions reach the hub (ZMQ's slow joiner)
    return made


async def until(check, timeout: float = 3.0) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        if check():
            return True
        await asyncio.sleep(0.01)
    return check()


async def test_blocks_one_worker_learns_reach_the_others_index_and_forgetting_too(hub) -> None:
    (a, _, ia), (b, _, ib) = await buses(hub)
    try:
        a.learn("http://d1", [11, 12, 13])
        assert await until(lambda: ib.match([11, 12, 13, 14]).get("http://d1") == 3)
        assert ia.match([11, 12, 13]) == {}  # the bus never echoes to the sender
        a.learn("http://d2", [11])
        assert await until(lambda: ib.match([11]).get("http://d2") == 1)
        a.forget("http://d2", until=time.time())  # d2 restarted: what was learned about it is void
        assert await until(lambda: "http://d2" not in ib.match([11]))
        assert ib.match([11, 12, 13]).get("http://d1") == 3
    finally:
        await asyncio.gather(a.stop(), b.stop())


async def test_each_worker_counts_the_others_in_flight_requests(hub) -> None:
    (a, pa, _), (b, pb, _) = await buses(hub)
    try:
        pa.decode[0].in_flight = 3
        assert await until(lambda: pb.others.get("http://d1") == 3)
        pa.decode[0].in_flight = 0
        assert await until(lambda: pb.others.get("http://d1", 0) == 0)
        assert pa.others.get("http://d1", 0) == 0  # not its own
    finally:
        await asyncio.gather(a.stop(), b.stop())


async def test_each_worker_orders_its_queues_by_every_workers_tenant_use(hub) -> None:
    from gateway.fairness.tenants import Usage

    ua, ub = Usage(), Usage()
    (a, _, _), (b, _, _) = await buses(hub, usages=[ua, ub])
    try:
        key = ua.decode_started("flood", 300)
        ua.prefill_sent("flood", 5000)
        assert await until(
            lambda: ub.of("decode", "flood") == pytest.approx(300, rel=0.05) and ub.of("occupancy", "flood") == 300
        )
        assert ub.of("prefill", "flood") == pytest.approx(5000, rel=0.05)
        assert ua.others["decode"] == {}  # not its own
        ua.decode_ended(key, 300)
        assert await until(lambda: ub.of("occupancy", "flood") == 0)
    finally:
        await asyncio.gather(a.stop(), b.stop())


async def test_a_worker_gathers_the_others_metrics(hub) -> None:
    (a, _, _), (b, _, _) = await buses(hub, share_routing=False)
    try:
        got = await a.others_metrics(timeout_s=2.0)
        assert list(got) == [1]
        assert sample(got[1].decode(), "pdgate_requests_total", status="200") == 2
        await b.stop()
        started = asyncio.get_running_loop().time()
        assert await a.others_metrics(timeout_s=0.2) == {}  # a worker that does not answer is left out, in time
        assert asyncio.get_running_loop().time() - started < 1.0
    finally:
        await a.stop()


async def test_a_worker_late_for_a_scrape_counts_with_the_newest_answer_any_scrape_got(hub) -> None:
    """Scrapes land on any worker. The one serving counts a sibling that does not answer in time
    with the newest figures any earlier scrape got from it, not with its own older copy: a summed
    counter that went down would read as a reset to Prometheus (rates spike)."""
    from types import SimpleNamespace

    from gateway.http.handlers import Gateway

    done = {0: 1, 1: 1, 2: 10}
    texts = [lambda w=w: exposition(done[w], 1, 0, 1, 0) for w in range(3)]
    made = await buses(hub, share_routing=False, texts=texts)
    gateways = [
        Gateway(None, SimpleNamespace(metrics=SimpleNamespace(render=t), bus=b))
        for t, (b, _, _) in zip(texts, made, strict=True)
    ]

    async def total(serving: int) -> float:
        return sample((await gateways[serving].metrics()).decode(), "pdgate_requests_total", status="200")

    try:
        assert await total(0) == 12  # worker 0 serves: worker 2 answers 10
        done[2] = 100
        assert await total(1) == 102  # worker 1 serves: worker 2 answers 100 (to every worker)
        latest = made[0][0].latest_metrics
        assert await until(lambda: sample(latest.get(2, b"").decode(), "pdgate_requests_total", status="200") == 100)
        await made[2][0].stop()  # worker 2 stops answering
        assert await total(0) >= 102  # worker 0 counts it with 100, the newest any scrape got
    finally:
        await asyncio.gather(made[0][0].stop(), made[1][0].stop())


def test_a_containers_cpu_quota_caps_the_default_worker_count(tmp_path) -> None:
    from gateway.cluster.workers import usable_cores

    cores = len(os.sched_getaffinity(0))
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert usable_cores(str(tmp_path)) == cores  # no limit: every core this process may use
    (tmp_path / "cpu.max").write_text("50000 100000\n")
    assert usable_cores(str(tmp_path)) == 1  # half a core: one worker
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert usable_cores(str(v1)) == 1


async def test_without_a_limit_slots_are_still_counted_and_a_limit_set_later_counts_them() -> None:
    a, b = shared_gates(0)
    assert await a.enter(0) and await a.enter(0) and await b.enter(0)
    assert (a.in_flight, b.in_flight) == (2, 1)
    for g in (a, b):
        g.limit = 3  # a reload sets a bound: the slots already held count
    assert not await b.enter(0.01)
    a.leave()
    assert await b.enter(0.5)


def test_every_gauge_the_gateway_exports_has_a_declared_merge_rule() -> None:
    """A gauge summed across workers when every worker reports the same value would be counted N
    times: each new gauge must be placed in one of the merge's sets."""
    from prometheus_client.parser import text_string_to_metric_families

    from gateway.fairness.admission import Gate, LoopLag
    from gateway.fairness.tenants import Usage
    from gateway.http.connections import Connections
    from gateway.ops.metrics import GatewayMetrics
    from gateway.ops.metricsmerge import DECLARED

    pools = Pools(["http://p1"], ["http://d1"])
    metrics = GatewayMetrics(pools, PrefixIndex())
    metrics.watch_admission(Gate(0), Connections(0), LoopLag())
    usage = Usage()
    usage.decode_started("t", 1)
    usage.prefill_sent("t", 1)
    metrics.watch_tenants(usage, str, lambda: [("decode", 1)])
    gauges = {
        f.name
        for f in text_string_to_metric_families(metrics.render().decode())
        if f.type == "gauge" and not f.name.endswith("_created")
    }
    assert "pdgate_pool_healthy_endpoints" in gauges and "pdgate_admission_in_flight" in gauges
    assert gauges - DECLARED == set()


def test_the_default_worker_count_fits_a_containers_memory_limit(tmp_path) -> None:
    from gateway.cluster.workers import WORKER_BYTES, worker_count
    from gateway.config import parse_config

    cfg = parse_config(
        {
            "models": [{"name": "m", "tokenizer": "t", "max_model_len": 10}],
            "pools": {"decode": {"endpoints": ["http://d:8000"]}},
        }
    )
    cores = len(os.sched_getaffinity(0))
    (tmp_path / "cpu.max").write_text("max 100000\n")
    (tmp_path / "memory.max").write_text("max\n")
    assert worker_count(cfg, str(tmp_path)) == cores
    (tmp_path / "memory.max").write_text(f"{WORKER_BYTES + (200 << 20)}\n")  # room for one worker
    assert worker_count(cfg, str(tmp_path)) == 1
    explicit = parse_config({**cfg.model_dump(mode="json", exclude_none=True), "server": {"workers": 3}})
    assert worker_count(explicit, str(tmp_path)) == 3  # an explicit count is the operator's


# -- a restarted worker starts from the config the workers applied last (issue 27) ----------------


def _config(threshold: int):
    from gateway.config import PinnedFiles, parse_config

    cfg = parse_config(
        {
            "models": [{"name": "m", "tokenizer": "t", "max_model_len": 100}],
            "pools": {"decode": {"endpoints": ["http://127.0.0.1:9"]}},
            "routing": {"decider": {"name": "token_threshold", "threshold": threshold}},
        }
    )
    return cfg.pin(PinnedFiles({}))


class _FakeProcess:
    """Records what a worker would be started with (no process)."""

    started: list = []

    def __init__(self, target, args, name, daemon) -> None:
        self.spec = args[0]
        self.pid, self.sentinel = 0, None

    def start(self) -> None:
        _FakeProcess.started.append(self.spec)


def test_a_restarted_worker_gets_the_config_applied_last_whichever_worker_reported_it(caplog) -> None:
    import types

    from gateway.cluster.workers import Supervisor, WorkerSpec, _Reporter
    from tests.waiting import wait_for

    startup = _config(100)
    spec = WorkerSpec("c.yaml", startup, "v-start", "127.0.0.1", 0, 0, 2, None, os.getpid())  # no hub: only passed on
    sup = Supervisor(spec, startup)
    ctx = multiprocessing.get_context("spawn")
    sup._mp = types.SimpleNamespace(Process=_FakeProcess, Pipe=ctx.Pipe)  # no process: what it gets
    _FakeProcess.started = []
    sup._start(0, None)
    assert _FakeProcess.started[-1].version == "v-start"
    writers = []
    for i in range(2):  # each worker's pipe, its end held here
        reader, writer = ctx.Pipe(duplex=False)
        sup._reports[i] = reader
        writers.append(writer)
    # worker 1 applied v3 (its reporter thread sends it); worker 0 had applied v2 earlier, but its
    # report happens to arrive later
    applied_v2_at = time.monotonic()
    _Reporter(writers[1])(_config(300), "v3")
    assert wait_for(lambda: sup._reports[1].poll(0), timeout=10)
    writers[0].send((applied_v2_at, _config(200), "v2"))
    writers[0].send(("not", "a", "report"))  # a malformed report is ignored, loudly
    sup._collect_reports()
    assert sup.latest[2] == "v3" and sup.latest[1].routing.decider.params["threshold"] == 300
    assert "wrong shape" in caplog.text
    writers[0].close()  # worker 0 dies: its pipe ends, and it is started again
    sup._start(0, None)
    assert sup._reports[0] is not None  # a new pipe for the new worker
    again = _FakeProcess.started[-1]
    assert (again.index, again.version, again.config.routing.decider.params["threshold"]) == (0, "v3", 300)
    assert again.config.pinned is not None  # with the files it named, as applied
