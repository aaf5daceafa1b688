"""LoRA adapter routing: adapter affinity + load against round robin and prefix-only routing.

    python -m bench.adapters [--adapters 30] [--requests 360] [--rate 3] [--time-scale 0.5]
        [--out docs/benchmarks/adapters.json] [--plot docs/benchmarks/adapters.png]

Many fine-tunes on a few engines with few adapter slots: ``--engines`` simulated engines (``pdgate
sim``, the calibrated Llama-3.3-70B TP8 H100 profile), each with ``--enable-lora --max-loras 2
--max-cpu-loras 4`` (two adapters per batch, four kept loaded) and ``--lora-load-time`` per load
of an adapter that is not among its loaded four. None is preloaded: the gateway loads each one
where routing sends it (``lora.dynamic_loading``), keeping at most ``--max-adapters-per-engine``
listed per engine (default 4, the engines' ``--max-cpu-loras``: what an engine lists is then what
it can hold loaded, which is what ``lora_affinity`` believes it holds).

Direct only by default (``--prefill 0``): the question is which engine an adapter's requests go to,
and with one prefill engine every configuration sends the same long prompts to the same engine (the
same loads there); a fourth engine in the pool routing chooses from asks the question better.
``--prefill 1`` runs it as 1P + the rest decode, the P/D fleet docs/adapters.md describes.

Traffic (one seeded PRNG, the same requests for every configuration): each request names one of
``--adapters`` adapters drawn with Zipf popularity (``--zipf`` s: weight 1/rank^s); each adapter has
its own 600-1,500-token system prompt (its KV is hashed with the adapter, so only that adapter's
requests reuse it); 85% chats (+50-400 tokens, TTFT objective 1 s), 15% long documents (+4-8k
tokens, 3 s); 64-256 output tokens; Poisson arrivals at ``--rate`` per simulated second.

The default rate keeps the fleet's 8 adapter slots (4 engines x 2) roughly two-thirds busy (a
request holds its adapter's slot for ~2 simulated seconds; requests of one adapter share it); at
6 req/s they saturate and every configuration queues. ``--lora-load-time`` 0.25 s: a rank-16 adapter
on every linear layer of Llama-3.3-70B is ~0.41 GB in bf16 (~0.07 GB on q/v only) to read and copy
to the GPUs; LoRAX measured 0.5-1+ s per load (predibase/lorax#433), the simulator's default 0.05 s
has no source. It is a knob: the answer depends on it.

Configurations (the gateway's routing; the same ``token_threshold`` decider for all):

- ``affinity``: the default pipelines: scorers prefix_affinity 2, load 1, lora_affinity 1;
  decode filter bounded_load.
- ``round-robin``: picker least_inflight (the fewest in flight, ties rotate), no scorer, no filter.
- ``prefix-only``: scorer prefix_affinity only (decode filter bounded_load, as by default).

Reported per configuration: TTFT p50/p99 (simulated seconds), goodput (the share of requests
meeting their TTFT objective), adapter loads per simulated minute (the engines' own loads into
their adapter cache, ``/sim/state``; and the gateway's ``pdgate_adapter_loads_total``), unloads,
the prefix-cache hit share and how the requests spread over the engines. ``--plot`` draws it
(bench.adapters_plot; ``python -m bench.adapters_plot RESULT.json PLOT.png`` redraws a saved one).

Bounded: ``--requests`` per configuration, loopback only; every process is stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson
import yaml

from bench.adapters_plot import plot
from bench.goodput_cluster import MODEL, start_engines
from bench.goodput_load import Progress, Result
from bench.goodput_metrics import pct
from bench.workloads import SLOS, VOCAB_HIGH, VOCAB_LOW, Request
from engine_model.tinymodel import build_tokenizer
from gateway.demo import cache_dir
from tests.procs import ProcGroup, free_port

PROFILE = "llama-3.3-70b-tp8-h100"
BLOCK = 16
CONFIGS = ("affinity", "round-robin", "prefix-only")
TTFT_SLO = {"chat": SLOS["chat"].ttft_s, "long": SLOS["long"].ttft_s}  # 1 s, 3 s (bench.workloads)
LONG_SHARE = 0.15
HEAD = 3  # the most popular adapters, reported apart from the tail


@dataclass
class AdapterRequest(Request):
    adapter: str = ""


@dataclass
class AdapterResult(Result):
    engine: str | None = None  # the decode engine (x-pdgate-route)
    prompt_tokens: int = 0
    cached_tokens: int = 0


def adapter_names(n: int) -> list[str]:
    """Names in popularity order: ``lora-00`` is the most asked for."""
    return [f"lora-{i:02d}" for i in range(n)]


def zipf_weights(n: int, s: float) -> list[float]:
    """Popularity of ranks 1..n, normalized: rank k gets 1/k^s of the mass of rank 1."""
    raw = [1.0 / (k**s) for k in range(1, n + 1)]
    total = sum(raw)
    return [w / total for w in raw]


def _tokens(rng: random.Random, lo: int, hi: int) -> list[int]:
    return [rng.randint(VOCAB_LOW, VOCAB_HIGH) for _ in range(rng.randint(lo, hi))]


def workload(n: int, rate: float, adapters: int, zipf_s: float = 1.1, seed: int = 11) -> list[AdapterRequest]:
    """``n`` requests at ``rate`` per simulated second (Poisson), each for an adapter drawn by Zipf
    popularity, its prompt that adapter's system prompt plus a chat turn or a long document."""
    rng = random.Random(seed)
    names = adapter_names(adapters)
    weights = zipf_weights(adapters, zipf_s)
    system = {name: _tokens(rng, 600, 1500) for name in names}
    reqs, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        name = rng.choices(names, weights)[0]
        if rng.random() < LONG_SHARE:
            klass, body = "long", _tokens(rng, 4000, 8000) + _tokens(rng, 50, 150)
        else:
            klass, body = "chat", _tokens(rng, 50, 400)
        reqs.append(AdapterRequest(i, t, system[name] + body, rng.randint(64, 256), klass, adapter=name))
    return reqs


