"""Tenant fairness under a flood: per-tenant SLO attainment and goodput, fairness off and on, one run.

Three tenants (equal weights, one API key each, all in the ``standard`` class so only the tenant
ordering differs) share 2 simulated engines (``pdgate sim --profile llama-3.3-70b-tp8-h100``, the
calibrated 70B profile): 1 prefill + 1 decode. Routing is ``token_threshold`` 4096, so the path is
fixed by the prompt alone (the cost model's choice would also move with the load, and mix a
routing change into a fairness comparison):

| tenant | prompt tokens | output tokens | rate (req/s) | TTFT SLO | path |
| --- | --- | --- | --- | --- | --- |
| ``chat`` | 100-500 | 100-200 | 2 | 1 s | direct (decode engine) |
| ``rag`` | 4,608-8,000 | 100-300 | 0.5 | 4 s | P/D |
| ``flood`` | 8,192-16,384 | 16-64 | 2.5 | 30 s | P/D |

The flood asks ~30k prompt tokens/s of a prefill pool that serves ~20k: 3x its equal half of that
pool, 1.5x the whole pool. The same seeded schedule (Poisson arrivals per tenant) goes through two
gateways on the same engines, one after the other (engines idle, prefix caches emptied between):
``fairness.enabled: false`` (FIFO; a saturated prefill pool sends P/D requests direct) and
``true`` (by priority, then the tenant's weighted use of the pool; P/D requests wait for prefill).
Same caps for both: ``max_per_prefill_endpoint`` 2, ``max_per_decode_endpoint`` 32,
``queue_timeout_s`` 60 (wall), so the gateway, not the engines, holds the queue.

Reported per tenant and mode, in simulated time (wall / time scale): SLO attainment (share of
*all* its requests, 429s and errors included, whose TTFT met its SLO; also with p90 ITL <= 50 ms
as in bench.goodput), goodput (SLO-meeting requests/s and their output tokens/s over the arrival
window), prefill tokens/s served (requests whose first token came within the window), output
tokens/s, TTFT p50/p90/p99, 429s, errors, paths taken, mean gateway queue wait (the gateway's
``pdgate_tenant_queue_seconds``); and each tenant's weighted max-min fair share of the prefill
tokens served in the window, given what each asked for, against what it got.

    python -m bench.fairness --quick      # < 1 min smoke run: 20 s of arrivals, outputs x0.5, output in $TMPDIR
    python -m bench.fairness              # the full run (docs/benchmarks/fairness.*), 120 s of arrivals, ~3 min here
    python -m bench.fairness --report docs/benchmarks/fairness.json   # redo the table and plot from the JSON

The flood's share counts prefill legs whose first token came within the window: those still in
flight at its end are left out, ~1 s of engine time, so "ok" allows 5% (``SHARE_TOLERANCE``); in
the 20 s of ``--quick`` that edge alone is ~5%, so read its share figure as a smoke check only.

Output: JSON, a Markdown table and a PNG (matplotlib, ``pip install -e '.[bench]'``). Every
process binds 127.0.0.1 on a free port and is stopped by PID at the end, failures included.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import yaml

from bench.goodput import Cluster, Progress, pct, pdgate_config, send, start_engines
from bench.workloads import Request, _arrival_times, _ids
from engine_model.config import SimConfig
from engine_model.profile import engine_settings
from engine_model.tinymodel import build_tokenizer
from gateway.demo import cache_dir
from tests.procs import ProcGroup, free_port

MODES = ("off", "on")
ITL_P90_SLO_S = 0.050  # bench.goodput's ITL objective, for the stricter attainment column
TARGET_ATTAINMENT = 0.95  # the well-behaved tenants, fairness on
SHARE_TOLERANCE = 0.95  # the flood must get at least this fraction of its fair share of what the pool delivered
POOL_BUSY_TARGET = 0.9  # ... and the pool must deliver this fraction of its modelled capacity (no idle room)
PD_THRESHOLD = 4096
PREFILL_ENGINES = 1  # of 2 engines: 1 prefill + 1 decode


@dataclass(frozen=True)
class TenantSpec:
    name: str
    rate: float  # simulated requests/s
    prompt: tuple[int, int]
    output: tuple[int, int]
    ttft_slo_s: float  # simulated
    weight: float = 1.0
    flood: bool = False


TENANTS = (
    TenantSpec("chat", 2.0, (100, 500), (100, 200), 1.0),
    TenantSpec("rag", 0.5, (4608, 8000), (100, 300), 4.0),
    TenantSpec("flood", 2.5, (8192, 16384), (16, 64), 30.0, flood=True),
)


@dataclass
class TenantRequest:
    tenant: str
    arrival_s: float  # simulated, since the run's start
    prompt: list[int]
    max_tokens: int


@dataclass
class Outcome:
    status: int = 0
    ok: bool = False
    ttft_s: float = 0.0  # simulated
    itls_s: list[float] = field(default_factory=list)
    tokens: int = 0
    path: str | None = None
    error: str | None = None


# ---------------------------------------------------------------------------- schedule
def schedule(
    specs: tuple[TenantSpec, ...], duration_s: float, seed: int = 0, scale_output: float = 1.0
) -> list[TenantRequest]:
    """Every tenant's requests, merged by arrival. One PRNG per tenant, so a tenant's requests do
    not change when another tenant's rate does; the same arguments give the same requests."""
    out: list[TenantRequest] = []
    for spec in specs:
        rng = random.Random(f"fairness/{spec.name}/{spec.rate}/{seed}")
        for t in _arrival_times(rng, spec.rate, duration_s, "poisson"):
            n = rng.randint(*spec.prompt)
            m = max(2, round(rng.randint(*spec.output) * scale_output))
            out.append(TenantRequest(spec.name, t, _ids(rng, n), m))
    out.sort(key=lambda r: (r.arrival_s, r.tenant))
    return out


