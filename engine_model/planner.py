"""How many prefill and decode engines for this traffic and SLO: ``pdgate plan``.

Two stages. A fast analytical model (:func:`estimate`) scores every candidate layout (colocated
with vLLM's default chunk or 2048-token chunks; P/D with p prefill + d decode engines and a
routing rule) from the engine profile's cost model: queueing for prefill (M/G/1 waits), the decode
batch from Little's law, the share of decode steps that carry a prefill chunk (which sets the
streams' ITL percentiles), the KV hand-over. Then the most promising candidates run in the fleet
simulator (:mod:`engine_model.fleet`: the same engine as ``pdgate sim``, on a virtual clock), and the
cheapest layout whose simulated SLO attainment reaches the target is recommended.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from statistics import fmean
from typing import Any

from engine_model.config import SimConfig, attention_pairs
from engine_model.fleet import Job, Layout, Result, simulate

DEFAULT_THRESHOLDS = (2048, 4096, 8192)
SMALL_CHUNK = 2048


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    chunk: int | None = None  # max_num_batched_tokens override (None: the profile's)

    @property
    def engines(self) -> int:
        return self.layout.engines

    @property
    def name(self) -> str:
        """The layout as an operator configures it: the gateway's decider and its threshold, not
        only a token figure (of which tokens, decided by what?)."""
        lay = self.layout
        if lay.policy == "colocated":
            return lay.name + (f", {self.chunk}-token chunks" if self.chunk else "")
        if lay.policy == "always":
            return f"{lay.prefill}P+{lay.decode}D (token_threshold 1: every request through P/D)"
        return f"{lay.prefill}P+{lay.decode}D (token_threshold {lay.threshold}: P/D from {lay.threshold} prompt tokens)"

    @property
    def decider(self) -> dict[str, Any] | None:
        """The gateway's ``routing.decider`` for this layout (None: colocated, no prefill pool)."""
        lay = self.layout
        if lay.policy == "colocated":
            return None
        return {"name": "token_threshold", "threshold": 1 if lay.policy == "always" else lay.threshold}

    def settings(self, base: dict[str, Any]) -> dict[str, Any]:
        return {**base, "max_num_batched_tokens": self.chunk} if self.chunk else dict(base)


@dataclass(frozen=True)
class Estimate:
    candidate: Candidate
    attainment: float  # predicted share of requests within their SLO
    notes: str = ""


@dataclass
class Plan:
    rate: float  # the rate planned for (asked for)
    target: float
    tail: bool
    estimates: list[Estimate]
    checked: list[tuple[Estimate, Result]] = field(default_factory=list)
    sampled_rate: float | None = None  # the arrivals' own rate: a random sample differs from the one asked for

    @property
    def recommended(self) -> tuple[Estimate, Result] | None:
        ok = [(e, r) for e, r in self.checked if r.attainment(self.tail) >= self.target]
        if not ok:
            return None
        return min(ok, key=lambda er: (er[0].candidate.engines, -er[1].attainment(self.tail)))


def candidates(max_engines: int, thresholds: Sequence[int] = DEFAULT_THRESHOLDS) -> list[Candidate]:
    out = []
    for n in range(1, max_engines + 1):
        out.append(Candidate(Layout(0, n, "colocated")))
        out.append(Candidate(Layout(0, n, "colocated"), chunk=SMALL_CHUNK))
        for p in range(1, n):
            out.append(Candidate(Layout(p, n - p, "always")))
            out.extend(Candidate(Layout(p, n - p, "threshold", t)) for t in thresholds)
    return out


# ------------------------------------------------------------------------------ analytical model
def _binomial_le(n: int, p: float, k: float) -> float:
    """P(Binomial(n, p) <= k), normal approximation (exact at the edges)."""
    if p <= 0:
        return 1.0
    if p >= 1:
        return 0.0 if k < n else 1.0
    sd = math.sqrt(n * p * (1 - p))
    return 0.5 * (1 + math.erf((k + 0.5 - n * p) / (sd * math.sqrt(2))))


@dataclass
class _Pool:
    """One pool's engines under their share of the load: what its requests see."""

    step: float = 0.0  # a decode step with the pool's batch
    steps_per_s: float = 0.0  # decode steps per second (with and without a prefill chunk)
    chunks: list[tuple[float, float]] = field(default_factory=list)  # (stall, chunks/s with it)
    wait_mean: float = 0.0  # prefill queueing
    rho: float = 0.0  # prefill utilization
    overloaded: bool = False

    hits: dict[float, float] = field(default_factory=dict)

    def hit(self, threshold: float) -> float:
        """Share of a stream's gaps longer than ``threshold``: steps carrying a big enough chunk."""
        if threshold not in self.hits:
            if self.step > threshold:
                share = 1.0
            else:
                bad = sum(rate for stall, rate in self.chunks if self.step + stall > threshold)
                share = min(1.0, bad / self.steps_per_s) if self.steps_per_s else 0.0
            self.hits[threshold] = share
        return self.hits[threshold]


