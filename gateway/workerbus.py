"""How the worker processes of one gateway (``server.workers``) keep one view: a ZMQ hub.

The supervisor runs an XSUB/XPUB forwarder (``Hub``, ZMQ's own proxy in a thread) on two IPC
sockets in a private folder; every worker publishes on one and subscribes to the other workers'
messages on the other (``WorkerBus``). What travels:

- **learned prefix blocks and forgotten engines** (without Redis): a worker that learns a prompt's
  blocks publishes them and every other worker adds them to its own prefix index, so a
  conversation's next turn finds its prefix whichever worker accepts it; lookups stay local (no
  round trip on the request path). With Redis configured, Redis shares these, as across replicas.
- **in-flight requests per engine** (without Redis): each worker publishes its counts every
  ``SYNC_S``; routing and the per-engine admission limits count the others' (at most one interval
  old, as replicas on Redis do).
- **tenant use** (fair queueing, gateway/tenants.py), with the in-flight counts (without Redis):
  each worker orders its queues by every worker's use.
- **metrics**: ``/metrics`` on any worker asks the others for their exposition and merges it
  (gateway/metricsmerge.py), so a scrape sees the whole gateway.

Messages are one CBOR frame after a topic naming the sender; a worker subscribes to the other
workers' topics only. PUB/SUB drops when a reader is far behind (``_HWM``): learning is a
best-effort hint either way (a wrong belief is corrected by the engine's answer).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import cbor2
import zmq
import zmq.asyncio

from policies.blockhash import BlockHash
from policies.prefix_index import PrefixIndex

from .pools import Pools
from .tasks import cancel_checkpoint, stop_tasks
from .tenants import Usage

log = logging.getLogger(__name__)

SYNC_S = 0.1  # how often a worker publishes its in-flight counts
_STALE_SYNCS = 5  # a worker silent this many intervals counts for nothing (it died or restarts)
_FLUSH_S = 0.005  # learned blocks are batched this long before they are published
_MAX_BATCH = 256  # learn() calls per message
_HWM = 10_000  # messages queued per peer before ZMQ drops


@dataclass(frozen=True)
class BusAddress:
    """Where the supervisor's hub listens; handed to each worker."""

    publish: str  # workers connect PUB here (the hub's XSUB)
    subscribe: str  # workers connect SUB here (the hub's XPUB)


class Hub:
    """The supervisor's forwarder: ZMQ's steerable proxy in a thread, stopped by a TERMINATE."""

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="pdgate-bus-")  # 0700: only this user's processes connect
        self.address = BusAddress(f"ipc://{self._dir}/in", f"ipc://{self._dir}/out")
        self._ctx = zmq.Context()
        self._control = f"inproc://hub-control-{id(self)}"
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="pdgate-bus-hub", daemon=True)
        self._thread.start()
        if not self._ready.wait(5.0):
            raise RuntimeError("the workers' message hub did not start")

    def _run(self) -> None:
        xsub, xpub = self._ctx.socket(zmq.XSUB), self._ctx.socket(zmq.XPUB)
        control = self._ctx.socket(zmq.PAIR)
        for s in (xsub, xpub):
            s.setsockopt(zmq.SNDHWM, _HWM)
            s.setsockopt(zmq.RCVHWM, _HWM)
            s.setsockopt(zmq.LINGER, 0)
        control.setsockopt(zmq.LINGER, 0)
        xsub.bind(self.address.publish)
        xpub.bind(self.address.subscribe)
        control.bind(self._control)
        self._ready.set()
        try:
            zmq.proxy_steerable(xsub, xpub, None, control)
        except zmq.ContextTerminated:
            pass
        finally:
            for s in (xsub, xpub, control):
                s.close(linger=0)

    def stop(self, bound_s: float = 2.0) -> None:
        if self._thread is not None:
            with contextlib.suppress(zmq.ZMQError):
                ctl = self._ctx.socket(zmq.PAIR)
                ctl.setsockopt(zmq.LINGER, 0)
                ctl.connect(self._control)
                ctl.send(b"TERMINATE")
                ctl.close()
            self._thread.join(bound_s)
            if self._thread.is_alive():  # a daemon thread: it ends with the process
                log.warning("the workers' message hub did not stop within %.0f s", bound_s)
            else:
                self._ctx.term()
        for name in ("in", "out"):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self._dir, name))
        with contextlib.suppress(OSError):
            os.rmdir(self._dir)


def _topic(worker: int) -> bytes:
    return b"w%03d" % worker


def _reply_topic(worker: int) -> bytes:
    return b"r%03d" % worker