# ---------------------------------------------------------------------------- arithmetic
def max_min_shares(demands: dict[str, float], weights: dict[str, float], capacity: float) -> dict[str, float]:
    """Weighted max-min fair allocation (water-filling): no tenant gets more than it asks; what a
    tenant leaves unused is split among the rest by weight."""
    share = {t: 0.0 for t in demands}
    active = {t for t, d in demands.items() if d > 0}
    left = capacity
    while active and left > 1e-12:
        total_w = sum(weights[t] for t in active)
        fill = {t: left * weights[t] / total_w for t in active}
        sated = {t for t in active if demands[t] - share[t] <= fill[t]}
        if not sated:
            for t in active:
                share[t] += fill[t]
            break
        for t in sated:
            left -= demands[t] - share[t]
            share[t] = demands[t]
        active -= sated
    return share


def attainment(met: int, total: int) -> float:
    """Share of all requests (failed ones count as missed) that met the SLO."""
    return round(met / total, 3) if total else 0.0


def prefill_costs(profile: str, reqs: list[TenantRequest]) -> list[float]:
    """Each request's prefill time alone on one engine of the profile (simulated s): what it asks
    of the prefill pool. Engine time, not tokens, since a long prompt's later chunks cost more."""
    cfg = SimConfig(**{**engine_settings(profile), "time_scale": 1.0})
    return [cfg.prefill_time(len(q.prompt)) for q in reqs]


def summarize_tenant(
    spec: TenantSpec, reqs: list[TenantRequest], outs: list[Outcome], costs: list[float], duration_s: float
) -> dict[str, Any]:
    """One tenant's figures for one mode (simulated seconds). ``costs``: each request's
    :func:`prefill_costs`; the prefill pool's are the P/D requests' (prompt >= the threshold)."""
    ok = [(q, o) for q, o in zip(reqs, outs, strict=True) if o.ok]
    pool_in_window = [
        c for q, o, c in zip(reqs, outs, costs, strict=True)
        if o.ok and o.path == "pd" and q.arrival_s + o.ttft_s <= duration_s
    ]  # fmt: skip
    met_ttft = [(q, o) for q, o in ok if o.ttft_s <= spec.ttft_slo_s]
    met_slo = [(q, o) for q, o in met_ttft if (pct(o.itls_s, 0.9) or 0.0) <= ITL_P90_SLO_S]
    in_window = [q for q, o in ok if q.arrival_s + o.ttft_s <= duration_s]
    ttfts = [o.ttft_s for _, o in ok]
    paths: dict[str, int] = {}
    for _, o in ok:
        paths[o.path or "?"] = paths.get(o.path or "?", 0) + 1

    def ms(v: float | None) -> float | None:
        return None if v is None else round(v * 1000, 1)

    return {
        "requests": len(reqs),
        "completed": len(ok),
        "rejected_429": sum(o.status == 429 for o in outs),
        "errors": sum(not o.ok and o.status != 429 for o in outs),
        "error_samples": sorted({o.error for o in outs if o.error and o.status != 429})[:3],
        "ttft_slo_s": spec.ttft_slo_s,
        "attainment": attainment(len(met_ttft), len(reqs)),
        "attainment_with_itl": attainment(len(met_slo), len(reqs)),
        "goodput_req_s": round(len(met_ttft) / duration_s, 3),
        "goodput_tok_s": round(sum(o.tokens for _, o in met_ttft) / duration_s, 1),
        "offered_prefill_tok_s": round(sum(len(q.prompt) for q in reqs) / duration_s, 1),
        "prefill_tok_s": round(sum(len(q.prompt) for q in in_window) / duration_s, 1),
        "output_tok_s": round(sum(o.tokens for _, o in ok) / duration_s, 1),
        "offered_pool_s": round(
            sum(c for q, c in zip(reqs, costs, strict=True) if len(q.prompt) >= PD_THRESHOLD) / duration_s, 4
        ),
        "pool_s": round(sum(pool_in_window) / duration_s, 4),
        "ttft_ms": {f"p{q}": ms(pct(ttfts, q / 100)) for q in (50, 90, 99)},
        "paths": paths,
        "ttfts_ms": sorted(round(t * 1000, 1) for t in ttfts),  # for the CDF plot
    }


