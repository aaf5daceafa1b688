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
- **tenant use** (fair queueing, gateway/fairness/tenants.py), with the in-flight counts (without Redis):
  each worker orders its queues by every worker's use.
- **metrics**: ``/metrics`` on any worker asks the others for their exposition and merges it
  (gateway/ops/metricsmerge.py), so a scrape sees the whole gateway. The answers go to every
  worker, each keeping every sibling's newest (``latest_metrics``): a sibling late for one scrape
  counts with the newest figures any earlier scrape got, whichever worker served it.

Messages are one CBOR frame after a topic naming the sender; a worker subscribes to the other
workers' topics only. PUB/SUB drops when a reader is far behind (``_HWM``): learning is a
best-effort hint either way (a wrong belief is corrected by the engine's answer).

**Who may speak on it.** The sockets live in a 0700 folder, so only processes of the gateway's
user can connect, but any of those could (a shell, another service under the same user) and
forge in-flight counts, tenant use, learned blocks or metrics. So every message carries a MAC
(HMAC-SHA256 over its topic, a stamp and its body, keyed by a random secret the supervisor hands
each worker at spawn, never in argv or the environment) and a stamp (the host's monotonic clock,
rising per sender), and a worker accepts a message only from a known sibling (its index, not its
own), with a valid MAC, newer than the last it took from that sibling (a recorded message
replayed is refused), and whose fields have the types, ranges and sizes the protocol allows. What
fails is dropped, counted (``pdgate_worker_bus_dropped_messages_total{reason}``) and logged at most
once per ``_LOG_EVERY_S``; never a traceback per message. The hub refuses frames over
``_MAX_FRAME_BYTES`` (ZMQ disconnects the sender). What the MAC does not cover: a process of the
same user that can ptrace a worker (read its memory) can do anything that worker can; the
messages are not encrypted (they are readable by the same user, as the config and keys files are).

**The folder** is named ``pdgate-bus-<supervisor pid>-<random>``. A supervisor killed with -9
cannot remove it: its workers, which stop themselves when orphaned, remove it as they stop once
nothing listens on its sockets any more, and a hub starting sweeps folders of this user that
nobody listens on and whose supervisor is gone (the whole process group killed).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import math
import os
import re
import secrets
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import cbor2
import zmq
import zmq.asyncio

from gateway.background import cancel_checkpoint, stop_tasks
from gateway.engines.pools import Pools
from gateway.fairness.tenants import Usage
from policies.beliefs.blockhash import BlockHash
from policies.beliefs.prefix_index import PrefixIndex

log = logging.getLogger(__name__)

SYNC_S = 0.1  # how often a worker publishes its in-flight counts
_STALE_SYNCS = 5  # a worker silent this many intervals counts for nothing (it died or restarts)
_FLUSH_S = 0.005  # learned blocks are batched this long before they are published
_MAX_BATCH = 256  # learn() calls per message
_MAX_BATCH_HASHES = 65_536  # block hashes per message (a longer prompt goes alone)
_HWM = 10_000  # messages queued per peer before ZMQ drops
_FOLDER = re.compile(r"pdgate-bus-([0-9]{1,10})-[A-Za-z0-9_]{1,64}")
_SOCKETS = ("in", "out")
# What a message may hold: a sibling's messages stay far inside these; past them one is invalid.
_MAX_FRAME_BYTES = 64 << 20  # the hub's bound on one frame (the largest learn batch: ~2.3 MB; an exposition: < 1 MB)
_MAX_SUBSCRIPTION_BYTES = 4096  # the hub's bound on what a subscriber sends it (topics of a few bytes)
_MAX_HASHES = 1 << 20  # block hashes in one learn message
_MAX_URL_CHARS = 2048
_MAX_ENGINES = 65_536  # engines in one in-flight message
_MAX_IN_FLIGHT = 1 << 24  # requests one worker has open on one engine
_MAX_TENANTS = 1_000_001  # tenants per phase in one message: fairness.max_tenants' bound, and "other"
_MAX_NAME_CHARS = 128
_MAX_USE = 1e18
_MAC_BYTES = 16
_REPLAY_GRACE_NS = 1_000_000_000  # a message stamped this long before a worker subscribed is still news
_LOG_EVERY_S = 10.0  # dropped messages: one WARNING at most this often
DROP_REASONS = ("forged", "replayed", "invalid")


@dataclass(frozen=True)
class BusAddress:
    """Where the supervisor's hub listens, and the secret its messages are signed with; handed to
    each worker at spawn (pickled through the spawn pipe: never in argv or the environment)."""

    publish: str  # workers connect PUB here (the hub's XSUB)
    subscribe: str  # workers connect SUB here (the hub's XPUB)
    folder: str  # the hub's private folder (0700)
    secret: bytes = field(repr=False)  # keys every message's MAC


def _mac(secret: bytes, topic: bytes, stamp: bytes, body: bytes) -> bytes:
    """HMAC-SHA256 (truncated to 128 bits) of a message; the topic's length first, so where the
    topic ends and the fixed-size stamp starts is never ambiguous."""
    mac = hmac.new(secret, len(topic).to_bytes(2, "big"), hashlib.sha256)
    for part in (topic, stamp, body):
        mac.update(part)
    return mac.digest()[:_MAC_BYTES]


class Hub:
    """The supervisor's forwarder: ZMQ's steerable proxy in a thread, stopped by a TERMINATE."""

    def __init__(self) -> None:
        sweep(tempfile.gettempdir())
        # 0700: only this user's processes connect. The supervisor's pid in the name says whose it is.
        self._dir = tempfile.mkdtemp(prefix=f"pdgate-bus-{os.getpid()}-")
        self.address = BusAddress(f"ipc://{self._dir}/in", f"ipc://{self._dir}/out", self._dir, secrets.token_bytes(32))
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
        # A peer that sends a larger frame is disconnected by ZMQ before the frame is kept.
        xsub.setsockopt(zmq.MAXMSGSIZE, _MAX_FRAME_BYTES)
        xpub.setsockopt(zmq.MAXMSGSIZE, _MAX_SUBSCRIPTION_BYTES)
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
        remove_folder(self._dir)


def _listening(path: str) -> bool:
    """Whether a process accepts connections on the Unix socket ``path`` (a hub alive)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.setblocking(False)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError, NotADirectoryError):
        return False
    except OSError:  # a full backlog (EAGAIN), or anything else: taken as alive
        return True
    finally:
        probe.close()
    return True


def abandoned(folder: str) -> bool:
    """Nobody listens on the hub's sockets in ``folder``: its supervisor is gone."""
    return not any(_listening(os.path.join(folder, name)) for name in _SOCKETS)


def remove_folder(folder: str) -> bool:
    """A hub's folder removed: its two sockets, then the folder, nothing else (a folder holding
    anything more stays)."""
    for name in _SOCKETS:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(folder, name))
    try:
        os.rmdir(folder)
    except OSError:
        return False
    return True


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # another user's (EPERM), or not a pid: not ours to judge
        return True
    return True


