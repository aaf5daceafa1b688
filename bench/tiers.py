"""Tier-aware routing against GPU-only routing, on traffic whose working set outgrows the GPUs.

    python -m bench.tiers [--requests 120] [--rate 1.5] [--time-scale 0.25] [--out docs/benchmarks/tiers.json]
        [--plot docs/benchmarks/tiers.png]

One prefill and two decode engines (``pdgate sim``, the calibrated Llama-3.3-70B profile), each with
a GPU KV cache shrunk to ``--gpu-tokens`` so that the traffic's working set does not fit, an L1 of
``--l1-tokens`` in host memory and one shared L2 on the local Redis (the profile's measured and
published load costs: engine_model/profiles), publishing their tier events as vLLM 0.32's
offloading connector does. The traffic mixes two shapes that reuse long prefixes:

- shared documents: ``--docs`` documents of 6-8k tokens, each asked about again and again (the
  document plus a ~100-token question);
- multi-turn chats: conversations whose every turn resends the conversation so far (+300-600).

The same requests (one seeded PRNG) go through pdgate twice, with ``routing.tiers`` off (the GPU's
hits only: a prefix the GPU evicted counts as uncached, so a long one goes P/D) and on (a prefix in
the decode engine's L1 or in L2 is a load, so it goes direct). Fresh engines and a fresh L2 for
each. Reported per configuration: TTFT p50/p99 (simulated seconds), goodput (share of requests
meeting their TTFT objective: 3 s for documents, 2 s for turns), and how many went P/D.

``--plot`` draws the figures (bench.tiers_plot, matplotlib: the ``bench`` extra); to redraw a
saved result without re-running: ``python -m bench.tiers_plot RESULT.json PLOT.png``.

Bounded: ``--requests`` per configuration, loopback only; every process is stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from bench.goodput_cluster import MODEL, start_engines
from bench.goodput_load import Progress, Result, run_point
from bench.goodput_metrics import pct
from bench.tiers_plot import plot
from bench.workloads import VOCAB_HIGH, VOCAB_LOW, Request
from engine_model.tinymodel import build_tokenizer
from gateway.demo import cache_dir
from tests.procs import ProcGroup, free_port

PROFILE = "llama-3.3-70b-tp8-h100"
BLOCK = 16
TTFT_SLO = {"doc": 3.0, "turn": 2.0}


@dataclass(frozen=True)
class Shape:
    docs: int
    conversations: int


def workload(n: int, rate: float, shape: Shape, seed: int = 7) -> list[Request]:
    """``n`` requests at ``rate`` per simulated second: half questions about a few long documents,
    half turns of multi-turn conversations, interleaved at random (Poisson arrivals)."""
    rng = random.Random(seed)
    docs = [[rng.randint(VOCAB_LOW, VOCAB_HIGH) for _ in range(rng.randint(6000, 8000))] for _ in range(shape.docs)]
    chats: list[list[int]] = [[] for _ in range(shape.conversations)]
    reqs, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        if rng.random() < 0.5:
            question = [rng.randint(VOCAB_LOW, VOCAB_HIGH) for _ in range(rng.randint(80, 120))]
            reqs.append(Request(i, t, rng.choice(docs) + question, 32, "doc"))
        else:
            c = rng.randrange(len(chats))
            chats[c] = chats[c] + [rng.randint(VOCAB_LOW, VOCAB_HIGH) for _ in range(rng.randint(300, 600))]
            reqs.append(Request(i, t, list(chats[c]), 32, "turn", session=c))
    return reqs


def _gateway(group: ProcGroup, engines: list[str], feeds: list[str], tokenizer: Path, tiers: bool, args: Any) -> str:
    port = free_port()
    decode = [{"url": u, "kv_events": f} for u, f in zip(engines[1:], feeds[1:], strict=True)]
    cfg = {
        "server": {"host": "127.0.0.1", "port": port, "log_level": "warning", "workers": 1},
        "models": [{"name": MODEL, "tokenizer": str(tokenizer), "max_model_len": 32768}],
        "pools": {"prefill": {"endpoints": [engines[0]]}, "decode": {"endpoints": decode}},
        "routing": {
            "decider": {"name": "token_threshold", "threshold": 4096},
            "prefix": {"block_size": BLOCK},
            "tiers": {
                "enabled": tiers,
                "l1_blocks": args.l1_tokens // BLOCK,
                "l2_blocks": args.l2_tokens // BLOCK,
                "chunk_tokens": BLOCK,  # the simulated offload stores whole blocks
            },
        },
        "timeouts": {"prefill_s": 900, "decode_first_byte_s": 900, "decode_idle_s": 900},
    }
    path = group.log_dir / f"gateway-{'tiers' if tiers else 'gpu'}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = group.start(path.stem, [sys.executable, "-m", "gateway", "serve", "--config", str(path)])
    proc.wait_http(f"http://127.0.0.1:{port}/ready", timeout=120)
    return f"http://127.0.0.1:{port}"


def run_config(tiers: bool, reqs: list[Request], tokenizer: Path, args: Any) -> dict[str, Any]:
    group = ProcGroup(Path(tempfile.mkdtemp(prefix=f"pdgate-bench-tiers-{'on' if tiers else 'off'}-")))
    try:
        feeds, flags = [], []
        for _ in range(3):
            pub = free_port()
            feeds.append(f"tcp://127.0.0.1:{pub}")
            events = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{pub}"})
            flags.append(events)
        prefix = f"pdgate-bench-tiers-{uuid.uuid4().hex}"
        engines = []
        for i, events in enumerate(flags):  # one at a time: each its own events port
            extra = (
                "--kv-events-config", events, "--self-describing-kv-events", "--enable-prompt-tokens-details",
                "--num-gpu-blocks", str(args.gpu_tokens // BLOCK + 1), "--cpu-blocks", str(args.l1_tokens // BLOCK),
                "--l2-url", "redis://127.0.0.1:6379/0", "--l2-key-prefix", prefix,
                "--l2-blocks", str(args.l2_tokens // BLOCK), "--block-size", str(BLOCK),
            )  # fmt: skip
            engines += start_engines(group, 1, PROFILE, args.time_scale, tokenizer, extra, tag=str(i))
        url = _gateway(group, engines, feeds, tokenizer, tiers, args)
        progress = Progress(f"tiers {'on ' if tiers else 'off'}", len(reqs))
        results = asyncio.run(run_point(url + "/v1/completions", reqs, args.time_scale, progress))
        progress.draw(final=True)
        return summarize(tiers, reqs, results)
    finally:
        group.stop_all()


def summarize(tiers: bool, reqs: list[Request], results: list[Result]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft_s for r in ok]
    met = sum(1 for q, r in zip(reqs, results, strict=True) if r.ok and r.ttft_s <= TTFT_SLO[q.klass])
    by_class = {}
    for klass in TTFT_SLO:
        xs = [r.ttft_s for q, r in zip(reqs, results, strict=True) if r.ok and q.klass == klass]
        by_class[klass] = {"ttft_p50_s": pct(xs, 0.5), "ttft_p99_s": pct(xs, 0.99), "n": len(xs)}
    return {
        "tiers": tiers,
        "requests": len(reqs),
        "failed": len(results) - len(ok),
        "ttft_p50_s": pct(ttfts, 0.5),
        "ttft_p99_s": pct(ttfts, 0.99),
        "goodput": met / len(reqs) if reqs else 0.0,
        "pd": sum(1 for r in results if r.path == "pd"),
        "direct": sum(1 for r in results if r.path == "direct"),
        "by_class": by_class,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--rate", type=float, default=1.5, help="requests per simulated second")
    ap.add_argument("--time-scale", type=float, default=0.25, help="wall seconds per simulated second")
    ap.add_argument("--docs", type=int, default=6)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--gpu-tokens", type=int, default=32_768, help="each engine's GPU KV cache (>= 32k: max-model-len)")
    ap.add_argument("--l1-tokens", type=int, default=131_072, help="each engine's L1")
    ap.add_argument("--l2-tokens", type=int, default=1_048_576, help="the shared L2")
    ap.add_argument("--out", default=None, help="write the results (JSON) here")
    ap.add_argument("--plot", default=None, help="draw the results (PNG) here (needs matplotlib)")
    args = ap.parse_args(argv)
    if args.requests < 1 or args.requests > 2000 or args.rate <= 0 or args.time_scale <= 0:
        ap.error("--requests must be 1..2000, --rate and --time-scale positive")
    tokenizer = build_tokenizer(cache_dir() / "demo-tokenizer")
    reqs = workload(args.requests, args.rate, Shape(args.docs, args.conversations))
    started = time.monotonic()
    runs = [run_config(tiers, reqs, tokenizer, args) for tiers in (False, True)]
    out = {
        "profile": PROFILE,
        "args": {k: v for k, v in vars(args).items() if k != "out"},
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