def fair_shares(
    tenants: dict[str, dict[str, Any]], weights: dict[str, float], pool_engines: int
) -> dict[str, dict[str, float]]:
    """Per tenant, its weighted max-min fair share next to what it was served, two ways:
    ``pool_*``: the prefill pool's engine time (capacity: its engines, busy every second),
    given what its P/D requests ask of it; ``tok_*``: all prefill tokens served in the window, on
    any engine and path (capacity: that run's total, so a tenant's shortfall there only shows
    what others took, not capacity left idle)."""
    tok_capacity = sum(t["prefill_tok_s"] for t in tenants.values())
    # What the pool delivered in the window (its engines ran behind their modelled step times on
    # these loaded cores, and legs running at the window's end are not counted): the flood's share
    # of that is what fairness decides; whether the pool sat idle is ``pool_delivered`` below.
    delivered = sum(t["pool_s"] for t in tenants.values())
    fair_of_delivered = max_min_shares({n: t["offered_pool_s"] for n, t in tenants.items()}, weights, delivered)
    tok_fair = max_min_shares({n: t["offered_prefill_tok_s"] for n, t in tenants.items()}, weights, tok_capacity)
    pool_fair = max_min_shares({n: t["offered_pool_s"] for n, t in tenants.items()}, weights, float(pool_engines))
    out = {}
    for n, t in tenants.items():
        out[n] = {
            "pool_served": t["pool_s"],
            "pool_fair": round(pool_fair[n], 4),
            "pool_served_over_fair": round(t["pool_s"] / pool_fair[n], 3) if pool_fair[n] else None,
            "pool_fair_of_delivered": round(fair_of_delivered[n], 4),
            "pool_served_over_fair_of_delivered": round(t["pool_s"] / fair_of_delivered[n], 3)
            if fair_of_delivered[n]
            else None,
            "pool_delivered": round(delivered / pool_engines, 3),
            "tok_served": t["prefill_tok_s"],
            "tok_fair": round(tok_fair[n], 1),
            "tok_served_fraction": round(t["prefill_tok_s"] / tok_capacity, 3) if tok_capacity else 0.0,
            "tok_fair_fraction": round(tok_fair[n] / tok_capacity, 3) if tok_capacity else 0.0,
        }
    return out


def verdict(mode: dict[str, Any], specs: tuple[TenantSpec, ...]) -> dict[str, Any]:
    """The issue's target: every well-behaved tenant >= 95% attainment, the flood >= its share."""
    good = {s.name: mode["tenants"][s.name]["attainment"] for s in specs if not s.flood}
    flood = {s.name: mode["shares"][s.name] for s in specs if s.flood}
    return {
        "well_behaved_attainment_ok": all(a >= TARGET_ATTAINMENT for a in good.values()),
        "flood_share_ok": all(
            (sh["pool_served_over_fair_of_delivered"] or 0) >= SHARE_TOLERANCE
            and sh["pool_delivered"] >= POOL_BUSY_TARGET
            for sh in flood.values()
        ),
    }