def sweep(root: str) -> int:
    """Hub folders in ``root`` left behind when a supervisor was killed with its workers (nobody
    left to remove them): this user's, whose supervisor pid is gone and on whose sockets nobody
    listens. Removed; returns how many."""
    removed = 0
    try:
        entries = list(os.scandir(root))
    except OSError:
        return 0
    uid = os.getuid()
    for entry in entries:
        found = _FOLDER.fullmatch(entry.name)
        if found is None:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or _pid_alive(int(found[1])) or not abandoned(entry.path):
            continue
        if remove_folder(entry.path):
            removed += 1
            log.info("removed %s: the workers' hub of a gateway (pid %s) that is gone", entry.path, found[1])
    return removed


def _topic(worker: int) -> bytes:
    return b"w%03d" % worker


class _Invalid(ValueError):
    """An authentic message that breaks the protocol."""


def _int(value: Any, low: int, high: int, what: str) -> int:
    if type(value) is not int or not low <= value <= high:
        raise _Invalid(f"{what}: not an integer in [{low}, {high}]")
    return value


def _number(value: Any, what: str) -> float:
    if type(value) not in (int, float) or not math.isfinite(value) or abs(value) > _MAX_USE:
        raise _Invalid(f"{what}: not a finite number")
    return float(value)


def _text(value: Any, most: int, what: str) -> str:
    if type(value) is not str or not 0 < len(value) <= most:
        raise _Invalid(f"{what}: not a string of 1-{most} characters")
    return value


def _mapping(value: Any, most: int, what: str) -> dict[Any, Any]:
    if type(value) is not dict or len(value) > most:
        raise _Invalid(f"{what}: not a map of at most {most} entries")
    return value


def _hash_ok(h: Any) -> bool:
    return (type(h) is int and -(1 << 63) <= h < 1 << 64) or (type(h) is bytes and 0 < len(h) <= 64)


