"""Goodput under latency SLOs: pdgate's routing modes and vllm-router, same simulated engines.

One run starts ``--engines`` simulated vLLM engines (``pdgate sim --profile ... --time-scale``,
role ``both`` so every configuration uses the same processes), then, per configuration, a router
in front of them, and replays the same requests (:mod:`bench.workloads`) through each:

| configuration | router | engines |
| --- | --- | --- |
| ``colocated-rr`` | vllm-router ``--policy round_robin`` | all serve whole requests |
| ``colocated-prefix-load`` | pdgate, no prefill pool, bounded_load, prefix_affinity (2) + load (1) | all engines |
| ``colocated-2k`` | the same router | as many engines of their own, ``--max-num-batched-tokens 2048`` |
| ``pd-always`` | pdgate, ``token_threshold`` 1 | prefill and decode pools (half each, or ``--prefill-engines``) |
| ``pd-threshold`` | pdgate, ``token_threshold`` 4096 | the same pools |
| ``pd-cost-model`` | pdgate, ``cost_model`` (the profile's prefill speed and KV link) | the same pools |
| ``vllm-router-pd`` | vllm-router ``--vllm-pd-disaggregation`` (its default policy) | the same pools |

Between runs every engine's prefix cache is reset and the engines are idle. Reported per
configuration, workload and rate, in simulated time (wall time / time scale): TTFT and ITL
p50/p90/p99, output tokens/s, and goodput (offered rate x share of requests that met their SLO:
TTFT and the p90 of their own inter-token gaps; the *tail SLO* also bounds that p99); per
configuration and workload, the highest rate swept at which at least 90% of requests met each.
The bursty companion run of docs/benchmarks/goodput-bursty.*:
``--workloads mix multiturn --arrivals bursty --rate-for mix=1,2,3 multiturn=8,12 --out
docs/benchmarks/goodput-bursty.json``. Output: JSON, a Markdown table and PNG plots (matplotlib,
``pip install -e '.[bench]'``) under ``docs/benchmarks/``.

    python -m bench.goodput --quick                      # < 2 min: a smoke run, outputs x0.25
    python -m bench.goodput                              # the full sweep (25 min here; docs/benchmarks/goodput.*)
    python -m bench.goodput --workloads long chat --rates 0.5 1 2 --configs pd-threshold colocated-rr
    python -m bench.goodput --profile-end high           # the profile's uncertain terms at their costly end

vllm-router is installed on first use into its own venv in the cache folder
(``$PDGATE_CACHE_DIR``, else ``~/.cache/pdgate``), never into this project's environment;
``--vllm-router PATH`` uses an existing binary, ``--no-peer`` skips it.
Every process binds 127.0.0.1 on a free port and is stopped by PID at the end, failures included;
their logs go to a temporary folder, removed after a run that succeeds (``--keep-logs`` keeps it)
and kept, with its path on stderr, after one that fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.goodput_cluster import (
    CONFIGS,
    PEER_CONFIGS,
    SMALL_CHUNK,
    VLLM_ROUTER_VERSION,
    Cluster,
    start_engines,
    start_routers,
    vllm_router_binary,
)
from bench.goodput_load import Progress, run_point
from bench.goodput_metrics import best_rates, summarize
from bench.workloads import ARRIVALS, WORKLOADS, generate
from engine_model.profile import engine_settings
from engine_model.tinymodel import build_tokenizer
from gateway.demo import cache_dir
from tests.procs import ProcGroup

DEFAULT_RATES = {  # simulated requests per second for 2 engines (scaled with --engines)
    "long": [0.5, 1.0, 1.5, 2.0],
    "chat": [2.0, 4.0, 8.0],
    "mix": [1.0, 2.0, 3.0],
    "multiturn": [1.0, 2.0, 4.0],
}


# ---------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run under 2 minutes: mix only, one rate, outputs x0.25")
    p.add_argument("--profile", default="llama-3.3-70b-tp8-h100", help="engine profile (engine_model/profiles)")
    p.add_argument(
        "--profile-end",
        choices=("low", "high"),
        default=None,
        help="the profile's uncertain settings (its ranges) at their low- or high-cost end",
    )
    p.add_argument(
        "--time-scale", type=float, default=None, help="engine time scale (default 0.5: twice the modelled speed)"
    )
    p.add_argument("--engines", type=int, default=2, help="engines per configuration (P/D splits them)")
    p.add_argument(
        "--prefill-engines",
        type=int,
        default=None,
        help="of --engines, how many the P/D configurations use for prefill (default: half)",
    )
    p.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=None)
    p.add_argument("--arrivals", nargs="+", choices=ARRIVALS, default=None)
    p.add_argument("--rates", nargs="+", type=float, default=None, help="simulated req/s (default per workload)")
    p.add_argument(
        "--rate-for",
        nargs="+",
        default=[],
        metavar="WORKLOAD=R[,R...]",
        help="rates for one workload (overrides --rates and the defaults for it)",
    )
    p.add_argument("--duration", type=float, default=None, help="simulated seconds of arrivals per run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vllm-router", default=None, help="an existing vllm-router binary")
    p.add_argument("--no-peer", action="store_true", help="skip the vllm-router configurations")
    p.add_argument("--out", default=None, help="JSON path (default docs/benchmarks/goodput[-quick].json)")
    p.add_argument(
        "--keep-logs",
        action="store_true",
        help="keep the engines' and routers' logs after a run that succeeds (a failed one keeps them)",
    )
    args = p.parse_args(argv)
    if args.engines < 2:
        p.error("--engines must be at least 2")
    if args.prefill_engines is None:
        if args.engines % 2:
            p.error("an odd --engines needs --prefill-engines")
        args.prefill_engines = args.engines // 2
    if not 1 <= args.prefill_engines < args.engines:
        p.error("--prefill-engines must leave at least one engine to each pool")
    try:
        args.rate_for = {
            w: [float(r) for r in rs.split(",")] for w, rs in (item.split("=", 1) for item in args.rate_for)
        }
    except ValueError:
        p.error("--rate-for takes WORKLOAD=RATE[,RATE...]")
    if args.no_peer:
        args.configs = [c for c in args.configs if c not in PEER_CONFIGS]
    if args.quick:
        args.workloads = args.workloads or ["mix"]
        args.arrivals = args.arrivals or ["poisson"]
        args.rates = args.rates or ([1.5] if not args.rate_for else None)
        args.duration = args.duration or 10.0
        args.time_scale = args.time_scale or 0.5
        args.scale_output = 0.25
    else:
        args.workloads = args.workloads or ["long", "chat", "mix", "multiturn"]
        args.arrivals = args.arrivals or ["poisson"]
        args.duration = args.duration or 30.0
        args.time_scale = args.time_scale or 0.5
        args.scale_output = 1.0
    args.out = args.out or ("docs/benchmarks/goodput-quick.json" if args.quick else "docs/benchmarks/goodput.json")
    args.partial = None
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    tokenizer = build_tokenizer(cache_dir() / "demo-tokenizer")
    vr = None
    if any(c in PEER_CONFIGS for c in args.configs):
        vr = vllm_router_binary(args.vllm_router)
    logs = Path(tempfile.mkdtemp(prefix="pdgate-goodput-"))
    group = ProcGroup(logs)
    started = time.time()
    points: list[dict[str, Any]] = []
    done = False
    try:
        end_args = ("--profile-end", args.profile_end) if args.profile_end else ()
        engines = start_engines(group, args.engines, args.profile, args.time_scale, tokenizer, end_args)
        cluster = Cluster(group, engines, args.time_scale, args.prefill_engines)
        if "colocated-2k" in args.configs:
            small = (*end_args, "--max-num-batched-tokens", str(SMALL_CHUNK))
            cluster.small_chunk = start_engines(
                group, args.engines, args.profile, args.time_scale, tokenizer, small, "-2k"
            )
        start_routers(cluster, args.configs, tokenizer, args.profile, logs, vr, args.profile_end)
        plan = []
        for workload in args.workloads:
            rates = args.rate_for.get(workload) or args.rates or [r * args.engines / 2 for r in DEFAULT_RATES[workload]]
            for arrivals in args.arrivals:
                for rate in rates:
                    plan.append((workload, arrivals, rate))
        total = len(plan) * len(args.configs)
        k = 0
        for workload, arrivals, rate in plan:
            reqs = generate(workload, rate, args.duration, arrivals, args.seed, args.scale_output)
            # Alternate the configurations' order between points, so that no configuration
            # always runs first (or last) on this shared machine.
            order = args.configs if len(points) // max(len(args.configs), 1) % 2 == 0 else args.configs[::-1]
            for name in order:
                k += 1
                cluster.reset()
                proc, url = cluster.routers[name]
                if proc.popen.poll() is not None:
                    raise RuntimeError(f"{name} exited:\n{proc.log_tail()}")
                prog = Progress(f"[{k}/{total}] {name} {workload}/{arrivals} {rate:g} req/s", len(reqs))
                prog.draw()
                results = asyncio.run(run_point(url, reqs, args.time_scale, prog))
                prog.draw(final=True)
                summary = summarize(reqs, results, args.duration, rate)
                points.append({"config": name, "workload": workload, "arrivals": arrivals, "rate": rate, **summary})
                if args.partial:  # a long sweep keeps what it measured if it is stopped
                    Path(args.partial).write_text(json.dumps(_result(args, vr, started, points), indent=1) + "\n")
        done = True
    finally:
        try:
            group.stop_all()
        finally:  # the logs of a failed or stopped run are what explains it; a good run's are noise in /tmp
            if done and not args.keep_logs:
                shutil.rmtree(logs, ignore_errors=True)
            else:
                print(f"engine and router logs kept in {logs}", file=sys.stderr)
    return _result(args, vr, started, points)


def _result(args: argparse.Namespace, vr: Path | None, started: float, points: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "profile": args.profile,
        "profile_end": args.profile_end,
        "profile_settings": engine_settings(args.profile, end=args.profile_end),
        "time_scale": args.time_scale,
        "engines": args.engines,
        "prefill_engines": args.prefill_engines,
        "duration_s": args.duration,
        "output_scale": args.scale_output,
        "quick": args.quick,
        "seed": args.seed,
        "vllm_router": VLLM_ROUTER_VERSION if vr else None,
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "wall_s": round(time.time() - started, 1),
        "points": points,
        "best": best_rates(points),
    }


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through run()'s finally: every process is stopped


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started in the background
    args = parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    args.partial = str(out.with_suffix(".partial.json"))
    result = run(args)
    Path(args.partial).unlink(missing_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    from bench.goodput_report import write_report

    md, pngs = write_report(result, out)
    print(md)
    print(f"wrote {out}, {out.with_suffix('.md')}" + "".join(f", {p}" for p in pngs), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