def _chunk_costs(cfg: SimConfig, prompt: int) -> list[float]:
    """Each chunk's own step time (without the step's fixed cost), as the engine charges it."""
    base = cfg.step_base_time
    return [cfg.step_time(n, 0, 0, attention_pairs(n, done)) - base for n, done in cfg.prefill_chunks(prompt)]


class _Prep:
    """What the model needs of each job that does not depend on the layout, computed once."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self._chunks: dict[int, list[float]] = {}
        self._handover: dict[int, float] = {}

    def chunks(self, prompt: int) -> list[float]:
        if prompt not in self._chunks:
            self._chunks[prompt] = _chunk_costs(self.cfg, prompt)
        return self._chunks[prompt]

    def prefill(self, prompt: int) -> float:
        return sum(self.chunks(prompt)) + self.cfg.step_base_time * len(self.chunks(prompt))

    def handover(self, prompt: int) -> float:
        if prompt not in self._handover:
            cfg = self.cfg
            self._handover[prompt] = cfg.kv_transfer_time(prompt) + cfg.step_time(
                1, 0, 0, attention_pairs(1, prompt - 1)
            )
        return self._handover[prompt]


def _pool(prep: _Prep, prefills: list[Job], decodes: list[Job], n: float, duration: float, decode: bool) -> _Pool:
    """``prefills`` are prefilled here, ``decodes`` decode here (``decode``: the pool decodes)."""
    cfg = prep.cfg
    base = cfg.step_base_time
    lam_p = len(prefills) / duration / n
    lam_d = len(decodes) / duration / n
    costs = [prep.chunks(j.prompt_tokens) for j in prefills]
    shared = decode and bool(decodes)  # the step's fixed cost is paid by the decodes anyway
    pw = [sum(cs) + (0.0 if shared else base * len(cs)) for cs in costs] or [0.0]
    rho = lam_p * fmean(pw)
    out = _Pool(rho=rho)
    if rho >= 0.98:
        out.overloaded = True
        return out
    out.wait_mean = lam_p * fmean(t * t for t in pw) / (2 * (1 - rho)) if lam_p else 0.0
    if not shared:
        return out
    per_job = lam_p / len(costs) if costs else 0.0
    out.chunks = [(stall, per_job) for cs in costs for stall in cs]
    chunk_rate = sum(r for _, r in out.chunks)
    ctx = fmean(j.prompt_tokens + j.output_tokens / 2 for j in decodes)
    out_tokens = fmean(j.output_tokens for j in decodes)
    batch = 1.0
    for _ in range(200):
        step = cfg.step_time(0, max(1, round(batch)), round(max(1, batch) * ctx))
        # Time splits into chunk steps (step + stall) and plain decode steps.
        plain = (1 - chunk_rate * step - rho) / step
        if plain <= 0:
            out.overloaded = True
            return out
        out.step, out.steps_per_s = step, plain + chunk_rate
        new = lam_d * out_tokens / out.steps_per_s
        if new > cfg.max_num_seqs or new * ctx > (cfg.num_gpu_blocks - 1) * cfg.block_size * 0.95:
            out.overloaded = True
            return out
        if abs(new - batch) < 1e-3:
            break
        batch = 0.5 * batch + 0.5 * new
    return out


def _ttft_ok(margin: float, pool: _Pool) -> float:
    """P(prefill wait <= margin): an M/G/1 wait, exponential past its atom at zero."""
    if margin <= 0:
        return 0.0
    if pool.wait_mean <= 0 or pool.rho <= 0:
        return 1.0
    return 1.0 - pool.rho * math.exp(-margin * pool.rho / pool.wait_mean)


def _itl_ok(job: Job, pool: _Pool, tail: bool) -> float:
    """P(the stream's p90 (and p99) gap within its SLO): few enough of its gaps on a slow step."""
    if job.output_tokens <= 1:
        return 1.0  # no gap to judge (as the fleet counts it)
    ok = 1.0
    gaps = job.output_tokens - 1
    for q, slo in ((0.9, job.itl_p90_slo_s), *(((0.99, job.itl_p99_slo_s),) if tail else ())):
        ok *= _binomial_le(gaps, pool.hit(slo), (1 - q) * (gaps - 1))
    return ok


def _score(
    prep: _Prep,
    jobs: Sequence[Job],
    duration: float,
    n_pre: float,
    n_dec: float,
    pd_rule: Callable[[Job], bool],
    tail: bool,
) -> float | None:
    """Predicted attainment for ``n_pre`` prefill and ``n_dec`` decode engines (real numbers: a
    pool's demand in fractions of an engine); None when overloaded."""
    pd = [j for j in jobs if n_pre > 0 and pd_rule(j)]
    pd_ids = {id(j) for j in pd}
    direct = [j for j in jobs if id(j) not in pd_ids]
    cfg = prep.cfg
    dec = _pool(prep, direct, list(jobs), n_dec, duration, decode=True)
    pre = _pool(prep, pd, [], n_pre, duration, decode=False) if n_pre > 0 else _Pool()
    if dec.overloaded or pre.overloaded:
        return None
    scores = []
    for j in jobs:
        if id(j) in pd_ids:
            ttft = prep.prefill(j.prompt_tokens) + prep.handover(j.prompt_tokens) + dec.step
            p_ttft = _ttft_ok(j.ttft_slo_s - ttft, pre)
        else:
            n = len(prep.chunks(j.prompt_tokens))
            ttft = prep.prefill(j.prompt_tokens) + n * max(dec.step - cfg.step_base_time, 0.0)
            p_ttft = _ttft_ok(j.ttft_slo_s - ttft, dec)
        scores.append(p_ttft * _itl_ok(j, dec, tail))
    return fmean(scores)


def _config(settings: dict[str, Any]) -> SimConfig:
    return SimConfig(**{k: v for k, v in settings.items() if k != "time_scale"})


def estimate(settings: dict[str, Any], cand: Candidate, jobs: Sequence[Job], duration: float, tail: bool) -> Estimate:
    """The analytical model's SLO attainment for ``cand`` serving ``jobs`` (see the module doc)."""
    if not jobs:
        return Estimate(cand, 1.0)
    lay = cand.layout
    prep = _Prep(_config(cand.settings(settings)))
    scored = _score(prep, jobs, duration, lay.prefill, lay.decode, lambda j: lay.routes_pd(j.prompt_tokens), tail)
    return Estimate(cand, 0.0, "overloaded") if scored is None else Estimate(cand, scored)


@dataclass(frozen=True)
class Demand:
    """What each pool needs: engines as real numbers (fractions add up across gateway replicas)."""

    prefill: float
    decode: float
    unservable: int  # requests no number of engines serves within their SLO (counted, left out)


class Stopped(Exception):
    """The caller's ``stop`` predicate asked the computation to end."""


def pool_demand(
    settings: dict[str, Any],
    jobs: Sequence[Job],
    duration: float,
    *,
    pd_threshold: int | None,
    target: float = 0.9,
    tail: bool = False,
    limit: float = 1024.0,
    stop: Callable[[], bool] | None = None,
) -> Demand | None:
    """Engines each pool needs for ``jobs`` to meet their SLOs (share ``target``): prefill, decode
    (prefill 0 without P/D, ``pd_threshold`` None). Requests that cannot meet their TTFT on an idle
    engine (a prompt whose prefill alone takes longer) are counted and left out: more engines would
    not help them. None: not even ``limit`` engines would do. ``stop`` is polled between steps
    (raises :class:`Stopped`), so a caller can bound the time."""
    prep = _Prep(_config(settings))
    rule = (lambda j: j.prompt_tokens >= pd_threshold) if pd_threshold is not None else (lambda j: False)

    def idle_ttft(j: Job) -> float:
        own = prep.prefill(j.prompt_tokens) + prep.cfg.step_base_time
        return own + prep.handover(j.prompt_tokens) if rule(j) else own

    servable = [j for j in jobs if idle_ttft(j) <= j.ttft_slo_s]
    unservable = len(jobs) - len(servable)
    if not servable:
        return Demand(0.0, 0.0, unservable)
    uses_pd = pd_threshold is not None and any(rule(j) for j in servable)
    duration = duration * len(servable) / len(jobs)  # the servable requests at their own rate

    def least(ok: Callable[[float], bool]) -> float | None:
        lo, hi = 1e-3, limit
        if not ok(hi):
            return None
        for _ in range(40):  # bisection on a log scale: ~0.1% of the answer
            mid = math.sqrt(lo * hi)
            lo, hi = (lo, mid) if ok(mid) else (mid, hi)
        return hi

    def meets(n_pre: float, n_dec: float) -> bool:
        if stop is not None and stop():
            raise Stopped
        scored = _score(prep, servable, duration, n_pre, n_dec, rule, tail)
        return scored is not None and scored >= target

    # Decode first, with prefill plentiful; then the fewest prefill engines that still meet it.
    dec = least(lambda n: meets(limit if uses_pd else 0.0, n))
    if dec is None:
        return None
    if not uses_pd:
        return Demand(0.0, dec, unservable)
    pre = least(lambda n: meets(n, dec * 1.02))
    return Demand(pre, dec * 1.02, unservable) if pre is not None else None


# ------------------------------------------------------------------------------ the search
def plan(
    settings: dict[str, Any],
    jobs: Sequence[Job],
    duration: float,
    *,
    target: float = 0.9,
    tail: bool = False,
    max_engines: int = 8,
    thresholds: Sequence[int] = DEFAULT_THRESHOLDS,
    check: int = 6,
    progress: Callable[[str, int, int], None] | None = None,
    rate: float | None = None,
) -> Plan:
    """Score every candidate, then simulate the ``check`` most promising: the cheapest ones the
    model expects to reach ``target`` (and the best of one engine fewer, in case it is pessimistic).
    ``rate``: the rate ``jobs`` were drawn at, which the plan reports (default: their own rate)."""
    sampled = len(jobs) / duration if duration else 0.0
    ests = [estimate(settings, c, jobs, duration, tail) for c in candidates(max_engines, thresholds)]
    ests.sort(key=lambda e: (e.candidate.engines, -e.attainment))
    out = Plan(sampled if rate is None else rate, target, tail, ests, sampled_rate=sampled)
    feasible = [e for e in ests if e.attainment >= target - 0.05]
    n_min = min((e.candidate.engines for e in feasible), default=max_engines)
    # Layouts that route this traffic the same way (thresholds that split it alike) are one choice.
    distinct: dict[tuple[int, int, int | None, int], Estimate] = {}
    for e in ests:
        lay = e.candidate.layout
        routed = sum(lay.routes_pd(j.prompt_tokens) for j in jobs)
        distinct.setdefault((lay.prefill, lay.decode, e.candidate.chunk, routed), e)
    picks: list[Estimate] = []
    quota = max(1, math.ceil(check / 3))
    for n in (n_min, n_min + 1, n_min - 1):  # the likely answer first, should --check be small
        picks += [e for e in distinct.values() if e.candidate.engines == n][:quota]
    picks = picks[:check]
    for e in picks:
        res = simulate(e.candidate.settings(settings), e.candidate.layout, jobs, duration_s=duration,
                       progress=_reporter(progress, e.candidate.name, len(jobs)))  # fmt: skip
        out.checked.append((e, res))
    return out


def _reporter(progress: Callable[[str, int, int], None] | None, what: str, total: int) -> Callable[[int], None] | None:
    if progress is None:
        return None
    return lambda done: progress(what, done, total)


def brute_force(
    settings: dict[str, Any],
    jobs: Sequence[Job],
    duration: float,
    cands: Sequence[Candidate],
    *,
    target: float = 0.9,
    tail: bool = False,
) -> list[tuple[Candidate, Result]]:
    """Every candidate simulated (the planner's reference), cheapest-and-best first."""
    runs = [(c, simulate(c.settings(settings), c.layout, jobs, duration_s=duration)) for c in cands]
    runs.sort(key=lambda cr: (cr[1].attainment(tail) < target, cr[0].engines, -cr[1].attainment(tail)))
    return runs


# ------------------------------------------------------------------------------ reports
def to_json(p: Plan, engine_hour_cost: float | None = None) -> dict[str, Any]:
    def cost(n: int) -> float | None:
        return round(n * engine_hour_cost, 2) if engine_hour_cost else None

    def goodput(r: Result) -> float:  # of the rate asked for, as the benchmarks count it
        return round(p.rate * r.attainment(p.tail), 3)

    rec = p.recommended
    sampled = p.sampled_rate
    return {
        "rate": round(p.rate, 3),
        "sampled_rate": None if sampled is None else round(sampled, 3),
        "target_attainment": p.target,
        "slo": "tail" if p.tail else "standard",
        "recommended": None
        if rec is None
        else {
            "layout": rec[0].candidate.name,
            "prefill_engines": rec[0].candidate.layout.prefill,
            "decode_engines": rec[0].candidate.layout.decode,
            "engines": rec[0].candidate.engines,
            "decider": rec[0].candidate.decider,
            "max_num_batched_tokens": rec[0].candidate.chunk,
            "cost_per_hour": cost(rec[0].candidate.engines),
            "simulated_attainment": round(rec[1].attainment(p.tail), 4),
            "simulated_goodput_req_s": goodput(rec[1]),
            "predicted_attainment": round(rec[0].attainment, 4),
        },
        "checked": [
            {
                "layout": e.candidate.name,
                "engines": e.candidate.engines,
                "predicted_attainment": round(e.attainment, 4),
                "simulated_attainment": round(r.attainment(p.tail), 4),
                "simulated_goodput_req_s": goodput(r),
                "ttft_p90_s": _finite(r.percentile("ttft_s", 0.9)),
                "itl_p90_p90_s": _finite(r.percentile("itl_p90_s", 0.9)),
                "cost_per_hour": cost(e.candidate.engines),
            }
            for e, r in p.checked
        ],
        "estimates": [
            {"layout": e.candidate.name, "engines": e.candidate.engines, "predicted_attainment": round(e.attainment, 4)}
            for e in p.estimates
        ],
    }


def _finite(x: float | None) -> float | None:
    """JSON has no infinity: a percentile over failed requests (no gap measured) is None."""
    return x if x is not None and math.isfinite(x) else None


def engines(n: int) -> str:
    return f"{n} engine" + ("" if n == 1 else "s")


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:g} ms" if seconds < 1 else f"{seconds:g} s"


