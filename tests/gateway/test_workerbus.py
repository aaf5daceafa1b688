"""The workers' hub against other processes of the same user (issue 27.7): a process that
connects to the hub and sends forged, replayed or garbage messages changes nothing a worker
counts, is logged at most once per interval, and the hub's folder never outlives its supervisor.

The forger here is a ZMQ socket of the test process, connected to the hub's sockets as any
process of the user could be; tests/e2e/test_attacks_metrics.py does the same to a real gateway
from a separate process."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import cbor2
import pytest
import zmq
import zmq.asyncio

from gateway.cluster import workerbus
from gateway.cluster.workerbus import BusAddress, Hub, WorkerBus, _mac, sweep
from gateway.engines.pools import Pools
from gateway.fairness.tenants import Usage
from policies.beliefs.prefix_index import PrefixIndex
from tests.waiting import until

D1 = "http://d1"


@pytest.fixture
def hub():
    h = Hub()
    h.start()
    yield h
    h.stop()


async def two_workers(hub: Hub) -> list[tuple[WorkerBus, Pools, PrefixIndex, Usage]]:
    made = []
    for w in range(2):
        pools, index, usage = Pools([], [D1, "http://d2"]), PrefixIndex(), Usage()
        bus = WorkerBus(hub.address, w, 2, pools, index, share_routing=True, usage=usage)
        await bus.start(lambda w=w: f"# worker {w}\n".encode())
        made.append((bus, pools, index, usage))
    await asyncio.sleep(0.3)  # subscriptions reach the hub (ZMQ's slow joiner)
    return made


class Forger:
    """Another process of the same user: a PUB on the hub's input, a SUB on its output."""

    def __init__(self, hub: Hub) -> None:
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.sub = self.ctx.socket(zmq.SUB)
        for s in (self.pub, self.sub):
            s.setsockopt(zmq.LINGER, 0)
        self.pub.connect(hub.address.publish)
        self.sub.connect(hub.address.subscribe)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")  # it can read what the workers say, too

    async def send(self, *frames: bytes) -> None:
        await self.pub.send_multipart(list(frames))

    def close(self) -> None:
        self.pub.close(0)
        self.sub.close(0)
        self.ctx.term()


def inflight(counts: dict, use: dict | None = None) -> bytes:
    return cbor2.dumps(["inflight", counts, use or {}])


async def test_forged_and_garbage_messages_change_no_count_and_are_logged_once(hub, caplog) -> None:
    (a, pa, _, ua), (b, pb, ib, ub) = await two_workers(hub)
    forger = Forger(hub)
    await asyncio.sleep(0.3)
    caplog.set_level(logging.WARNING, logger="gateway.cluster.workerbus")
    try:
        pa.decode[0].in_flight = 2  # the truth: worker 0 has 2 requests on d1
        ua.decode_started("calm", 100)
        await until(lambda: pb.others.get(D1) == 2 and ub.of("occupancy", "calm") == 100, timeout=5)
        bad_mac = b"\0" * 16
        stamp = (1 << 63).to_bytes(8, "big")  # "far in the future": would block the real worker's next ones
        for _ in range(300):
            # the old wire format (topic, body): what any process of the user could send before
            await forger.send(b"w000", inflight({D1: 1000}, {"occupancy": {"calm": 1e12}}))
            await forger.send(b"w000", cbor2.dumps(["learn", [[D1, [1, 2, 3]]]]))
            await forger.send(b"w000", cbor2.dumps(["forget", D1, 1e30]))
            # the new format with a made-up signature, unknown senders, garbage
            await forger.send(b"w000", stamp, inflight({D1: 1000}), bad_mac)
            await forger.send(b"w0007", stamp, inflight({D1: 1000}), bad_mac)  # passes the w000 prefix filter
            await forger.send(b"w000", stamp, cbor2.dumps(["metrics!", 1, 1, b"pdgate_fake 1\n"]), bad_mac)
            await forger.send(b"w000", b"\xff" * 7, b"not cbor", b"x")
            await forger.send(b"w000")
        await asyncio.sleep(0.5)
        assert await until_dropped(b, 300 * 6)
        assert pb.others.get(D1) == 2 and ub.of("occupancy", "calm") == 100  # still the truth
        assert ib.match([1, 2, 3]) == {}  # no forged lesson
        assert await b.others_metrics(timeout_s=2.0) == {0: b"# worker 0\n"}  # no forged answer either
        assert b.latest_metrics == {0: b"# worker 0\n"}
        pa.decode[0].in_flight = 3  # the real worker is still heard (no stamp from the future took its place)
        await until(lambda: pb.others.get(D1) == 3, timeout=5)
        assert b.dropped["forged"] >= 300 * 6 and b.dropped["replayed"] == b.dropped["invalid"] == 0
        lines = [r for r in caplog.records if "worker bus: dropped" in r.getMessage()]
        assert 1 <= len(lines) <= 2, [r.getMessage() for r in lines]  # ~2,000 drops, one line per 10 s
        assert not any(r.exc_info for r in caplog.records)  # never a traceback per message
    finally:
        forger.close()
        await asyncio.gather(a.stop(), b.stop())