# ---------------------------------------------------------------------------- load
async def _send(
    session: aiohttp.ClientSession,
    url: str,
    req: TenantRequest,
    spec: TenantSpec,
    t0: float,
    scale: float,
    progress: Progress,
) -> Outcome:
    """bench.goodput's request, with the tenant's key and TTFT objective."""
    headers = {
        "Authorization": f"Bearer sk-{req.tenant}",
        "x-pdgate-ttft-ms": str(max(1, round(spec.ttft_slo_s * scale * 1000))),  # the gateway's clock is wall
    }
    r = await send(
        session, url, Request(0, req.arrival_s, req.prompt, req.max_tokens, req.tenant), t0, scale, progress, headers
    )
    return Outcome(r.status, r.ok, r.ttft_s, r.itls_s, r.tokens, r.path, r.error)


async def replay(
    url: str, reqs: list[TenantRequest], specs: dict[str, TenantSpec], scale: float, progress: Progress
) -> list[Outcome]:
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=900)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        t0 = time.perf_counter() + 0.2
        return await asyncio.gather(*(_send(session, url, r, specs[r.tenant], t0, scale, progress) for r in reqs))


# ---------------------------------------------------------------------------- gateways
def gateway_config(
    cluster: Cluster, tokenizer: Path, profile: str, port: int, keys: Path, args: argparse.Namespace, fair: bool
) -> dict[str, Any]:
    """bench.goodput's pd-threshold gateway plus per-engine caps, API keys and fairness."""
    cfg = pdgate_config("pd-threshold", cluster, tokenizer, profile, port)
    cfg["routing"]["decider"] = {"name": "token_threshold", "threshold": PD_THRESHOLD}
    cfg["admission"] = {
        "max_per_prefill_endpoint": args.max_prefill,
        "max_per_decode_endpoint": args.max_decode,
        "queue_timeout_s": args.queue_timeout,
        "max_loop_lag_ms": 0,  # this shared 2-core VM: do not let loop lag 429 anyone
    }
    cfg["auth"] = {"api_keys_file": str(keys)}
    cfg["fairness"] = {
        "enabled": fair,
        "tenants": {s.name: {"weight": s.weight} for s in TENANTS},
        "wait_for_prefill": True,
    }
    return cfg


def keys_file(path: Path) -> Path:
    path.write_text("".join(f"sk-{s.name} tenant={s.name} weight={s.weight:g} priority=standard\n" for s in TENANTS))
    return path


