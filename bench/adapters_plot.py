"""The LoRA adapter benchmark's plot, drawn from its JSON (``bench.adapters --out``) without re-running it.

    python -m bench.adapters_plot docs/benchmarks/adapters.json docs/benchmarks/adapters.png

Three panels, one bar group per routing configuration: TTFT p50 and p99 (what a client sees),
adapter loads per simulated minute (the mechanism: an engine that must load an adapter stalls its
whole batch for the load, and one that runs more adapters than its slots defers requests), and
goodput (the share of requests meeting their TTFT objective). A separate module so that a plot
can be redone from committed figures, and so that ``bench.adapters`` imports without matplotlib
(an optional dependency: the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

MISSING = "matplotlib missing: install the bench extra: pip install -e '.[bench]'"
COLORS = {"affinity": "C2", "round-robin": "C7", "prefix-only": "C0"}  # green: pdgate's default


def plot(doc: dict[str, Any], png: Path) -> Path | None:
    """Render ``doc`` (one ``bench.adapters`` result) to ``png``; None, with one line on stderr,
    when matplotlib is not installed (the benchmark's JSON stays the record either way)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on CI or a headless bench host
        import matplotlib.pyplot as plt
    except ImportError:
        print(MISSING, file=sys.stderr)
        return None
    runs = doc["runs"]
    names = [r["config"] for r in runs]
    colors = [COLORS.get(n, "C1") for n in names]
    fig, (ttft, loads, good) = plt.subplots(1, 3, figsize=(11, 3.6), gridspec_kw={"width_ratios": [1.6, 1.4, 1]})
    width = 0.8 / len(runs)
    for j, run in enumerate(runs):
        ms = [(run[f"ttft_{q}_s"] or 0.0) * 1000 for q in ("p50", "p99")]
        xs = [i + (j - (len(runs) - 1) / 2) * width for i in range(2)]
        bars = ttft.bar(xs, ms, width, color=colors[j], label=run["config"])
        ttft.bar_label(bars, labels=[f"{v:.0f}" for v in ms], fontsize=7)
    ttft.set_xticks(range(2), ["TTFT p50", "TTFT p99"])
    ttft.set_ylabel("simulated ms")
    ttft.set_title("TTFT")
    ttft.margins(y=0.12)
    ttft.legend(fontsize=8, loc="upper left")
    for j, run in enumerate(runs):
        rates = [run["engine_loads_per_min"], run["gateway_loads_per_min"]]
        xs = [i + (j - (len(runs) - 1) / 2) * width for i in range(2)]
        bars = loads.bar(xs, rates, width, color=colors[j])
        loads.bar_label(bars, labels=[f"{v:.0f}" for v in rates], fontsize=7)
    loads.set_xticks(range(2), ["engine cache loads", "gateway loads"])
    loads.set_ylabel("per simulated minute")
    loads.set_title("Adapter loads")
    loads.margins(y=0.12)
    shares = [run["goodput"] * 100 for run in runs]
    bars = good.bar(names, shares, color=colors)
    good.bar_label(bars, labels=[f"{v:.0f}%" for v in shares], fontsize=8)
    good.set_ylim(0, 110)
    good.set_title("Goodput (TTFT objective)")
    good.tick_params(axis="x", labelsize=8)
    args = doc.get("args", {})
    fig.suptitle(
        f"LoRA adapters: {args.get('adapters', '?')} adapters (Zipf s={args.get('zipf', '?')}) on "
        f"{args.get('engines', '?')} engines, max-loras {args.get('max_loras', '?')}, "
        f"{args.get('requests', '?')} requests at {args.get('rate', '?')} req/s ({doc.get('profile', '')})",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", type=Path, help="a bench.adapters result (--out)")
    ap.add_argument("png", type=Path, help="where to write the plot")
    args = ap.parse_args(argv)
    return 0 if plot(json.loads(args.json.read_text()), args.png) else 1


if __name__ == "__main__":
    sys.exit(main())
