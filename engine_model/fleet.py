"""A fleet of simulated engines and a router in one process, on a virtual clock.

The same engine as ``pdgate sim`` (:class:`engine_model.engine.Engine`: continuous batching, chunked
prefill, KV blocks, the P/D hand-over with its pull), without HTTP: a router coroutine per job
submits engine requests directly and the KV side channel is a method call. Simulated time jumps
from step to step (:mod:`engine_model.virtual`), so a minute of traffic on a few engines takes about a
second. The planner (:mod:`engine_model.planner`) and the crossover sweep use it.

Routing, as pdgate does it without prefix information: a request goes to the least-loaded engine
of its pool (running + waiting requests, then tokens still to prefill); in P/D layouts, prompts
of at least ``threshold`` tokens (``policy="threshold"``; every prompt with ``"always"``) are
prefilled on the prefill pool and decoded on the decode pool, the rest go straight to a decode
engine. Prefix-cache affinity is not modelled here (the HTTP benchmarks measure it).

Offload tiers (:mod:`engine_model.tiers`): settings with ``cpu_blocks`` give every engine its L1;
``shared_l2=True`` (or an ``l2_url`` in the settings) gives them one L2 of ``l2_blocks`` blocks, an
:class:`~engine_model.tiers.InProcessL2` instead of Redis (virtual time does no I/O), with the same
costs (``l2_latency``, ``l2_bandwidth_gbps``) and the same lookups, loads and stores.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from engine_model import virtual
from engine_model.config import SimConfig
from engine_model.engine import Engine
from engine_model.metrics import SimMetrics
from engine_model.seq import DECODE, PREFILL, Collector, Seq
from engine_model.tiers import InProcessL2
from engine_model.tokens import ByteTokenizer

POLICIES = ("colocated", "always", "threshold")
HOST = "fleet"  # the side channel's "host": a name in this process, never dialled


@dataclass(frozen=True)
class Job:
    """One request: when it arrives (simulated seconds), its prompt, its output and its SLO."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    ttft_slo_s: float
    itl_p90_slo_s: float
    itl_p99_slo_s: float = 0.100
    klass: str = ""
    prefix: tuple[int, int] = (0, 0)  # (group id, tokens): a prefix shared with its group (0: none)


@dataclass(frozen=True)
class Layout:
    """``prefill`` engines (0: colocated) and ``decode`` engines, and the routing policy."""

    prefill: int
    decode: int
    policy: str = "threshold"
    threshold: int = 4096

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}")
        if self.decode < 1 or self.prefill < 0 or (self.policy == "colocated") != (self.prefill == 0):
            raise ValueError("a colocated layout has no prefill engines; a P/D layout has both pools")

    @property
    def engines(self) -> int:
        return self.prefill + self.decode

    def routes_pd(self, prompt_tokens: int) -> bool:
        """Whether a prompt of this length takes the P/D path in this layout."""
        return self.prefill > 0 and (self.policy == "always" or prompt_tokens >= self.threshold)

    @property
    def name(self) -> str:
        if self.policy == "colocated":
            return f"colocated x{self.decode}"
        rule = "always" if self.policy == "always" else f">= {self.threshold} tokens"
        return f"{self.prefill}P+{self.decode}D ({rule})"


@dataclass(frozen=True)
class Outcome:
    """What one job saw: TTFT (None: not served within the horizon), its own ITL percentiles."""

    ttft_s: float | None
    itl_p90_s: float
    itl_p99_s: float
    path: str  # "direct" | "pd"

    def met(self, job: Job, tail: bool = False) -> bool:
        if self.ttft_s is None or self.ttft_s > job.ttft_slo_s or self.itl_p90_s > job.itl_p90_slo_s:
            return False
        return not tail or self.itl_p99_s <= job.itl_p99_slo_s


@dataclass(frozen=True)
class Result:
    layout: Layout
    outcomes: list[Outcome]
    jobs: list[Job]
    duration_s: float

    def attainment(self, tail: bool = False) -> float:
        met = sum(o.met(j, tail) for o, j in zip(self.outcomes, self.jobs, strict=True))
        return met / len(self.jobs) if self.jobs else 1.0

    def goodput(self, tail: bool = False) -> float:
        """Requests per second that met their SLO."""
        return self.attainment(tail) * len(self.jobs) / self.duration_s if self.duration_s else 0.0

    def percentile(self, what: str, q: float) -> float | None:
        xs = sorted(v for o in self.outcomes if (v := getattr(o, what)) is not None)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


