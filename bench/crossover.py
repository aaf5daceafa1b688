"""When does P/D pay? The crossover prompt length and rate, per SLO, as the hand-over cost varies.

Workload: 70% chat (100-1,500 prompt tokens, TTFT SLO 1 s) + 30% long prompts of about L tokens
(L +-10%, 256-1,024 output tokens, TTFT SLO 3 s), Poisson arrivals. On two engines of the
calibrated profile (``--profile``), in the fleet simulator (:mod:`engine_model.fleet`):

- colocated x2 with vLLM's default 8,192-token chunks, and with 2,048-token chunks (the better
  of the two is "best colocated");
- 1 prefill + 1 decode, prompts of at least 0.9 L through P/D, with the hand-over's fixed latency
  at each of ``--handover-ms`` (the profile's other terms as calibrated).

For each, the capacity: the highest rate on a geometric grid (steps of 19%, bisected) at which
>= 90% of requests meet the SLO. Three SLOs, judged on the same runs: standard (TTFT 1 s chat /
3 s long, each stream's p90 ITL <= 50 ms), tail (also its p99 ITL <= 100 ms) and tight (tail, with
TTFT 0.5 s chat / 1.5 s long: where the hand-over's cost shows). P/D pays where its capacity
exceeds the best colocated one; the crossover rate is the best colocated capacity (below it both
hold the SLO). Output: JSON, Markdown and a PNG chart.

    python -m bench.crossover [--quick] [--out docs/benchmarks/crossover.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from engine_model import profile
from engine_model.fleet import Layout, Result, simulate
from engine_model.workload import Klass, Workload

RATES = tuple(round(0.5 * 2 ** (i / 4), 3) for i in range(25))  # 0.5 .. 32 req/s, 19% apart
SLOS: dict[str, tuple[dict[str, float] | None, bool]] = {  # TTFT override per class, tail
    "standard": (None, False),
    "tail": (None, True),
    "tight": ({"chat": 0.5, "long": 1.5}, True),
}
LENGTHS = (1024, 2048, 4096, 8192, 16384)
HANDOVER_MS = (20, 50, 110, 160, 300)
TARGET = 0.9


def mix(length: int) -> Workload:
    lo, hi = int(length * 0.9), int(length * 1.1)
    return Workload(
        classes=(
            Klass("chat", 0.7, (100, 1500), (50, 400), 1.0, 0.05),
            Klass("long", 0.3, (lo, hi), (256, 1024), 3.0, 0.05),
        )
    )


def attainments(res: Result) -> dict[str, float]:
    out = {}
    for name, (ttft, tail) in SLOS.items():
        jobs = res.jobs if ttft is None else [replace(j, ttft_slo_s=ttft[j.klass]) for j in res.jobs]
        met = sum(o.met(j, tail) for o, j in zip(res.outcomes, jobs, strict=True))
        out[name] = round(met / len(jobs), 4) if jobs else 1.0
    return out


def capacity(settings: dict[str, Any], layout: Layout, wl: Workload, duration: float, seed: int) -> dict[str, Any]:
    """Per SLO, the highest grid rate with >= 90% within it (bisection; runs shared between SLOs)."""
    seen: dict[int, dict[str, float]] = {}

    def at(i: int) -> dict[str, float]:
        if i not in seen:
            rate = RATES[i]
            seen[i] = attainments(simulate(settings, layout, wl.jobs(rate, duration, seed), duration_s=duration))
        return seen[i]

    cap = {}
    for slo in SLOS:
        ok, bad = -1, len(RATES)
        while bad - ok > 1:
            mid = (ok + bad) // 2
            ok, bad = (mid, bad) if at(mid)[slo] >= TARGET else (ok, mid)
        cap[slo] = RATES[ok] if ok >= 0 else 0.0
    return {"capacity": cap, "points": [{"rate": RATES[i], **seen[i]} for i in sorted(seen)]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    base = profile.engine_settings(args.profile)
    rows = []
    t0 = time.monotonic()
    total = len(args.lengths) * (2 + len(args.handover_ms))
    k = 0
    for length in args.lengths:
        wl = mix(length)
        colo = {}
        for chunk in (8192, 2048):
            k += 1
            print(f"[{k}/{total}] L={length} colocated x2, {chunk}-token chunks", file=sys.stderr, flush=True)
            colo[chunk] = capacity({**base, "max_num_batched_tokens": chunk}, Layout(0, 2, "colocated"), wl,
                                   args.duration, args.seed)  # fmt: skip
        best = {slo: max(c["capacity"][slo] for c in colo.values()) for slo in SLOS}
        for h in args.handover_ms:
            k += 1
            print(f"[{k}/{total}] L={length} 1P+1D, hand-over {h} ms", file=sys.stderr, flush=True)
            pd = capacity({**base, "kv_transfer_latency": h / 1000}, Layout(1, 1, "threshold", int(0.9 * length)), wl,
                          args.duration, args.seed)  # fmt: skip
            rows.append({
                "length": length, "handover_ms": h,
                "colocated_8192": colo[8192], "colocated_2048": colo[2048], "pd": pd,
                "best_colocated_capacity": best,
                "ratio": {slo: (pd["capacity"][slo] / best[slo] if best[slo] else None) for slo in best},
            })  # fmt: skip
    return {
        "profile": args.profile,
        "duration_s": args.duration,
        "seed": args.seed,
        "target_attainment": TARGET,
        "rates": list(RATES),
        "wall_s": round(time.monotonic() - t0, 1),
        "rows": rows,
        "crossover": crossover(rows),
    }


def crossover(rows: list[dict[str, Any]]) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Per SLO and hand-over latency: the long-prompt lengths at which P/D holds more rate than the
    best colocated layout, with both capacities (P/D pays above the colocated one). Not one length:
    with one prefill engine for one decode engine, P/D can win at short and long prompts and lose
    in between, where the prefill engine saturates first."""
    out: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for slo in SLOS:
        out[slo] = {}
        for h in sorted({r["handover_ms"] for r in rows}):
            mine = sorted((r for r in rows if r["handover_ms"] == h), key=lambda r: r["length"])
            out[slo][str(h)] = [
                {"length": r["length"], "pd": r["pd"]["capacity"][slo], "colocated": r["best_colocated_capacity"][slo]}
                for r in mine
                if r["pd"]["capacity"][slo] > r["best_colocated_capacity"][slo]
            ]
    return out


def markdown(doc: dict[str, Any]) -> str:
    lines = [
        f"Capacity (req/s at which >= {doc['target_attainment']:.0%} of requests meet the SLO) on 2 engines of "
        f"`{doc['profile']}`: 70% chat + 30% long prompts of ~L tokens; best colocated / 1P+1D per hand-over latency.",
        "",
    ]
    hs = sorted({r["handover_ms"] for r in doc["rows"]})
    for slo in SLOS:
        lines += [f"**{slo} SLO**", "", "| L tokens | best colocated | " + " | ".join(f"P/D {h} ms" for h in hs) + " |",
                  "|---|---|" + "---|" * len(hs)]  # fmt: skip
        for length in sorted({r["length"] for r in doc["rows"]}):
            mine = {r["handover_ms"]: r for r in doc["rows"] if r["length"] == length}
            best = next(iter(mine.values()))["best_colocated_capacity"][slo]
            cells = [f"{mine[h]['pd']['capacity'][slo]:.3g}" for h in hs]
            lines.append(f"| {length:,} | {best:.3g} | " + " | ".join(cells) + " |")
        cross = doc["crossover"][slo]
        lines += ["", "P/D holds more than the best colocated (P/D vs colocated req/s): " + "; ".join(
            f"hand-over {h} ms: " + (", ".join(f"{c['length']:,} ({c['pd']:.3g} vs {c['colocated']:.3g})" for c in pays)
                                     or "nowhere")
            for h, pays in cross.items()) + ".", ""]  # fmt: skip
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SLOS), figsize=(15, 4.2), sharey=True)
    for ax, slo in zip(axes, SLOS, strict=True):
        for h in sorted({r["handover_ms"] for r in doc["rows"]}):
            mine = sorted((r for r in doc["rows"] if r["handover_ms"] == h), key=lambda r: r["length"])
            xs = [r["length"] for r in mine]
            ys = [r["ratio"][slo] if r["ratio"][slo] is not None else float("nan") for r in mine]
            ax.plot(xs, ys, marker="o", label=f"hand-over {h} ms")
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("long prompt length L (tokens; 30% of requests)")
        ax.set_title(f"{slo} SLO")
    axes[0].set_ylabel("P/D capacity / best colocated capacity")
    axes[-1].legend(fontsize=8)
    fig.suptitle(f"When P/D pays: 1P+1D vs best colocated x2, {doc['profile']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", default="llama-3.3-70b-tp8-h100")
    p.add_argument("--duration", type=float, default=40.0, help="simulated seconds per point")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="3 lengths, 2 hand-over costs, 30 s per point")
    p.add_argument("--out", default="docs/benchmarks/crossover.json")
    p.add_argument("--replot", action="store_true", help="only redo the Markdown and chart from --out's JSON")
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.replot:
        doc = json.loads(out.read_text())
        doc["crossover"] = crossover(doc["rows"])
        out.write_text(json.dumps(doc, indent=1) + "\n")
        out.with_suffix(".md").write_text(markdown(doc))
        plot(doc, out.with_suffix(".png"))
        print(markdown(doc))
        return 0
    args.lengths, args.handover_ms = LENGTHS, HANDOVER_MS
    if args.quick:
        args.lengths, args.handover_ms, args.duration = (1024, 4096, 16384), (20, 300), min(args.duration, 30.0)
    doc = run(args)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(doc))
    try:
        plot(doc, out.with_suffix(".png"))
    except ImportError:
        print("matplotlib missing (pip install -e '.[bench]'): no chart", file=sys.stderr)
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