def scrape_queue(url: str, scale: float) -> dict[str, dict[str, float]]:
    """Per tenant: admitted requests' gateway queue wait (sum, count, mean; simulated s), outcomes."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, dict[str, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            tenant = s.labels.get("tenant")
            if tenant is None:
                continue
            d = out.setdefault(tenant, {})
            if s.name == "pdgate_tenant_queue_seconds_sum":
                d["queue_sum_s"] = d.get("queue_sum_s", 0.0) + s.value / scale
            elif s.name == "pdgate_tenant_queue_seconds_count":
                d["queue_count"] = d.get("queue_count", 0.0) + s.value
            elif s.name == "pdgate_tenant_requests_total":
                key = "requests_" + s.labels.get("outcome", "?")
                d[key] = d.get(key, 0.0) + s.value
            elif s.name == "pdgate_tenant_prefill_tokens_total":
                d["prefill_tokens_sent"] = d.get("prefill_tokens_sent", 0.0) + s.value
    for d in out.values():
        if d.get("queue_count"):
            d["queue_mean_s"] = round(d["queue_sum_s"] / d["queue_count"], 3)
    return out


# ---------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run under 2 minutes: 20 s of arrivals, outputs x0.5")
    p.add_argument("--profile", default="llama-3.3-70b-tp8-h100", help="engine profile (engine_model/profiles)")
    p.add_argument("--time-scale", type=float, default=0.5, help="engine time scale (0.5: twice the modelled speed)")
    p.add_argument("--duration", type=float, default=None, help="simulated seconds of arrivals per mode")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-prefill", type=int, default=2, help="admission.max_per_prefill_endpoint")
    p.add_argument("--max-decode", type=int, default=32, help="admission.max_per_decode_endpoint")
    p.add_argument("--queue-timeout", type=float, default=60.0, help="admission.queue_timeout_s (wall)")
    p.add_argument("--report", metavar="JSON", default=None, help="only rewrite the Markdown and PNG of a run")
    p.add_argument("--out", default=None, help="JSON path (default docs/benchmarks/fairness.json; --quick: in $TMPDIR)")
    args = p.parse_args(argv)
    args.duration = args.duration or (20.0 if args.quick else 120.0)
    args.scale_output = 0.5 if args.quick else 1.0
    quick_out = Path(tempfile.gettempdir()) / "pdgate-fairness-quick.json"  # a smoke run does not touch docs/
    args.out = args.out or str(quick_out if args.quick else Path("docs/benchmarks/fairness.json"))
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    tokenizer = build_tokenizer(cache_dir() / "demo-tokenizer")
    logs = Path(tempfile.mkdtemp(prefix="pdgate-fairness-"))
    group = ProcGroup(logs)
    started = time.time()
    specs = {s.name: s for s in TENANTS}
    weights = {s.name: s.weight for s in TENANTS}
    reqs = schedule(TENANTS, args.duration, args.seed, args.scale_output)
    costs = prefill_costs(args.profile, reqs)
    code = code_version()  # what the gateways about to start will load
    modes: dict[str, Any] = {}
    configs: dict[str, Any] = {}
    try:
        engines = start_engines(group, PREFILL_ENGINES + 1, args.profile, args.time_scale, tokenizer)
        cluster = Cluster(group, engines, args.time_scale, PREFILL_ENGINES)
        keys = keys_file(logs / "keys.txt")
        gateways = {}
        for mode in MODES:
            port = free_port()
            cfg = configs[mode] = gateway_config(cluster, tokenizer, args.profile, port, keys, args, mode == "on")
            path = logs / f"gateway-{mode}.yaml"
            path.write_text(yaml.safe_dump(cfg))
            proc = group.start(f"gateway-{mode}", [sys.executable, "-m", "gateway", "serve", "--config", str(path)])
            gateways[mode] = (proc, f"http://127.0.0.1:{port}")
        for proc, base in gateways.values():
            proc.wait_http(base + "/ready", timeout=120)
        for k, mode in enumerate(MODES, 1):
            cluster.reset(timeout=300)
            proc, base = gateways[mode]
            if proc.popen.poll() is not None:
                raise RuntimeError(f"gateway-{mode} exited:\n{proc.log_tail()}")
            prog = Progress(f"[{k}/{len(MODES)}] fairness {mode}", len(reqs))
            prog.draw()
            t0 = time.time()
            outs = asyncio.run(replay(base + "/v1/completions", reqs, specs, args.time_scale, prog))
            prog.draw(final=True)
            tenants = {}
            for s in TENANTS:
                mine = [i for i, q in enumerate(reqs) if q.tenant == s.name]
                tenants[s.name] = summarize_tenant(
                    s, [reqs[i] for i in mine], [outs[i] for i in mine], [costs[i] for i in mine], args.duration
                )
            gw = scrape_queue(base, args.time_scale)
            for name, t in tenants.items():
                t["gateway"] = gw.get(name, {})
            modes[mode] = {"wall_s": round(time.time() - t0, 1), "tenants": tenants,
                           "shares": fair_shares(tenants, weights, PREFILL_ENGINES)}  # fmt: skip
            modes[mode]["target"] = verdict(modes[mode], TENANTS)
            if proc.popen.poll() is not None:
                raise RuntimeError(f"gateway-{mode} exited:\n{proc.log_tail()}")
            tb = [ln for ln in proc.log_path.read_text(errors="replace").splitlines() if "Traceback" in ln]
            modes[mode]["gateway_tracebacks"] = len(tb)
    finally:
        group.stop_all()
    return {
        "profile": args.profile,
        "time_scale": args.time_scale,
        "engines": {"prefill": 1, "decode": 1},
        "duration_s": args.duration,
        "output_scale": args.scale_output,
        "quick": args.quick,
        "seed": args.seed,
        "admission": configs.get("on", {}).get("admission"),
        "routing": {"decider": "token_threshold", "threshold": PD_THRESHOLD},
        "tenant_specs": [s.__dict__ for s in TENANTS],
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "code": code,
        "logs": str(logs),
        "wall_s": round(time.time() - started, 1),
        "modes": modes,
    }


def code_version() -> dict[str, Any]:
    """The commit measured, and whether the gateway's code had uncommitted changes then."""

    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    dirty = git("status", "--porcelain", "--", "gateway", "policies")
    return {"commit": git("rev-parse", "HEAD") or None, "gateway_dirty": bool(dirty)}