class WorkerBus:
    """One worker's end of the hub. ``share_routing``: carry learned blocks and in-flight counts
    (off when Redis shares them). Implements policies/prefix_learning.py's ``SharedPrefixes``."""

    def __init__(self, address: BusAddress, worker: int, workers: int, pools: Pools, index: PrefixIndex, *,
                 share_routing: bool, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, usage: Usage | None = None) -> None:
        self.worker, self.workers = worker, workers
        self.share_routing = share_routing
        self._address = address
        self._pools, self._index = pools, index
        self._usage = usage
        self._uses: dict[int, tuple[float, dict[str, dict[str, float]]]] = {}  # worker -> (when heard, use)
        self._clock, self._wall = clock, wall
        self._ctx = zmq.asyncio.Context()
        self._pub: zmq.asyncio.Socket | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self._learned: list[tuple[str, Sequence[BlockHash]]] = []
        self._flush: asyncio.TimerHandle | None = None
        self._counts: dict[int, tuple[float, dict[str, int]]] = {}  # worker -> (when heard, counts)
        self._metric_asks: dict[int, tuple[asyncio.Future[None], dict[int, bytes]]] = {}
        self._asks = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._metrics_text: Callable[[], bytes] = lambda: b""

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self, metrics_text: Callable[[], bytes]) -> None:
        """``metrics_text``: this worker's own exposition, sent when another worker is scraped."""
        self._metrics_text = metrics_text
        self._pub = self._ctx.socket(zmq.PUB)
        self._sub = self._ctx.socket(zmq.SUB)
        for s in (self._pub, self._sub):
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, _HWM)
            s.setsockopt(zmq.RCVHWM, _HWM)
        self._pub.connect(self._address.publish)
        self._sub.connect(self._address.subscribe)
        for other in range(self.workers):
            if other != self.worker:
                self._sub.setsockopt(zmq.SUBSCRIBE, _topic(other))
        self._sub.setsockopt(zmq.SUBSCRIBE, _reply_topic(self.worker))  # metrics answers for this worker only
        self._tasks = [asyncio.create_task(self._receive(), name="bus-receive")]
        if self.share_routing:
            self._tasks.append(asyncio.create_task(self._sync(), name="bus-sync"))

    async def stop(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
            self._publish_learned()
        await stop_tasks(self._tasks)
        self._tasks = []
        for s in (self._pub, self._sub):
            if s is not None:
                s.close(linger=0)
        self._ctx.term()

    # -- SharedPrefixes ----------------------------------------------------------------------------

    def learn(self, url: str, hashes: Sequence[BlockHash]) -> None:
        if not hashes or not self.share_routing:
            return
        self._learned.append((url, list(hashes)))
        if len(self._learned) >= _MAX_BATCH:
            self._publish_learned()
        elif self._flush is None:
            self._flush = asyncio.get_running_loop().call_later(_FLUSH_S, self._publish_learned)

    def forget(self, url: str, until: float) -> None:
        if self.share_routing:
            self._publish_learned()  # blocks learned before the forget must not arrive after it
            self._send(["forget", url, until])

    def _publish_learned(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        batch, self._learned = self._learned, []
        if batch:
            self._send(["learn", batch])

    # -- metrics -----------------------------------------------------------------------------------

    async def others_metrics(self, timeout_s: float = 1.0) -> dict[int, bytes]:
        """The other workers' expositions; those that do not answer within ``timeout_s`` are left out."""
        self._asks += 1
        ask = self._asks
        wanted = self.workers - 1
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        answers: dict[int, bytes] = {}
        self._metric_asks[ask] = (done, answers)
        try:
            self._send(["metrics?", ask])
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    while len(answers) < wanted:
                        await asyncio.shield(done)
                        done = asyncio.get_running_loop().create_future()
                        self._metric_asks[ask] = (done, answers)
            return dict(answers)
        finally:
            self._metric_asks.pop(ask, None)

    # -- the wire ----------------------------------------------------------------------------------

    def _send(self, message: list[Any], to: int | None = None) -> None:
        if self._pub is None:
            return
        topic = _topic(self.worker) if to is None else _reply_topic(to) + b"<" + _topic(self.worker)
        with contextlib.suppress(zmq.Again):  # a full queue drops: these are hints
            self._pub.send_multipart([topic, cbor2.dumps(message)], flags=zmq.NOBLOCK)

    async def _sync(self) -> None:
        while True:
            counts: dict[str, int] = {}
            for ep in self._pools.all():
                if ep.in_flight:
                    counts[ep.url] = counts.get(ep.url, 0) + ep.in_flight
            self._send(["inflight", counts, self._usage.snapshot() if self._usage is not None else {}])
            self._update_others()
            cancel_checkpoint()
            await asyncio.sleep(SYNC_S)

    def _update_others(self) -> None:
        oldest = self._clock() - SYNC_S * _STALE_SYNCS
        total: dict[str, int] = {}
        for at, counts in self._counts.values():
            if at >= oldest:
                for url, n in counts.items():
                    total[url] = total.get(url, 0) + n
        self._pools.others = total
        if self._usage is not None:
            theirs: dict[str, dict[str, float]] = {p: {} for p in Usage.PHASES}
            for at, use in self._uses.values():
                if at >= oldest:
                    for phase, row in use.items():
                        if phase in theirs:
                            t = theirs[phase]
                            for tenant, v in row.items():
                                t[tenant] = t.get(tenant, 0.0) + v
            self._usage.others = theirs

    async def _receive(self) -> None:
        assert self._sub is not None
        while True:
            topic, payload = await self._sub.recv_multipart()
            try:
                sender = int(topic.rpartition(b"<")[2][1:])
                self._apply(sender, cbor2.loads(payload))
            except Exception:  # a malformed message must not end the loop
                log.exception("worker bus: bad message from %r", topic)

    def _apply(self, sender: int, msg: list[Any]) -> None:
        kind = msg[0]
        if kind == "learn":
            for url, hashes in msg[1]:
                self._index.learn(url, hashes)
        elif kind == "forget":
            url, until = msg[1], float(msg[2])
            self._index.forget_learned_until(url, self._clock() - (self._wall() - until))
        elif kind == "inflight":
            self._counts[sender] = (self._clock(), {str(u): int(n) for u, n in msg[1].items()})
            if len(msg) > 2 and isinstance(msg[2], dict):
                self._uses[sender] = (self._clock(), {str(p): {str(t): float(v) for t, v in row.items()}
                                                      for p, row in msg[2].items()})
        elif kind == "metrics?":
            self._send(["metrics!", sender, msg[1], self._metrics_text()], to=sender)
        elif kind == "metrics!":
            asker, ask, text = msg[1], msg[2], msg[3]
            if asker == self.worker and ask in self._metric_asks:
                done, answers = self._metric_asks[ask]
                answers[sender] = text
                if not done.done():
                    done.set_result(None)
