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
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import yaml

from bench.fairness_report import markdown, plot
from bench.fairness_scoring import (
    MODES,
    PD_THRESHOLD,
    TENANTS,
    Outcome,
    TenantRequest,
    TenantSpec,
    fair_shares,
    prefill_costs,
    schedule,
    summarize_tenant,
    verdict,
)
from bench.goodput_cluster import Cluster, pdgate_config, start_engines
from bench.goodput_load import Progress, send
from bench.workloads import Request
from engine_model.tinymodel import build_tokenizer
from gateway.demo import cache_dir
from tests.procs import ProcGroup, free_port

PREFILL_ENGINES = 1  # of 2 engines: 1 prefill + 1 decode


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