def _learn_batch(batch: Any) -> list[tuple[str, list[BlockHash]]]:
    if type(batch) is not list or not 0 < len(batch) <= _MAX_BATCH:
        raise _Invalid(f"learn: not a list of 1-{_MAX_BATCH} prompts")
    total, out = 0, []
    for item in batch:
        if type(item) is not list or len(item) != 2 or type(item[1]) is not list:
            raise _Invalid("learn: not [url, hashes]")
        url, hashes = _text(item[0], _MAX_URL_CHARS, "learn url"), item[1]
        total += len(hashes)
        if total > _MAX_HASHES or not all(map(_hash_ok, hashes)):
            raise _Invalid(f"learn: more than {_MAX_HASHES} hashes, or one not a block hash")
        out.append((url, hashes))
    return out


def _counts(value: Any) -> dict[str, int]:
    return {
        _text(url, _MAX_URL_CHARS, "inflight url"): _int(n, 0, _MAX_IN_FLIGHT, "inflight count")
        for url, n in _mapping(value, _MAX_ENGINES, "inflight").items()
    }


def _use(value: Any) -> dict[str, dict[str, float]]:
    use: dict[str, dict[str, float]] = {}
    for phase, row in _mapping(value, len(Usage.PHASES), "use").items():
        if phase not in Usage.PHASES:
            raise _Invalid("use: not a phase")
        # A fading sum can round a hair below 0: kept at 0.
        use[phase] = {
            _text(t, _MAX_NAME_CHARS, "use tenant"): max(0.0, _number(v, "use"))
            for t, v in _mapping(row, _MAX_TENANTS, "use").items()
        }
    return use