async def until_dropped(bus: WorkerBus, n: int) -> bool:
    try:
        await until(lambda: sum(bus.dropped.values()) >= n, timeout=10)
    except AssertionError:
        return False
    return True


async def test_a_recorded_message_replayed_is_refused(hub) -> None:
    """The forger reads a real worker's signed message off the hub and sends it again later."""
    (a, pa, _, _), (b, pb, _, _) = await two_workers(hub)
    forger = Forger(hub)
    await asyncio.sleep(0.3)
    try:
        pa.decode[0].in_flight = 50
        while True:  # record worker 0's message that says 50
            frames = await asyncio.wait_for(forger.sub.recv_multipart(), 5)
            if frames[0] == b"w000" and cbor2.loads(frames[2])[1] == {D1: 50}:
                break
        pa.decode[0].in_flight = 0
        await until(lambda: pb.others.get(D1, 0) == 0, timeout=5)
        for _ in range(20):
            await forger.send(*frames)
        await until(lambda: b.dropped["replayed"] >= 20, timeout=5)
        await asyncio.sleep(0.2)
        assert pb.others.get(D1, 0) == 0
    finally:
        forger.close()
        await asyncio.gather(a.stop(), b.stop())


INVALID = [
    ["inflight", {D1: -5}, {}],
    ["inflight", {D1: "5"}, {}],
    ["inflight", {D1: True}, {}],
    ["inflight", {D1: 1 << 40}, {}],
    ["inflight", {D1: 1}, {"occupancy": {"t": float("nan")}}],
    ["inflight", {D1: 1}, {"bogus": {}}],
    ["inflight", {D1: 1}, {"decode": {"x" * 200: 1}}],
    ["inflight", {"u" * 3000: 1}, {}],
    ["inflight", [D1, 1]],
    ["learn", [[D1, [1, "two"]]]],
    ["learn", [[D1, list(range(workerbus._MAX_HASHES + 1))]]],
    ["learn", [[D1, [1]]] * (workerbus._MAX_BATCH + 1)],
    ["learn", []],
    ["forget", D1, float("inf")],
    ["metrics?", -1],
    ["metrics!", 0, 1, b"x"],
    ["metrics!", 1, 1, "text"],
    ["hello"],
    "inflight",
    [],
]


async def test_a_signed_message_that_breaks_the_protocol_changes_nothing(hub) -> None:
    """Signed with the real secret (a bug, or two versions side by side): types, ranges, sizes
    and known ids are still checked before anything is applied."""
    (a, pa, _, _), (b, pb, ib, ub) = await two_workers(hub)
    forger = Forger(hub)
    await asyncio.sleep(0.3)
    try:
        pa.decode[0].in_flight = 2
        await until(lambda: pb.others.get(D1) == 2, timeout=5)
        for i, message in enumerate(INVALID, 1):
            # Newer than anything a sends meanwhile (a busy machine may delay a's own next message
            # past a small margin, and b would then drop this one as replayed, not invalid).
            when = max(a._stamp, time.monotonic_ns()) + 3600 * 10**9 + i
            topic, stamp = b"w000", when.to_bytes(8, "big")
            body = cbor2.dumps(message)
            await forger.send(topic, stamp, body, _mac(hub.address.secret, topic, stamp, body))
            await until(lambda i=i: b.dropped["invalid"] == i, timeout=5, what=f"{message!r:.80} dropped")
            assert pb.others.get(D1) == 2 and ub.others["decode"] == {} and ib.match([1]) == {}, message
        # the invalid messages, stamped an hour ahead, did not make a's own later ones look replayed
        pa.decode[0].in_flight = 3
        await until(lambda: pb.others.get(D1) == 3, timeout=5, what="a's next count taken")
        assert b.dropped["replayed"] == 0
    finally:
        forger.close()
        await asyncio.gather(a.stop(), b.stop())