# ---------------------------------------------------------------------------- processes
def routing_for(config: str) -> dict[str, Any]:
    """The pool pipelines of one configuration (both pools alike), merged into ``routing``."""
    if config == "affinity":
        return {}  # the defaults: prefix_affinity 2 + load 1 + lora_affinity 1, decode filter bounded_load
    if config == "round-robin":
        pool = {"filters": [], "scorers": [], "picker": {"name": "least_inflight"}}
        return {"decode": pool, "prefill": pool}
    if config == "prefix-only":
        scorers = [{"name": "prefix_affinity", "weight": 1}]
        return {"decode": {"filters": [{"name": "bounded_load"}], "scorers": scorers}, "prefill": {"scorers": scorers}}
    raise ValueError(f"unknown configuration {config!r}")


def gateway_config(
    config: str, engines: list[str], n_prefill: int, tokenizer: Path, paths: dict[str, str], args: Any
) -> dict[str, Any]:
    """The gateway's YAML. Scrapes every simulated second (the lora_affinity scorer reads the
    engines' running adapters from them), as a real deployment's 1 s would be."""
    return {
        "server": {"host": "127.0.0.1", "port": free_port(), "log_level": "warning", "workers": 1},
        "models": [
            {
                "name": MODEL,
                "tokenizer": str(tokenizer),
                "max_model_len": 32768,
                "adapters": [{"name": n, "path": p, "max_rank": 16} for n, p in paths.items()],
            }
        ],
        "lora": {"dynamic_loading": True, "max_adapters_per_engine": args.max_adapters_per_engine},
        "pools": {"prefill": {"endpoints": engines[:n_prefill]}, "decode": {"endpoints": engines[n_prefill:]}},
        "routing": {
            "decider": {"name": "token_threshold", "threshold": 4096},
            "prefix": {"block_size": BLOCK},
            "debug_headers": True,  # x-pdgate-route names the decode engine of each request
            **routing_for(config),
        },
        "signals": {"scrape_interval_s": args.time_scale, "max_age_s": 5 * args.time_scale},
        "timeouts": {"prefill_s": 900, "decode_first_byte_s": 900, "decode_idle_s": 900},
    }


def make_adapters(root: Path, names: list[str]) -> dict[str, str]:
    """One folder per adapter (the engines refuse a path that is not one), rank 16."""
    paths = {}
    for name in names:
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "adapter_config.json").write_text(json.dumps({"r": 16, "lora_alpha": 16}))
        paths[name] = str(folder)
    return paths


# ---------------------------------------------------------------------------- load
_DECODE = re.compile(r"decode=(\S+?)(?:;|$)")