class WorkerBus:
    """One worker's end of the hub. ``share_routing``: carry learned blocks and in-flight counts
    (off when Redis shares them). Implements policies/beliefs/prefix_learning.py's ``SharedPrefixes``."""

    def __init__(
        self,
        address: BusAddress,
        worker: int,
        workers: int,
        pools: Pools,
        index: PrefixIndex,
        *,
        share_routing: bool,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        usage: Usage | None = None,
    ) -> None:
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
        self._learned_hashes = 0
        self._flush: asyncio.TimerHandle | None = None
        self._counts: dict[int, tuple[float, dict[str, int]]] = {}  # worker -> (when heard, counts)
        self._metric_asks: dict[int, tuple[asyncio.Future[None], dict[int, bytes]]] = {}
        self._asks = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._metrics_text: Callable[[], bytes] = lambda: b""
        # Each sibling's newest exposition, whoever asked for it: answers go to every worker, so a
        # scrape that a sibling misses counts it with the newest figures any scrape saw (summed
        # counters must never go down, whichever worker serves the next scrape).
        self.latest_metrics: dict[int, bytes] = {}
        siblings = [w for w in range(workers) if w != worker]
        # The topic each sibling sends on (every message goes to every worker), and who sent it.
        self._senders = {_topic(w): w for w in siblings}
        self._stamp = 0  # the last stamp this worker sent
        self._heard: dict[int, int] = {}  # sibling -> the last stamp taken from it
        self.dropped = dict.fromkeys(DROP_REASONS, 0)  # messages dropped, by reason (exported)
        self._unlogged = 0
        self._next_log = 0.0

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self, metrics_text: Callable[[], bytes]) -> None:
        """``metrics_text``: this worker's own exposition, sent when another worker is scraped."""
        self._metrics_text = metrics_text
        floor = time.monotonic_ns() - _REPLAY_GRACE_NS  # older messages were sent before this worker listened
        self._heard = {w: floor for w in self._senders.values()}
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
        # The supervisor was killed (this worker stops because it is orphaned): nobody else would
        # remove the hub's folder. While the hub lives its sockets answer, and the folder stays.
        folder = self._address.folder
        if abandoned(folder) and remove_folder(folder):
            log.info("removed the workers' hub folder %s: its supervisor is gone", folder)

    # -- SharedPrefixes ----------------------------------------------------------------------------

    def learn(self, url: str, hashes: Sequence[BlockHash]) -> None:
        if not hashes or not self.share_routing:
            return
        hashes = list(hashes[:_MAX_HASHES])  # a prompt's leading blocks are a valid lesson on their own
        if self._learned and self._learned_hashes + len(hashes) > _MAX_BATCH_HASHES:
            self._publish_learned()
        self._learned.append((url, hashes))
        self._learned_hashes += len(hashes)
        if len(self._learned) >= _MAX_BATCH or self._learned_hashes >= _MAX_BATCH_HASHES:
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
        batch, self._learned, self._learned_hashes = self._learned, [], 0
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

    def _send(self, message: list[Any]) -> None:
        if self._pub is None:
            return
        topic = _topic(self.worker)
        self._stamp = max(time.monotonic_ns(), self._stamp + 1)  # rising, also within one nanosecond
        stamp = self._stamp.to_bytes(8, "big")
        body = cbor2.dumps(message)
        with contextlib.suppress(zmq.Again):  # a full queue drops: these are hints
            self._pub.send_multipart(
                [topic, stamp, body, _mac(self._address.secret, topic, stamp, body)], flags=zmq.NOBLOCK
            )

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
                        t = theirs[phase]
                        for tenant, v in row.items():
                            t[tenant] = t.get(tenant, 0.0) + v
            self._usage.others = theirs

    async def _receive(self) -> None:
        assert self._sub is not None
        while True:
            self._take(await self._sub.recv_multipart())

    def _take(self, frames: list[bytes]) -> None:
        """One message off the hub: applied if a sibling sent it, newly, and it is well formed."""
        topic = frames[0]
        if len(frames) != 4:
            self._drop("forged", topic, f"{len(frames)} frames")
            return
        _, stamp, body, mac = frames
        sender = self._senders.get(topic)
        if (
            sender is None
            or len(stamp) != 8
            or not hmac.compare_digest(mac, _mac(self._address.secret, topic, stamp, body))
        ):
            self._drop("forged", topic, "unknown topic" if sender is None else "bad signature")
            return
        when = int.from_bytes(stamp, "big")
        if when <= self._heard[sender]:
            self._drop("replayed", topic, "not newer than the last message taken from this worker")
            return
        try:
            self._apply(sender, cbor2.loads(body))
        except Exception as err:  # validated before anything is applied; a message must not end the loop
            self._drop("invalid", topic, f"{type(err).__name__}: {err}")
            return
        # Only a message taken moves the sender's clock on: an invalid one stamped far ahead would
        # otherwise make every later genuine message of that worker look replayed.
        self._heard[sender] = when

    def _drop(self, reason: str, topic: bytes, detail: str) -> None:
        self.dropped[reason] += 1
        self._unlogged += 1
        now = self._clock()
        if now >= self._next_log:
            log.warning(
                "worker bus: dropped %d message(s) since the last such line; the last was %s (topic %r: "
                "%s). Another process of this user is writing to the workers' hub, or a bug",
                self._unlogged,
                reason,
                topic[:24],
                detail[:200],
            )
            self._unlogged, self._next_log = 0, now + _LOG_EVERY_S

    def _apply(self, sender: int, msg: Any) -> None:
        """Checks every field first (types, ranges, sizes): an invalid message changes nothing."""
        if type(msg) is not list or not msg or msg[0] not in ("learn", "forget", "inflight", "metrics?", "metrics!"):
            raise _Invalid("not a [kind, ...] list of a known kind")
        kind, n = msg[0], len(msg)
        if kind == "learn" and n == 2:
            for url, hashes in _learn_batch(msg[1]):
                self._index.learn(url, hashes)
        elif kind == "forget" and n == 3:
            url, until = _text(msg[1], _MAX_URL_CHARS, "forget url"), _number(msg[2], "forget until")
            self._index.forget_learned_until(url, self._clock() - (self._wall() - until))
        elif kind == "inflight" and n in (2, 3):
            counts = _counts(msg[1])
            use = _use(msg[2]) if n == 3 else None
            self._counts[sender] = (self._clock(), counts)
            if use is not None:
                self._uses[sender] = (self._clock(), use)
        elif kind == "metrics?" and n == 2:
            ask = _int(msg[1], 0, (1 << 63) - 1, "metrics ask")
            self._send(["metrics!", sender, ask, self._metrics_text()])  # to all: see latest_metrics
        elif kind == "metrics!" and n == 4:
            asker = _int(msg[1], 0, self.workers - 1, "metrics asker")
            if asker == sender:
                raise _Invalid("metrics: an answer to its own sender")
            ask = _int(msg[2], 0, (1 << 63) - 1, "metrics ask")
            text = msg[3]
            if type(text) is not bytes:
                raise _Invalid("metrics: not bytes")
            self.latest_metrics[sender] = text
            if asker == self.worker and ask in self._metric_asks:
                done, answers = self._metric_asks[ask]
                answers[sender] = text
                if not done.done():
                    done.set_result(None)
        else:
            raise _Invalid(f"{kind} with {n} fields")