async def test_the_hub_disconnects_a_sender_of_oversized_frames(hub) -> None:
    (a, pa, _, _), (b, pb, _, _) = await two_workers(hub)
    forger = Forger(hub)
    await asyncio.sleep(0.3)
    try:
        await forger.send(b"w000", b"\0" * (workerbus._MAX_FRAME_BYTES + 1))
        pa.decode[0].in_flight = 4
        await until(lambda: pb.others.get(D1) == 4, timeout=5)  # the workers go on
        await asyncio.sleep(0.3)
        assert sum(b.dropped.values()) == 0  # never reached a worker
    finally:
        forger.close()
        await asyncio.gather(a.stop(), b.stop())


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def stale_socket(path: str) -> None:
    """A Unix socket file nobody listens on any more (what a killed hub leaves)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.close()


def test_a_start_sweeps_folders_of_hubs_that_are_gone_and_only_those(tmp_path) -> None:
    gone = tmp_path / f"pdgate-bus-{dead_pid()}-abc123"
    gone.mkdir(mode=0o700)
    for name in ("in", "out"):
        stale_socket(str(gone / name))
    live_pid = tmp_path / f"pdgate-bus-{os.getpid()}-def456"  # its supervisor runs
    live_pid.mkdir()
    listened = tmp_path / f"pdgate-bus-{dead_pid()}-ghi789"  # a live hub (another pid namespace?)
    listened.mkdir()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(listened / "in"))
    listener.listen(1)
    more = tmp_path / f"pdgate-bus-{dead_pid()}-jkl012"  # holds something else: not ours to delete
    more.mkdir()
    (more / "notes.txt").write_text("keep")
    other = tmp_path / "pdgate-bus-notapid"
    other.mkdir()
    try:
        assert sweep(str(tmp_path)) == 1
        assert not gone.exists()
        assert live_pid.exists() and listened.exists() and (more / "notes.txt").exists() and other.exists()
    finally:
        listener.close()


HUB_PROCESS = """
import time
from gateway.cluster.workerbus import Hub
hub = Hub()
hub.start()
print(hub.address.publish, hub.address.subscribe, hub.address.folder, hub.address.secret.hex(), flush=True)
time.sleep(600)
"""


@pytest.fixture
def hub_process():
    """A supervisor's hub in a process of its own, to be killed with -9."""
    proc = subprocess.Popen([sys.executable, "-c", HUB_PROCESS], stdout=subprocess.PIPE, text=True)
    try:
        yield proc, proc.stdout.readline().split()
    finally:
        proc.kill()
        proc.wait()


def exists(path: str) -> bool:
    return os.path.exists(path)


async def test_workers_remove_the_folder_of_a_hub_killed_and_keep_a_live_ones(hub_process) -> None:
    """kill -9 of the supervisor leaves its hub's folder: the orphaned workers remove it as they
    stop, and only then (a worker that stops while its hub lives leaves it)."""
    proc, (publish, subscribe, folder, secret) = hub_process
    assert os.path.basename(folder).startswith(f"pdgate-bus-{proc.pid}-")
    hub = SimpleNamespace(address=BusAddress(publish, subscribe, folder, bytes.fromhex(secret)))
    assert secret not in repr(hub.address)
    (a, pa, _, _), (b, pb, _, _) = await two_workers(hub)
    pa.decode[0].in_flight = 1
    await until(lambda: pb.others.get(D1) == 1, timeout=5)  # they talk through that hub
    await a.stop()  # a worker that stops while the hub lives (a restart, a drain): the folder stays
    assert exists(folder)
    proc.kill()
    proc.wait()
    assert exists(os.path.join(folder, "in"))  # what kill -9 leaves
    await b.stop()  # the orphaned worker stopping
    assert not exists(folder)