# ---------------------------------------------------------------------------- report
def markdown(result: dict[str, Any]) -> str:
    """The per-tenant table (off vs on) and the target's verdict per mode."""
    lines = [
        "# Tenant fairness under a flood: fairness off (FIFO) vs on",
        "",
        "Generated by `python -m bench.fairness" + (" --quick" if result["quick"] else "") + "` (see its docstring). "
        f"Profile `{result['profile']}`, 1 prefill + 1 decode simulated engine, time scale "
        f"{result['time_scale']:g}, {result['duration_s']:g} s of arrivals, seed {result['seed']}"
        + (f", outputs x{result['output_scale']:g}" if result["output_scale"] != 1 else "")
        + f". Admission: `{json.dumps(result['admission'])}`; routing token_threshold {PD_THRESHOLD}; equal "
        "weights, all tenants in the `standard` class. Times simulated (wall / time scale). Attainment: share of "
        "all the tenant's requests whose TTFT met its SLO (429s and errors count as missed); *+ITL*: also p90 "
        "ITL <= 50 ms. Goodput: TTFT-SLO-meeting requests/s and their output tokens/s over the arrival window. "
        "*Prefill pool*: engine-seconds per second of the prefill engine its P/D requests asked for (offered) and "
        "got with a first token within the window (served), against its weighted max-min fair share of the pool "
        "(capacity 1 engine). *Prefill tok/s*: prompt tokens served on any path within the window. Queue: mean "
        "gateway wait of admitted requests (`pdgate_tenant_queue_seconds`).",
        "",
        "| tenant | fairness | requests | 429 | errors | TTFT SLO | attainment | +ITL | goodput req/s "
        "| goodput tok/s | TTFT p50/p90/p99 ms | prefill pool offered / served / fair | prefill tok/s offered "
        "/ served | output tok/s | queue mean s | paths |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for spec in result["tenant_specs"]:
        name = spec["name"]
        for mode in MODES:
            m = result["modes"].get(mode)
            if not m:
                continue
            t, sh = m["tenants"][name], m["shares"][name]
            ttft = "/".join("-" if v is None else f"{v:g}" for v in t["ttft_ms"].values())
            q = t["gateway"].get("queue_mean_s")
            lines.append(
                f"| {name} | {mode} | {t['requests']} | {t['rejected_429']} | {t['errors']} | {t['ttft_slo_s']:g} s "
                f"| **{t['attainment']:.1%}** | {t['attainment_with_itl']:.1%} | {t['goodput_req_s']:g} "
                f"| {t['goodput_tok_s']:g} | {ttft} | {t['offered_pool_s']:.3f} / {sh['pool_served']:.3f} / "
                f"{sh['pool_fair']:.3f} | {t['offered_prefill_tok_s']:,.0f} / {t['prefill_tok_s']:,.0f} "
                f"| {t['output_tok_s']:g} | {'-' if q is None else f'{q:g}'} "
                f"| {', '.join(f'{k} {v}' for k, v in sorted(t['paths'].items()))} |"
            )
    floods = [s["name"] for s in result["tenant_specs"] if s["flood"]]
    lines += [
        "",
        "| fairness | well-behaved tenants >= 95% | flood's prefill pool served / fair share of what it delivered "
        "| pool delivered / modelled capacity | flood served / fair share of the modelled capacity | flood's share "
        "of all prefill tokens served (max-min fair) | wall s |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode in MODES:
        m = result["modes"].get(mode)
        if not m:
            continue
        sh = m["shares"]
        ratio = ", ".join(f"{sh[f]['pool_served_over_fair_of_delivered']}" for f in floods)
        busy = ", ".join(f"{sh[f]['pool_delivered']}" for f in floods)
        modelled = ", ".join(f"{sh[f]['pool_served_over_fair']}" for f in floods)
        frac = ", ".join(f"{sh[f]['tok_served_fraction']:.1%} ({sh[f]['tok_fair_fraction']:.1%})" for f in floods)
        ok = "yes" if m["target"]["well_behaved_attainment_ok"] else "**no**"
        short = (
            f"(ok: >= {SHARE_TOLERANCE:g}, pool >= {POOL_BUSY_TARGET:g})"
            if m["target"]["flood_share_ok"]
            else "(**short**)"
        )
        lines.append(f"| {mode} | {ok} | {ratio} {short} | {busy} | {modelled} | {frac} | {m['wall_s']:g} |")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], png: Path) -> Path | None:
    """TTFT CDFs, attainment bars and the prefill pool's shares, off vs on."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot (pip install -e '.[bench]')", file=sys.stderr)
        return None
    specs = result["tenant_specs"]
    modes = [m for m in MODES if m in result["modes"]]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.8))
    colors = {s["name"]: f"C{i}" for i, s in enumerate(specs)}
    for s in specs:
        for mode in modes:
            t = result["modes"][mode]["tenants"][s["name"]]
            xs = [v / 1000 for v in t["ttfts_ms"]]
            if xs:
                ys = [(i + 1) / t["requests"] for i in range(len(xs))]
                ax1.step(xs, ys, where="post", color=colors[s["name"]], ls="-" if mode == "on" else ":",
                         label=f"{s['name']} ({mode})")  # fmt: skip
        ax1.axvline(s["ttft_slo_s"], color=colors[s["name"]], lw=0.7, alpha=0.5)
    ax1.set_xscale("log")
    ax1.set_xlabel("TTFT (simulated s); vertical lines: SLOs")
    ax1.set_ylabel("share of the tenant's requests")
    ax1.set_title("TTFT CDF (dotted: fairness off)")
    ax1.legend(fontsize=7, loc="center", bbox_to_anchor=(0.32, 0.5))
    width = 0.38
    for j, mode in enumerate(modes):
        vals = [result["modes"][mode]["tenants"][s["name"]]["attainment"] for s in specs]
        xs = [i + (j - 0.5) * width for i in range(len(specs))]
        bars = ax2.bar(xs, vals, width, label=f"fairness {mode}", color="C7" if mode == "off" else "C2")
        ax2.bar_label(bars, labels=[f"{v:.0%}" for v in vals], fontsize=7)
    ax2.axhline(TARGET_ATTAINMENT, color="k", ls="--", lw=0.8)
    ax2.set_xticks(range(len(specs)), [s["name"] for s in specs])
    ax2.set_ylim(0, 1.22)
    ax2.set_title("TTFT SLO attainment (dashed: 95% target)")
    ax2.legend(fontsize=7, loc="upper center", ncol=2)
    for j, mode in enumerate(modes):
        sh = result["modes"][mode]["shares"]
        xs = [i + (j - 0.5) * width for i in range(len(specs))]
        ax3.bar(xs, [sh[s["name"]]["pool_served"] for s in specs], width, label=f"served, fairness {mode}",
                color="C7" if mode == "off" else "C2")  # fmt: skip
    sh = result["modes"][modes[-1]]["shares"]
    ax3.scatter(range(len(specs)), [sh[s["name"]]["pool_fair"] for s in specs], marker="_", s=600, color="k",
                zorder=3, label="max-min fair share")  # fmt: skip
    offered = [result["modes"][modes[0]]["tenants"][s["name"]]["offered_pool_s"] for s in specs]
    ax3.scatter(range(len(specs)), offered, marker="x", color="C3", zorder=3, label="offered")
    ax3.set_xticks(range(len(specs)), [s["name"] for s in specs])
    ax3.set_ylabel("prefill engine-seconds per second (pool: 1)")
    ax3.set_title("prefill pool served in the window vs fair share")
    ax3.legend(fontsize=7)
    fig.suptitle(f"{result['profile']}, 1 prefill + 1 decode engine, {result['duration_s']:g} s of arrivals "
                 "(simulated)")  # fmt: skip
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through run()'s finally: every process is stopped


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    args = parse_args(argv)
    if args.report:
        out = Path(args.report)
        result = json.loads(out.read_text())
        weights = {s["name"]: s.get("weight", 1.0) for s in result["tenant_specs"]}
        for m in result["modes"].values():  # with this version's arithmetic
            m["shares"] = fair_shares(m["tenants"], weights, result.get("engines", {}).get("prefill", PREFILL_ENGINES))
            m["target"] = verdict(m, TENANTS)
    else:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        result = run(args)
        out.write_text(json.dumps(result, indent=1) + "\n")
    md = markdown(result)
    out.with_suffix(".md").write_text(md)
    png = plot(result, out.with_suffix(".png"))
    print(md)
    print(f"wrote {out}, {out.with_suffix('.md')}" + (f", {png}" if png else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