def slo_lines(slos: Sequence[dict[str, Any]], tail: bool) -> list[str]:
    """Each class's SLO in words (``slos``: as ``pdgate plan`` reports them)."""
    out = []
    for k in slos:
        p99 = f", p99 gap <= {_ms(k['itl_p99_s'])}" if tail else ""
        out.append(
            f"- {k['class']}: TTFT <= {_ms(k['ttft_s'])}, p90 of its own inter-token gaps <= {_ms(k['itl_p90_s'])}{p99}"
        )
    return out


def markdown(doc: dict[str, Any], context: dict[str, Any] | None = None) -> str:
    """One plan as Markdown; ``context``: the report around it (``pdgate plan``'s JSON: profile,
    workload, simulated seconds, the classes' SLOs), said above the table."""
    rec = doc["recommended"]
    tail = doc["slo"] == "tail"
    about: list[str] = []
    if context is not None:
        sampled = doc.get("sampled_rate")
        drawn = f" (the sampled arrivals: {sampled:g} req/s)" if sampled not in (None, doc["rate"]) else ""
        about = [
            f"Workload `{context['workload']}`{drawn} on engine profile `{context['profile']}`, "
            f"{context['duration_s']:g} simulated seconds per layout (seed {context['seed']}).",
            "",
            f"SLO ({doc['slo']}), per request class:",
            *slo_lines(context.get("slos", []), tail),
            "",
        ]
    lines = [
        f"# Plan: {doc['rate']:g} req/s, {doc['slo']} SLO met by >= {doc['target_attainment']:.0%} of requests",
        "",
        *about,
        "**Recommended:** "
        + (
            f"{rec['layout']}: {engines(rec['engines'])}"
            + (f" (${rec['cost_per_hour']:,.2f}/h)" if rec["cost_per_hour"] else "")
            + f", simulated attainment {rec['simulated_attainment']:.1%} (model: {rec['predicted_attainment']:.1%})"
            if rec
            else "none of the layouts checked meets the SLO: more engines (--max-engines), or a looser SLO"
        ),
        "",
        "| layout | engines | model attainment | simulated attainment | goodput req/s | TTFT p90 s "
        "| streams' p90 gap, p90 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in doc["checked"]:
        ttft = "-" if c["ttft_p90_s"] is None else f"{c['ttft_p90_s']:.2f}"
        itl = "-" if c["itl_p90_p90_s"] in (None, math.inf) else f"{c['itl_p90_p90_s'] * 1000:.0f}"
        lines.append(
            f"| {c['layout']} | {c['engines']} | {c['predicted_attainment']:.1%} | {c['simulated_attainment']:.1%} "
            f"| {c['simulated_goodput_req_s']:g} | {ttft} | {itl} |"
        )
    lines += [
        "",
        "TTFT p90: over the requests. Streams' p90 gap: each stream's 90th-percentile inter-token "
        "gap (what the ITL SLO bounds), its 90th percentile over the streams.",
    ]
    return "\n".join(lines) + "\n"