class _SideChannel:
    """The KV side channel between in-process engines: a call, not a connection."""

    def __init__(self) -> None:
        self.engines: dict[int, Engine] = {}

    async def call(self, host: str, port: int, msg: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        engine = self.engines.get(port) if host == HOST else None
        if engine is None:
            raise OSError(f"no engine at {host}:{port}")
        handler = {"read": engine.kv_read, "notify": engine.kv_notify, "hb": engine.kv_heartbeat}[msg["op"]]
        return handler(msg)

    async def close(self) -> None:
        return None


def _prompt(job: Job, idx: int) -> list[int]:
    """Token ids: the shared prefix of the job's group, then ids of its own (no accidental hits)."""
    group, shared = job.prefix
    shared = min(shared, job.prompt_tokens)
    own = job.prompt_tokens - shared
    head = [10 + (group * 7919 + i) % 50000 for i in range(shared)] if group else []
    return head + [60000 + (idx * 104729 + i) % 60000 for i in range(own)]


class Fleet:
    """Engines of one layout, started on the running (virtual) loop."""

    def __init__(self, settings: dict[str, Any], layout: Layout, shared_l2: bool = False) -> None:
        """``shared_l2``: one in-process L2 for all engines (they need ``cpu_blocks`` in ``settings``)."""
        self.layout = layout
        self.channel = _SideChannel()
        vocab = ByteTokenizer().output_vocab
        clock = asyncio.get_running_loop().time
        settings = {k: v for k, v in settings.items() if k != "l2_url"}
        self.l2 = InProcessL2(int(settings.get("l2_blocks", SimConfig.l2_blocks))) if shared_l2 else None
        self.engines: list[Engine] = []
        for i in range(layout.engines):
            role = "prefill" if i < layout.prefill else ("decode" if layout.prefill else "both")
            cfg = SimConfig(**{**settings, "role": role, "engine_id": f"engine-{i}", "kv_host": HOST})
            engine = Engine(cfg, SimMetrics(cfg), vocab, kv_client=self.channel, clock=clock, l2=self.l2)  # type: ignore[arg-type]
            engine.kv_port = i + 1
            self.channel.engines[i + 1] = engine
            self.engines.append(engine)
        self.prefill = self.engines[: layout.prefill]
        self.decode = self.engines[layout.prefill :]

    async def start(self) -> None:
        for e in self.engines:
            await e.start()

    async def stop(self) -> None:
        for e in self.engines:
            await e.stop()

    @staticmethod
    def _least_loaded(pool: Sequence[Engine]) -> Engine:
        def load(e: Engine) -> tuple[int, int]:
            queued = len(e.running) + len(e.waiting) + len(e.ready_kv) + len(e.remote_kv)
            backlog = sum(s.prompt_len - s.num_computed for s in e.waiting) + sum(
                s.prompt_len - s.num_computed for s in e.running if s.in_prefill
            )
            return queued, backlog

        return min(pool, key=load)

    async def serve(self, job: Job, idx: int) -> Outcome:
        loop = asyncio.get_running_loop()
        prompt = _prompt(job, idx)
        arrival = loop.time()
        kv_in = None
        path = "direct"
        if self.layout.routes_pd(job.prompt_tokens):
            path = "pd"
            pre = Seq(f"p{idx}", prompt, 1, kind=PREFILL, kv_in={"do_remote_decode": True}, collector=Collector(1))
            pre.arrival = arrival
            self._least_loaded(self.prefill).submit(pre)
            await pre.collector.done  # type: ignore[union-attr]
            if pre.kv_out is None:
                return Outcome(None, math.inf, math.inf, path)
            kv_in = pre.kv_out
        seq = Seq(
            f"d{idx}", prompt, job.output_tokens, kind=DECODE if kv_in else "plain", kv_in=kv_in, collector=Collector(1)
        )
        seq.arrival = arrival
        self._least_loaded(self.decode).submit(seq)
        times: list[float] = []
        event = seq.collector.event  # type: ignore[union-attr]
        while True:
            await event.wait()
            event.clear()
            times.extend([loop.time()] * (len(seq.output_ids) - len(times)))
            if seq.finished:
                break
        if seq.finish_reason not in ("length", "stop") or not times:
            return Outcome(None, math.inf, math.inf, path)
        gaps = sorted(b - a for a, b in itertools.pairwise(times)) or [0.0]
        return Outcome(times[0] - arrival, gaps[int(0.9 * (len(gaps) - 1))], gaps[int(0.99 * (len(gaps) - 1))], path)


async def _run(
    settings: dict[str, Any],
    layout: Layout,
    jobs: Sequence[Job],
    horizon_s: float,
    progress: Callable[[int], None] | None,
    shared_l2: bool = False,
) -> list[Outcome]:
    loop = asyncio.get_running_loop()
    fleet = Fleet(settings, layout, shared_l2)
    await fleet.start()
    done = 0

    async def one(job: Job, idx: int) -> Outcome:
        nonlocal done
        await asyncio.sleep(max(0.0, job.arrival_s - loop.time()))
        try:
            return await asyncio.wait_for(fleet.serve(job, idx), max(horizon_s - loop.time(), 0.001))
        except TimeoutError:
            return Outcome(None, math.inf, math.inf, "pd" if layout.routes_pd(job.prompt_tokens) else "direct")
        finally:
            done += 1
            if progress is not None:
                progress(done)

    try:
        return list(await asyncio.gather(*(one(j, i) for i, j in enumerate(jobs))))
    finally:
        await fleet.stop()


def simulate(
    settings: dict[str, Any],
    layout: Layout,
    jobs: Sequence[Job],
    *,
    duration_s: float | None = None,
    horizon_s: float | None = None,
    progress: Callable[[int], None] | None = None,
    shared_l2: bool = False,
) -> Result:
    """Serve ``jobs`` on ``layout`` engines with profile ``settings`` (``SimConfig`` keyword
    arguments, e.g. :func:`engine_model.profile.engine_settings`); jobs still unserved at ``horizon_s``
    (default: the last arrival + 120 s) count as failed. ``shared_l2`` (or ``l2_url`` in the
    settings): the engines share one in-process L2 (see the module's docstring)."""
    jobs = sorted(jobs, key=lambda j: j.arrival_s)
    last = jobs[-1].arrival_s if jobs else 0.0
    duration = duration_s if duration_s is not None else max(last, 1e-9)
    shared_l2 = shared_l2 or bool(settings.get("l2_url"))
    settings = {k: v for k, v in settings.items() if k not in ("role", "engine_id", "kv_host", "time_scale")}
    outcomes = virtual.run(_run(settings, layout, jobs, horizon_s or last + 120.0, progress, shared_l2))
    return Result(layout, outcomes, list(jobs), duration)


__all__ = ["POLICIES", "Job", "Layout", "Outcome", "Result", "simulate"]