async def send(
    session: aiohttp.ClientSession, url: str, req: AdapterRequest, t0: float, scale: float, progress: Progress
) -> AdapterResult:
    """One streamed completion for ``req.adapter`` at its arrival time (bench.goodput_load.send,
    with the adapter as ``model`` and the usage chunk read for the cached tokens)."""
    body = orjson.dumps(
        {
            "model": req.adapter,
            "prompt": req.prompt,
            "max_tokens": req.max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    delay = t0 + req.arrival_s * scale - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    start = time.perf_counter()
    res = AdapterResult(req.klass, False)
    try:
        async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
            res.status, res.path = resp.status, resp.headers.get("x-pdgate-path")
            if m := _DECODE.search(resp.headers.get("x-pdgate-route", "")):
                res.engine = m.group(1)
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = orjson.loads(line[6:])
                if "error" in chunk or chunk.get("object") == "error":
                    res.error = line[6:206].decode(errors="replace")
                    return res
                if usage := chunk.get("usage"):
                    res.prompt_tokens = usage.get("prompt_tokens", 0)
                    res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                if not chunk.get("choices"):
                    continue
                if res.tokens == 0:
                    res.ttft_s = (time.perf_counter() - start) / scale
                res.tokens += 1
        res.ok = res.tokens > 0
        res.error = None if res.ok else "no tokens"
    except (TimeoutError, aiohttp.ClientError, orjson.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        res.finished_s = (time.perf_counter() - t0) / scale
        progress.tick(res.ok)
    return res


async def run_load(url: str, reqs: list[AdapterRequest], scale: float, progress: Progress) -> list[AdapterResult]:
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=900)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        t0 = time.perf_counter() + 0.2
        return await asyncio.gather(*(send(session, url, r, t0, scale, progress) for r in reqs))


def counters(gateway: str, engines: list[str]) -> dict[str, int]:
    """The gateway's adapter loads and unloads by result, and the engines' own loads and evictions
    (their adapter cache: a load the gateway asked for, or a step whose adapter was evicted)."""
    out: Counter[str] = Counter()
    with httpx.Client(timeout=10) as c:
        for m in re.finditer(r'^pdgate_adapter_(loads|unloads)_total\{result="(\w+)"\} (\S+)$',
                             c.get(gateway + "/metrics").text, re.M):  # fmt: skip
            out[f"gateway_{m.group(1)}_{m.group(2)}"] += int(float(m.group(3)))
        for url in engines:
            lora = c.get(url + "/sim/state").json()["lora"]
            out["engine_loads"] += lora["loads"]
            out["engine_evictions"] += lora["evictions"]
    return dict(out)


def run_config(
    config: str, reqs: list[AdapterRequest], tokenizer: Path, paths: dict[str, str], args: Any
) -> dict[str, Any]:
    group = ProcGroup(Path(tempfile.mkdtemp(prefix=f"pdgate-bench-adapters-{config}-")))
    try:
        extra = (
            "--enable-lora", "--max-loras", str(args.max_loras), "--max-cpu-loras", str(args.max_cpu_loras),
            "--max-lora-rank", "16", "--lora-load-time", str(args.lora_load_time),
            "--enable-prompt-tokens-details", "--block-size", str(BLOCK),
        )  # fmt: skip
        engines = start_engines(group, args.engines, PROFILE, args.time_scale, tokenizer, extra)
        cfg = gateway_config(config, engines, args.prefill, tokenizer, paths, args)
        path = group.log_dir / f"gateway-{config}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        proc = group.start(path.stem, [sys.executable, "-m", "gateway", "serve", "--config", str(path)])
        url = f"http://127.0.0.1:{cfg['server']['port']}"
        proc.wait_http(url + "/ready", timeout=120)
        before = counters(url, engines)
        progress = Progress(f"adapters {config}", len(reqs))
        results = asyncio.run(run_load(url + "/v1/completions", reqs, args.time_scale, progress))
        progress.draw(final=True)
        after = counters(url, engines)
        delta = {k: v - before.get(k, 0) for k, v in after.items()}
        return summarize(config, reqs, results, delta)
    finally:
        group.stop_all()


# ---------------------------------------------------------------------------- scoring
def _ttfts(pairs: list[tuple[AdapterRequest, AdapterResult]]) -> dict[str, Any]:
    xs = [r.ttft_s for _, r in pairs if r.ok]
    return {"ttft_p50_s": pct(xs, 0.5), "ttft_p99_s": pct(xs, 0.99), "n": len(pairs)}


def summarize(
    config: str, reqs: list[AdapterRequest], results: list[AdapterResult], counts: dict[str, int]
) -> dict[str, Any]:
    """One configuration's figures. Rates are per simulated minute of the run (first arrival to
    last answer); goodput is the share of all requests (failed ones miss) meeting their objective."""
    pairs = list(zip(reqs, results, strict=True))
    ok = [r for r in results if r.ok]
    met = sum(1 for q, r in pairs if r.ok and r.ttft_s <= TTFT_SLO[q.klass])
    minutes = max((r.finished_s for r in results), default=0.0) / 60 or 1.0
    head = set(adapter_names(HEAD))
    per_engine = Counter(r.engine for r in results if r.engine)
    adapters_on = {e: len({q.adapter for q, r in pairs if r.engine == e}) for e in per_engine}
    prompt = sum(r.prompt_tokens for r in ok)
    errors = Counter((r.error or "")[:80] for r in results if not r.ok)
    return {
        "config": config,
        "requests": len(reqs),
        "failed": len(results) - len(ok),
        "errors": dict(errors.most_common(3)),
        **_ttfts(pairs),
        "goodput": met / len(reqs) if reqs else 0.0,
        "by_class": {k: _ttfts([(q, r) for q, r in pairs if q.klass == k]) for k in TTFT_SLO},
        "by_popularity": {
            f"top{HEAD}": _ttfts([(q, r) for q, r in pairs if q.adapter in head]),
            "tail": _ttfts([(q, r) for q, r in pairs if q.adapter not in head]),
        },
        "sim_minutes": round(minutes, 3),
        "engine_loads": counts.get("engine_loads", 0),
        "engine_evictions": counts.get("engine_evictions", 0),
        "engine_loads_per_min": round(counts.get("engine_loads", 0) / minutes, 1),
        "gateway_loads": counts.get("gateway_loads_ok", 0),
        "gateway_loads_failed": counts.get("gateway_loads_failed", 0) + counts.get("gateway_loads_timeout", 0),
        "gateway_loads_per_min": round(counts.get("gateway_loads_ok", 0) / minutes, 1),
        "gateway_unloads": counts.get("gateway_unloads_ok", 0),
        "prefix_hit_share": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        "requests_per_engine": sorted(per_engine.values(), reverse=True),
        "adapters_per_engine": [adapters_on[e] for e, _ in per_engine.most_common()],
        "pd": sum(1 for r in results if r.path == "pd"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--adapters", type=int, default=30)
    ap.add_argument("--zipf", type=float, default=1.1, help="popularity skew s: rank k weighs 1/k^s")
    ap.add_argument("--requests", type=int, default=360, help="per configuration")
    ap.add_argument("--rate", type=float, default=3.0, help="requests per simulated second")
    ap.add_argument("--time-scale", type=float, default=0.5, help="wall seconds per simulated second")
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--prefill", type=int, default=0, choices=(0, 1), help="1: the first engine is a prefill pool")
    ap.add_argument("--max-loras", type=int, default=2, help="each engine's adapters per batch")
    ap.add_argument("--max-cpu-loras", type=int, default=4, help="each engine's loaded adapters")
    ap.add_argument("--lora-load-time", type=float, default=0.25, help="simulated seconds per adapter load")
    ap.add_argument("--max-adapters-per-engine", type=int, default=4, help="the gateway's lora bound (0: none)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, of " + ", ".join(CONFIGS))
    ap.add_argument("--out", default=None, help="write the results (JSON) here")
    ap.add_argument("--plot", default=None, help="draw the results (PNG) here (needs matplotlib)")
    args = ap.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    if not 1 <= args.requests <= 2000 or args.rate <= 0 or args.time_scale <= 0 or not 2 <= args.adapters <= 200:
        ap.error("--requests must be 1..2000, --adapters 2..200, --rate and --time-scale positive")
    if args.engines - args.prefill < 2 or set(configs) - set(CONFIGS):
        ap.error(f"at least 2 decode engines; --configs of {', '.join(CONFIGS)}")
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"  # the engines' load/unload routes (inherited)
    tokenizer = build_tokenizer(cache_dir() / "demo-tokenizer")
    reqs = workload(args.requests, args.rate, args.adapters, args.zipf)
    root = Path(tempfile.mkdtemp(prefix="pdgate-bench-adapters-"))
    started = time.monotonic()
    try:
        paths = make_adapters(root, adapter_names(args.adapters))
        runs = [run_config(c, reqs, tokenizer, paths, args) for c in configs]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out = {
        "profile": PROFILE,
        "args": {k: v for k, v in vars(args).items() if k not in ("out", "plot")},
        "ttft_slo_s": TTFT_SLO,
        "wall_s": round(time.monotonic() - started, 1),
        "runs": runs,
    }
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.plot:
        plot(out, Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
