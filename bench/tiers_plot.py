"""The KV-tier benchmark's plot, drawn from its JSON (``bench.tiers --out``) without re-running it.

    python -m bench.tiers_plot docs/benchmarks/tiers.json docs/benchmarks/tiers.png

Two panels, tier-aware routing off against on: TTFT p50 and p99 per traffic class (the question
the benchmark asks is whether documents the GPU evicted stop paying for a P/D round), and the P/D
hand-overs (the mechanism: an evicted prefix that lives in L1/L2 is a load, not a recompute).
A separate module so that a plot can be redone from committed figures, and so that ``bench.tiers``
imports without matplotlib (an optional dependency: the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

MISSING = "matplotlib missing: install the bench extra: pip install -e '.[bench]'"
COLORS = {False: "C7", True: "C2"}  # grey: GPU hits only; green: tier-aware


def _label(tiers: bool) -> str:
    return f"tiers {'on' if tiers else 'off'}"


def plot(doc: dict[str, Any], png: Path) -> Path | None:
    """Render ``doc`` (one ``bench.tiers`` result) to ``png``; None, with one line on stderr, when
    matplotlib is not installed (the benchmark's JSON stays the record either way)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on CI or a headless bench host
        import matplotlib.pyplot as plt
    except ImportError:
        print(MISSING, file=sys.stderr)
        return None
    runs = sorted(doc["runs"], key=lambda r: r["tiers"])
    classes = list(runs[0]["by_class"])
    groups = [(k, q) for k in classes for q in ("p50", "p99")]
    fig, (ttft, pd) = plt.subplots(1, 2, figsize=(9, 3.6), gridspec_kw={"width_ratios": [2.2, 1]})
    width = 0.8 / len(runs)
    for j, run in enumerate(runs):
        ms = [run["by_class"][k][f"ttft_{q}_s"] * 1000 for k, q in groups]
        xs = [i + (j - (len(runs) - 1) / 2) * width for i in range(len(groups))]
        bars = ttft.bar(xs, ms, width, color=COLORS[run["tiers"]], label=_label(run["tiers"]))
        ttft.bar_label(bars, labels=[f"{v:.0f}" for v in ms], fontsize=7)
    ttft.set_xticks(range(len(groups)), [f"{k} {q}" for k, q in groups])
    ttft.set_ylabel("TTFT (simulated ms)")
    ttft.set_title("TTFT per traffic class")
    ttft.margins(y=0.12)
    ttft.legend(fontsize=8, loc="upper left")
    counts = [run["pd"] for run in runs]
    bars = pd.bar([_label(r["tiers"]) for r in runs], counts, color=[COLORS[r["tiers"]] for r in runs])
    pd.bar_label(bars, labels=[f"{c} / {r['requests']}" for c, r in zip(counts, runs, strict=True)], fontsize=8)
    pd.set_title("P/D hand-overs")
    pd.set_ylabel("requests sent P/D")
    pd.margins(y=0.12)
    args = doc.get("args", {})
    fig.suptitle(
        f"KV tiers: {doc.get('profile', '')}, {args.get('requests', '?')} requests at {args.get('rate', '?')} req/s",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", type=Path, help="a bench.tiers result (--out)")
    ap.add_argument("png", type=Path, help="where to write the plot")
    args = ap.parse_args(argv)
    return 0 if plot(json.loads(args.json.read_text()), args.png) else 1


if __name__ == "__main__":
    sys.exit(main())
