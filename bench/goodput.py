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
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson
import yaml

from bench.workloads import ARRIVALS, WORKLOADS, Request, generate
from engine_model.profile import engine_settings
from engine_model.tinymodel import build_tokenizer
from gateway.demo import cache_dir
from tests.procs import Proc, ProcGroup, free_port

MODEL = "bench"
VLLM_ROUTER_VERSION = "0.1.17"
CONFIGS = (
    "colocated-rr",
    "colocated-prefix-load",
    "colocated-2k",
    "pd-always",
    "pd-threshold",
    "pd-cost-model",
    "vllm-router-pd",
)
PD_CONFIGS = {"pd-always", "pd-threshold", "pd-cost-model", "vllm-router-pd"}
PEER_CONFIGS = {"colocated-rr", "vllm-router-pd"}
SMALL_CHUNK = 2048  # colocated-2k's engines: smaller prefill chunks, less stall for running streams
DEFAULT_RATES = {  # simulated requests per second for 2 engines (scaled with --engines)
    "long": [0.5, 1.0, 1.5, 2.0],
    "chat": [2.0, 4.0, 8.0],
    "mix": [1.0, 2.0, 3.0],
    "multiturn": [1.0, 2.0, 4.0],
}
ATTAINMENT = 0.9  # "goodput at the SLO": the highest rate where this share of requests met it


# ---------------------------------------------------------------------------- vllm-router
def vllm_router_binary(explicit: str | None = None) -> Path:
    """vllm-router from PyPI in a venv of its own in the cache folder (built once)."""
    if explicit:
        return Path(explicit)
    venv = cache_dir() / f"vllm-router-{VLLM_ROUTER_VERSION}-venv"
    exe = venv / "bin" / "vllm-router"
    if not exe.exists():
        print(f"installing vllm-router {VLLM_ROUTER_VERSION} into {venv} ...", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run(
            [str(venv / "bin" / "pip"), "install", "-q", f"vllm-router=={VLLM_ROUTER_VERSION}"],
            check=True,
        )
    return exe


# ---------------------------------------------------------------------------- cluster
@dataclass
class Cluster:
    group: ProcGroup
    engines: list[str]
    time_scale: float
    n_prefill: int  # how many of the engines the P/D configurations use as the prefill pool
    small_chunk: list[str] = field(default_factory=list)  # colocated-2k's own engines
    routers: dict[str, tuple[Proc, str]] = field(default_factory=dict)

    @property
    def prefill(self) -> list[str]:
        return self.engines[: self.n_prefill]

    @property
    def decode(self) -> list[str]:
        return self.engines[self.n_prefill :]

    def reset(self, timeout: float = 120.0) -> None:
        """Wait until every engine is idle (no running, waiting or held requests), then empty
        their prefix caches, so each run starts from the same state."""
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=10) as c:
            for url in self.engines + self.small_chunk:
                while True:
                    st = c.get(url + "/sim/state").json()
                    if not (st["running"] or st["waiting"] or st["kv_loading"] or st["held"]):
                        break
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{url} did not go idle: {st}")
                    time.sleep(0.2)
                ok = c.post(url + "/reset_prefix_cache").json()
                if not ok.get("success"):
                    raise RuntimeError(f"{url}: prefix cache reset refused")


def start_engines(
    group: ProcGroup,
    n: int,
    profile: str,
    time_scale: float,
    tokenizer: Path,
    extra: tuple[str, ...] = (),
    tag: str = "",
) -> list[str]:
    urls = []
    procs = []
    for i in range(n):
        port, kv_port = free_port(), free_port()
        argv = [
            sys.executable, "-m", "sim", "--role", "both", "--host", "127.0.0.1", "--port", str(port),
            "--kv-port", str(kv_port), "--model", MODEL, "--tokenizer", str(tokenizer),
            "--max-model-len", "32768", "--profile", profile, "--time-scale", str(time_scale), *extra,
        ]  # fmt: skip
        procs.append((group.start(f"engine{tag}-{i}", argv, env={"VLLM_SERVER_DEV_MODE": "1"}), port))
        urls.append(f"http://127.0.0.1:{port}")
    for proc, port in procs:
        proc.wait_http(f"http://127.0.0.1:{port}/health", timeout=60)
    return urls


def pdgate_config(
    name: str, cluster: Cluster, tokenizer: Path, profile: str, port: int, end: str | None = None
) -> dict[str, Any]:
    """The gateway's YAML for one configuration. Times the gateway learns or is told are wall
    times: the cost model's prefill speed and KV link are divided by the time scale."""
    pd = name in PD_CONFIGS
    eng = engine_settings(profile, end=end)
    scale = cluster.time_scale
    decider: dict[str, Any] = {"name": "token_threshold", "threshold": 1_000_000_000}
    if name == "pd-always":
        decider = {"name": "token_threshold", "threshold": 1}
    elif name == "pd-threshold":
        decider = {"name": "token_threshold", "threshold": 4096}
    elif name == "pd-cost-model":
        decider = {
            "name": "cost_model",
            "kv_bytes_per_token": int(eng.get("kv_bytes_per_token", 327680)),
            "kv_bandwidth_gbps": effective_link_gbps(eng) / scale,
            "prefill_tokens_per_s": 1 / (float(eng.get("prefill_time_per_token") or 1e-4) * scale),
            "pd_overhead_s": (float(eng.get("kv_transfer_latency", 0.0)) + 0.005) * scale,
            "itl_budget_s": 0.05 * scale,  # the SLO's 50 ms, in wall time
            "prefill_chunk_tokens": int(eng.get("max_num_batched_tokens", 8192)),
        }
    return {
        "server": {"host": "127.0.0.1", "port": port, "log_level": "warning", "workers": 1},
        "models": [{"name": MODEL, "tokenizer": str(tokenizer), "max_model_len": 32768}],
        "pools": {
            "prefill": {"endpoints": cluster.prefill if pd else []},
            "decode": {
                "endpoints": cluster.decode
                if pd
                else cluster.small_chunk
                if name == "colocated-2k"
                else cluster.engines
            },
        },
        "routing": {"decider": decider},
        "timeouts": {"prefill_s": 900, "decode_first_byte_s": 900, "decode_idle_s": 900},
    }


def effective_link_gbps(eng: dict[str, Any]) -> float:
    """The KV link the cost model is told: the profile's bandwidth with its per-block cost
    (NIXL descriptors) folded in, as Gbit/s of KV bytes."""
    bits = float(eng.get("kv_bytes_per_token", 327680)) * 8
    per_token = bits / (float(eng.get("kv_bandwidth_gbps") or 400) * 1e9)
    per_token += float(eng.get("kv_transfer_time_per_block", 0.0)) / int(eng.get("block_size", 16))
    return bits / per_token / 1e9


def start_routers(
    cluster: Cluster,
    configs: list[str],
    tokenizer: Path,
    profile: str,
    logs: Path,
    vllm_router: Path | None,
    end: str | None = None,
) -> None:
    waits = []
    for name in configs:
        port = free_port()
        if name in PEER_CONFIGS:
            assert vllm_router is not None
            argv = [str(vllm_router), "--host", "127.0.0.1", "--port", str(port),
                    "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                    "--max-concurrent-requests", "4096", "--queue-size", "4096",
                    "--request-timeout-secs", "900", "--log-level", "warning"]  # fmt: skip
            if name == "colocated-rr":
                argv += ["--policy", "round_robin", "--worker-urls", *cluster.engines]
            else:
                argv += ["--vllm-pd-disaggregation"]
                for u in cluster.prefill:
                    argv += ["--prefill", u]
                for u in cluster.decode:
                    argv += ["--decode", u]
            proc = cluster.group.start(name, argv)
            waits.append((proc, f"http://127.0.0.1:{port}/health"))
        else:
            path = logs / f"{name}.yaml"
            path.write_text(yaml.safe_dump(pdgate_config(name, cluster, tokenizer, profile, port, end)))
            proc = cluster.group.start(name, [sys.executable, "-m", "gateway", "serve", "--config", str(path)])
            waits.append((proc, f"http://127.0.0.1:{port}/ready"))
        cluster.routers[name] = (proc, f"http://127.0.0.1:{port}/v1/completions")
    for proc, url in waits:
        proc.wait_http(url, timeout=120)


# ---------------------------------------------------------------------------- load
@dataclass
class Result:
    klass: str
    ok: bool
    ttft_s: float = 0.0  # simulated
    itls_s: list[float] = field(default_factory=list)  # simulated
    tokens: int = 0
    finished_s: float = 0.0  # simulated, since the run's start
    path: str | None = None
    error: str | None = None
    status: int = 0  # HTTP


class Progress:
    """One status line on stderr, redrawn in place."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.done, self.failed = label, total, 0, 0
        self._last = 0.0
        self.tty = sys.stderr.isatty()

    def tick(self, ok: bool) -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        now = time.monotonic()
        if now - self._last > 0.25 or self.done == self.total:
            self._last = now
            self.draw()

    def draw(self, final: bool = False) -> None:
        width = 30
        filled = int(width * self.done / max(self.total, 1))
        bar = "#" * filled + "." * (width - filled)
        line = f"  {self.label:48s} [{bar}] {self.done}/{self.total}" + (
            f" ({self.failed} failed)" if self.failed else ""
        )
        if self.tty:
            print("\r" + line, end="\n" if final else "", file=sys.stderr, flush=True)
        elif final:
            print(line, file=sys.stderr, flush=True)


async def send(
    session: aiohttp.ClientSession,
    url: str,
    req: Request,
    t0: float,
    scale: float,
    progress: Progress,
    headers: dict[str, str] | None = None,
) -> Result:
    """One streamed completion at its arrival time: its TTFT and inter-token gaps (simulated)."""
    body = orjson.dumps(
        {
            "model": MODEL,
            "prompt": req.prompt,
            "max_tokens": req.max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
    )
    delay = t0 + req.arrival_s * scale - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    start = time.perf_counter()
    res = Result(req.klass, False)
    last = 0.0
    try:
        async with session.post(
            url, data=body, headers={"Content-Type": "application/json", **(headers or {})}
        ) as resp:
            res.status = resp.status
            res.path = resp.headers.get("x-pdgate-path")
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                now = time.perf_counter()
                if b'"error"' in line[:20] or b'"object":"error"' in line:
                    res.error = line[6:206].decode(errors="replace")
                    return res
                if b'"choices":[]' in line:
                    continue  # a usage-only chunk
                if res.tokens == 0:
                    res.ttft_s = (now - start) / scale
                else:
                    res.itls_s.append((now - last) / scale)
                last = now
                res.tokens += 1
        res.ok = res.tokens > 0
        if not res.ok:
            res.error = "no tokens"
    except (TimeoutError, aiohttp.ClientError) as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        res.finished_s = (time.perf_counter() - t0) / scale
        progress.tick(res.ok)
    return res


async def run_point(url: str, reqs: list[Request], scale: float, progress: Progress) -> list[Result]:
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=900)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        t0 = time.perf_counter() + 0.2
        return await asyncio.gather(*(send(session, url, r, t0, scale, progress) for r in reqs))


# ---------------------------------------------------------------------------- metrics
def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summarize(reqs: list[Request], results: list[Result], duration_s: float, rate: float) -> dict[str, Any]:
    """Latency percentiles, throughput and goodput of one run (simulated seconds). Goodput is
    the offered rate times the share of requests that met their SLO (a Poisson draw of a short
    run has more or fewer requests than rate x duration; this keeps the rates comparable)."""
    ttfts = [r.ttft_s for r in results if r.ok]
    itls = [x for r in results if r.ok for x in r.itls_s]
    met = met_tail = 0
    per_request = []
    for q, r in zip(reqs, results, strict=True):
        p90 = pct(r.itls_s, 0.9) or 0.0
        p99 = pct(r.itls_s, 0.99) or 0.0
        per_request.append([q.klass, len(q.prompt), round(r.ttft_s * 1000, 1) if r.ok else None,
                            round(p90 * 1000, 1), round(p99 * 1000, 1), r.tokens])  # fmt: skip
        if not r.ok:
            continue
        if r.ttft_s <= q.slo.ttft_s and p90 <= q.slo.itl_p90_s:
            met += 1
            if p99 <= q.slo.itl_p99_s:
                met_tail += 1
    ok = [r for r in results if r.ok]
    span = max([r.finished_s for r in ok], default=duration_s)
    tokens = sum(r.tokens for r in ok)
    paths: dict[str, int] = {}
    for r in ok:
        if r.path:
            paths[r.path] = paths.get(r.path, 0) + 1

    def ms(v: float | None) -> float | None:
        return None if v is None else round(v * 1000, 1)

    return {
        "requests": len(reqs),
        "completed": len(ok),
        "failed": len(reqs) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:3],
        "ttft_ms": {f"p{q}": ms(pct(ttfts, q / 100)) for q in (50, 90, 99)},
        "itl_ms": {f"p{q}": ms(pct(itls, q / 100)) for q in (50, 90, 99)} | {"p99.9": ms(pct(itls, 0.999))},
        "throughput_tok_s": round(tokens / span, 1) if span else 0.0,
        "throughput_req_s": round(len(ok) / span, 3) if span else 0.0,
        "slo_met": met,
        "attainment": round(met / len(reqs), 3) if reqs else 0.0,
        "goodput_req_s": round(rate * met / len(reqs), 3) if reqs else 0.0,
        "slo_met_tail": met_tail,
        "attainment_tail": round(met_tail / len(reqs), 3) if reqs else 0.0,
        "goodput_tail_req_s": round(rate * met_tail / len(reqs), 3) if reqs else 0.0,
        "paths": paths,
        # [class, prompt tokens, TTFT ms (null: failed), own ITL p90 ms, own ITL p99 ms, tokens]
        "per_request": per_request,
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


def best_rates(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per configuration, workload and arrival process: the highest rate swept at which at least
    90% of requests met their SLO, and the highest goodput seen."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for p in points:
        groups.setdefault((p["config"], p["workload"], p["arrivals"]), []).append(p)
    out = []
    for (config, workload, arrivals), ps in groups.items():
        ok = [p["rate"] for p in ps if p["attainment"] >= ATTAINMENT]
        ok_tail = [p["rate"] for p in ps if p.get("attainment_tail", 0) >= ATTAINMENT]
        out.append(
            {
                "config": config,
                "workload": workload,
                "arrivals": arrivals,
                "max_rate_at_slo": max(ok) if ok else 0.0,
                "max_goodput_req_s": max(p["goodput_req_s"] for p in ps),
                "max_rate_at_tail_slo": max(ok_tail) if ok_tail else 0.0,
                "max_goodput_tail_req_s": max(p.get("goodput_tail_req_s", 0.0) for p in ps),
            }
        )
    return out


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
