"""``server.workers``: one gateway as several processes on one listening socket.

One Python event loop saturates one core (tokenizing, routing, relaying chunks). The supervisor
binds the socket once and starts ``workers`` processes (``spawn``: nothing of the supervisor's
state is forked), each a whole gateway serving the same socket; the kernel hands each new
connection to one of them. What keeps them one gateway:

- routing state over the workers' hub (gateway/cluster/workerbus.py), or Redis when configured;
- one admission limit: slots held per worker in shared memory (gateway/fairness/admission.py SharedGate);
- one ``/metrics``: the serving worker merges the others' (gateway/ops/metricsmerge.py).

Each worker watches the config file, the engines and the KV event feeds itself (a few more
health probes and event decodes, and no single point whose death stops routing for all).

The supervisor restarts a worker that dies (after a short backoff) and frees what it held. A
restarted worker starts from the config the workers run now, never the one the gateway started
with: each worker reports every config version it applies (the validated object, its named files
pinned: gateway/config/reload.py) over its own pipe, and the supervisor hands the latest to the next
worker it starts, which serves nothing before it has it. On SIGTERM or SIGINT the supervisor
passes SIGTERM on, waits for the workers' graceful shutdown (``server.shutdown_grace_s`` plus the
bound on background parts) and kills what is left. A worker whose supervisor disappears shuts
itself down. A worker that cannot start (exit 3: a tokenizer,
a port) stops the gateway: the cause is the same in every worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from gateway.background import STOP_BOUND_S
from gateway.cluster.workerbus import BusAddress, Hub
from gateway.config import GatewayConfig, PinnedFiles
from gateway.config.reload import version_of

log = logging.getLogger(__name__)

STARTUP_FAILED = 3  # a worker's exit code when its server did not start
_RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0)
_STABLE_S = 60.0  # a worker that lived this long starts its backoff over
# A worker's resident memory to plan for: Meta's Llama 3 tokenizer peaks at ~590 MB while it loads
# (every worker loads at once at start), ~270 MB after (bench/worker_memory.py).
WORKER_BYTES = 600 << 20
_SUPERVISOR_BYTES = 128 << 20
_ORPHAN_CHECK_S = 1.0


def usable_cores(cgroup: str = "/sys/fs/cgroup") -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup CPU quota (a container's
    CPU limit; without one a container sees every core of its node), rounded up."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    quota = _cgroup_quota(cgroup)
    if quota is not None:
        cores = min(cores, math.ceil(quota))
    return max(1, cores)


def _cgroup_quota(root: str) -> float | None:
    """CPUs' worth of quota (cgroup v2 cpu.max, or v1 cfs quota/period); None without a quota."""
    try:
        quota, period = Path(root, "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int(Path(root, "cpu", "cpu.cfs_quota_us").read_text())
        period_us = int(Path(root, "cpu", "cpu.cfs_period_us").read_text())
        return quota_us / period_us if quota_us > 0 and period_us > 0 else None
    except (OSError, ValueError):
        return None


def worker_count(cfg: GatewayConfig, cgroup: str = "/sys/fs/cgroup") -> int:
    """``server.workers``, or one per usable core, as many as a cgroup memory limit holds."""
    if cfg.server.workers:
        return cfg.server.workers
    limit = _cgroup_memory(cgroup)
    fits = max(1, (limit - _SUPERVISOR_BYTES) // WORKER_BYTES) if limit is not None else None
    return min(usable_cores(cgroup), fits) if fits is not None else usable_cores(cgroup)


def _cgroup_memory(root: str) -> int | None:
    """A cgroup's memory limit in bytes (v2 memory.max, or v1), None without one."""
    for path in (Path(root, "memory.max"), Path(root, "memory", "memory.limit_in_bytes")):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text == "max":
            return None
        try:
            value = int(text)
        except ValueError:
            return None
        return value if value < 1 << 60 else None  # v1 says "no limit" with a huge number
    return None


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker process needs to become one worker of this gateway (pickled at spawn)."""

    config_path: str
    config: GatewayConfig  # the config the workers run now (named files pinned), validated: not re-read
    version: str  # its version (gateway/config/reload.py); the worker's watcher applies later edits
    host: str
    port: int
    index: int
    count: int
    bus: BusAddress
    supervisor_pid: int
    access_log_path: str | None = None  # append access lines here instead of stdout (the demo)
    listen: tuple[str, int] | None = None  # host and port given on the command line (create_app's ``listen``)


@dataclass(frozen=True)
class WorkerContext:
    """A worker's view of its siblings, passed to ``create_app``."""

    index: int
    count: int
    bus: BusAddress
    slots: Any  # multiprocessing RawArray of admission slots, one cell per worker
    lock: Any  # multiprocessing Lock guarding ``slots``
    applied: Callable[[GatewayConfig, str], None] | None = None  # tells the supervisor a config was applied


def bind(host: str, port: int) -> socket.socket:
    """The listening socket every worker serves (IPv6 when ``host`` is an IPv6 address)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class Supervisor:
    def __init__(self, spec: WorkerSpec, cfg: GatewayConfig) -> None:
        self._spec, self._cfg = spec, cfg
        self._mp = multiprocessing.get_context("spawn")
        self._slots = self._mp.RawArray(ctypes.c_int64, spec.count)
        self._lock = self._mp.Lock()
        self._procs: list[BaseProcess | None] = [None] * spec.count
        self._restarts = [0] * spec.count
        self._started = [0.0] * spec.count
        self._failures = self._mp.SimpleQueue()  # why a worker could not start (one line)
        # Each worker's pipe for the config versions it applies (its own: a worker killed mid-send
        # spoils nothing but its own message), and the latest applied: (when, config, version).
        self._reports: list[Connection | None] = [None] * spec.count
        self.latest: tuple[float, GatewayConfig, str] = (0.0, spec.config, spec.version)
        self._stopping = False
        self.exit_code = 0
        self.failure: str | None = None

    def run(self, sock: socket.socket, hub: Hub) -> int:
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            for i in range(self._spec.count):
                self._start(i, sock)
            log.info("pdgate: %d workers serving http://%s:%d", self._spec.count, self._spec.host, self._spec.port)
            self._watch(sock)
        finally:
            self._stop_all(sock)
            hub.stop()
            for s, h in previous.items():
                signal.signal(s, h)
        return self.exit_code

    def _on_signal(self, signum: int, frame: object) -> None:
        self._stopping = True

    def _start(self, i: int, sock: socket.socket) -> None:
        self._collect_reports()  # what any worker applied until now, the dead one's last included
        _, cfg, version = self.latest
        spec = replace(self._spec, index=i, config=cfg, version=version)
        reader, writer = self._mp.Pipe(duplex=False)
        proc = self._mp.Process(
            target=run_worker,
            args=(spec, sock, self._slots, self._lock, self._failures, writer),
            name=f"pdgate-worker-{i}",
            daemon=False,
        )
        proc.start()
        writer.close()  # the worker's copy only: its death ends the pipe
        if (old := self._reports[i]) is not None:
            old.close()
        self._reports[i] = reader
        self._procs[i] = proc
        self._started[i] = time.monotonic()
        if version != self._spec.version:
            log.info("worker %d starts with config version %s, the latest the workers applied", i, version)

    def _collect_reports(self) -> None:
        """Read every config version the workers reported; keep the one applied last."""
        for i, reader in enumerate(self._reports):
            if reader is None:
                continue
            try:
                while reader.poll(0):
                    report = reader.recv()
                    if not (
                        isinstance(report, tuple)
                        and len(report) == 3
                        and isinstance(report[0], float)
                        and isinstance(report[1], GatewayConfig)
                        and isinstance(report[2], str)
                    ):
                        log.warning("worker %d sent a config report of the wrong shape: ignored", i)
                        continue
                    if report[0] > self.latest[0]:
                        self.latest = report
            except Exception as err:  # EOFError: the worker ended (mid-message, maybe); what it sent whole counts
                if not isinstance(err, EOFError):
                    log.warning("worker %d: unreadable config report (%s): its pipe is closed", i, type(err).__name__)
                reader.close()
                self._reports[i] = None

    def _watch(self, sock: socket.socket) -> None:
        due: dict[int, float] = {}  # worker -> when to start it again
        while not self._stopping:
            live: list[Any] = [p.sentinel for p in self._procs if p is not None]
            multiprocessing.connection.wait(live + [r for r in self._reports if r is not None], timeout=0.2)
            self._collect_reports()  # before a dead worker is seen: its last report counts
            for i, proc in enumerate(self._procs):
                if proc is None or proc.is_alive():
                    continue
                proc.join()
                self._procs[i] = None
                why = None if proc.exitcode != STARTUP_FAILED or self._failures.empty() else self._failures.get()
                # At first launch every worker would fail alike: stop. A restarted worker that
                # cannot start (a file gone since) is backed off and tried again.
                if proc.exitcode == STARTUP_FAILED and not self._restarts[i]:
                    self.failure = why
                    if self.failure is None:
                        log.error("worker %d could not start: stopping the gateway", i)
                    self.exit_code = STARTUP_FAILED
                    return
                if self._stopping:
                    break
                self._free(i)
                if time.monotonic() - self._started[i] > _STABLE_S:  # it had been serving: a fresh failure
                    self._restarts[i] = 0
                wait = _RESTART_BACKOFF_S[min(self._restarts[i], len(_RESTART_BACKOFF_S) - 1)]
                self._restarts[i] += 1
                log.error(
                    "worker %d (pid %s) exited with %s%s: starting it again in %.1f s",
                    i,
                    proc.pid,
                    proc.exitcode,
                    f" ({why})" if why else "",
                    wait,
                )
                due[i] = time.monotonic() + wait
            now = time.monotonic()
            for i, when in list(due.items()):
                if now >= when and not self._stopping:
                    del due[i]
                    self._start(i, sock)

    def _free(self, i: int) -> None:
        """What a dead worker held: its admission slots, and the lock if it died holding it."""
        if self._lock.acquire(True, 0.5):
            self._slots[i] = 0
            self._lock.release()
        else:
            log.warning("worker %d died holding the admission lock: releasing it", i)
            self._slots[i] = 0
            with contextlib.suppress(ValueError):
                self._lock.release()

    def _stop_all(self, sock: socket.socket) -> None:
        procs = [p for p in self._procs if p is not None and p.is_alive()]
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid or 0, signal.SIGTERM)
        # The workers close their copies as they start draining; with this one open the kernel
        # would still queue new connections nobody accepts. Closed, new clients are refused at once.
        sock.close()
        for reader in self._reports:
            if reader is not None:
                reader.close()
        deadline = time.monotonic() + self._cfg.server.shutdown_grace_s + STOP_BOUND_S + 2.0
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                log.warning("worker %s did not stop in time: killing it", p.name)
                p.kill()
                p.join(2.0)


def serve(
    cfg: GatewayConfig,
    config_path: str,
    config_text: str,
    host: str,
    port: int,
    workers: int,
    *,
    sock: socket.socket | None = None,
    access_log_path: str | None = None,
    listen: tuple[str, int] | None = None,
) -> int:
    """Bind (unless given ``sock``), start ``workers`` workers, supervise them until SIGTERM or
    SIGINT; the exit code."""
    if sock is None:
        try:
            sock = bind(host, port)
        except OSError as err:
            log.error("cannot listen on %s:%d (%s)", host, port, err.strerror)
            return STARTUP_FAILED
    sock.set_inheritable(True)
    if cfg.pinned is None:  # its named files (keys, token, templates) as read now, for every worker
        cfg = cfg.pin(PinnedFiles.read(cfg.named_files()))
    version = version_of(config_text.encode(), cfg.pinned)
    hub = Hub()
    hub.start()
    spec = WorkerSpec(
        config_path, cfg, version, host, port, 0, workers, hub.address, os.getpid(), access_log_path, listen
    )
    supervisor = Supervisor(spec, cfg)
    try:
        code = supervisor.run(sock, hub)
    finally:
        sock.close()
    if supervisor.failure is not None:  # e.g. a tokenizer that cannot load: one line, as without workers
        print(f"{config_path}: {supervisor.failure}", file=sys.stderr)
        return 2
    return code


class _Reporter:
    """Tells the supervisor each config version this worker applied, from a thread: a send that
    blocks (a large keys file, a busy supervisor) never stalls the event loop, and the thread
    (a daemon) never holds up the worker's exit."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._queue: queue.SimpleQueue[tuple[float, GatewayConfig, str]] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="pdgate-config-report", daemon=True).start()

    def __call__(self, cfg: GatewayConfig, version: str) -> None:
        self._queue.put((time.monotonic(), cfg, version))  # when applied: the latest wins, whoever reports first

    def _run(self) -> None:
        while True:
            report = self._queue.get()
            try:
                self._conn.send(report)
            except (OSError, ValueError):  # the supervisor is gone: the orphan watch stops this worker
                return


def run_worker(
    spec: WorkerSpec, sock: socket.socket, slots: Any, lock: Any, failures: Any, reports: Connection | None = None
) -> None:
    """A worker process: the whole gateway on the shared socket (exits 3 when it cannot start,
    having put the cause, one line, in ``failures`` for the supervisor to say), serving
    ``spec.config`` from its first request and reporting each config it applies on ``reports``."""
    from gateway.cli import load_tokenizers
    from gateway.http.app import create_app
    from gateway.http.uvicorn_server import make_server
    from gateway.ops.gcpolicy import Collector
    from gateway.ops.requestlog import LineWriter

    cfg = spec.config
    logging.basicConfig(
        level=cfg.server.log_level.upper(),
        format=f"%(asctime)s %(levelname)s [worker {spec.index}] %(name)s: %(message)s",
    )
    logging.getLogger("watchfiles").setLevel(logging.WARNING)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides; it sends SIGTERM
    ctx = WorkerContext(
        spec.index, spec.count, spec.bus, slots, lock, applied=_Reporter(reports) if reports is not None else None
    )
    access = open(spec.access_log_path, "ab") if spec.access_log_path else None  # noqa: SIM115 - closed below
    sink = LineWriter(access) if access else None
    try:
        try:
            tokenizers = load_tokenizers(cfg)
            server = make_server(
                cfg,
                lambda connections: create_app(
                    cfg,
                    tokenizers,
                    config_path=spec.config_path,
                    config_version=spec.version,
                    connections=connections,
                    access_sink=sink,
                    collector=Collector(cfg.server.gc_young_threshold),
                    worker=ctx,
                    listen=spec.listen,
                ),
                host=spec.host,
                port=spec.port,
                log_level=cfg.server.log_level.lower(),
                max_connections=math.ceil(cfg.server.max_connections / spec.count) if cfg.server.max_connections else 0,
            )
        except ValueError as err:  # a tokenizer, a secret file not mounted: the supervisor says it, once
            failures.put(str(err))
            raise SystemExit(STARTUP_FAILED) from None
        # uvicorn re-raises the SIGTERM it handled once it has drained: a no-op here lets the
        # cleanup below run (the access log's last lines) and the process exit 0.
        signal.signal(signal.SIGTERM, lambda signum, frame: None)

        async def orphan_watch() -> None:
            """The supervisor is gone (killed): nobody would stop this worker, so it stops itself."""
            while True:
                await asyncio.sleep(_ORPHAN_CHECK_S)
                if os.getppid() != spec.supervisor_pid:
                    break
            log.warning("the supervisor (pid %d) is gone: shutting down", spec.supervisor_pid)
            server.should_exit = True

        with asyncio.Runner(loop_factory=server.config.get_loop_factory()) as runner:  # uvloop, as uvicorn runs it
            runner.run(_serve_worker(server, sock, orphan_watch))
    finally:
        if sink is not None:
            sink.close()
        if access is not None:
            access.close()
    if not server.started:
        raise SystemExit(STARTUP_FAILED)


async def _serve_worker(server: Any, sock: socket.socket, orphan_watch: Any) -> None:
    watch = asyncio.create_task(orphan_watch(), name="orphan-watch")
    try:
        await server.serve(sockets=[sock])
    finally:
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch
