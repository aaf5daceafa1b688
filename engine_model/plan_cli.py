"""``pdgate plan``: the cheapest P/D split (or colocated layout) that meets an SLO for a workload.

pdgate plan --workload mix --rate 4 --tail
pdgate plan --workload my-traffic.yaml --rate 2,4,8 --engine-hour-cost 98.32 --out plan.json
pdgate plan --trace requests.jsonl --slos my-traffic.yaml --rate 6 --profile-end high
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from engine_model import planner, profile, workload
from engine_model.oneline import Help, Parser

MAX_ENGINES = 32
MAX_DURATION_S = 3600.0


class Bar:
    """One progress line on stderr (only on a terminal, or when asked)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._last = 0.0

    def __call__(self, what: str, done: int, total: int) -> None:
        now = time.monotonic()
        if not self.enabled or (now - self._last < 0.1 and done < total):
            return
        self._last = now
        width = 30
        fill = int(width * done / max(total, 1))
        sys.stderr.write(f"\r  simulating {what[:44]:44s} [{'#' * fill}{'.' * (width - fill)}] {done}/{total}")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError("--rate takes requests/s, e.g. 4 or 2,4,8") from None
    if not rates or any(r <= 0 for r in rates) or len(rates) > 16:
        raise argparse.ArgumentTypeError("--rate takes 1 to 16 positive rates")
    return rates


def build_parser(prog: str = "pdgate plan") -> Parser:
    p = Parser(
        prog=prog,
        description=__doc__.splitlines()[0],
        epilog="examples:\n" + "\n".join("  " + line for line in __doc__.splitlines()[2:5]),
        formatter_class=Help,
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--workload",
        default="mix",
        help=f"a preset ({', '.join(workload.PRESETS)}) or a YAML/JSON workload file (default mix)",
    )
    src.add_argument("--trace", help="a JSONL trace: t, prompt_tokens, output_tokens[, class] per line")
    p.add_argument("--slos", help="with --trace: a workload file whose classes give each class's SLO")
    p.add_argument(
        "--rate",
        type=_rates,
        default=None,
        help="requests/s to plan for (comma-separated for several; default: the trace's own rate, or 2)",
    )
    p.add_argument("--duration", type=float, default=120.0, help="simulated seconds of traffic per check (default 120)")
    p.add_argument(
        "--profile", default="llama-3.3-70b-tp8-h100", help="engine profile (engine_model/profiles or a file)"
    )
    p.add_argument(
        "--profile-end",
        choices=("low", "high"),
        default=None,
        help="the profile's uncertain settings at their low- or high-cost end",
    )
    p.add_argument("--target", type=float, default=0.9, help="share of requests that must meet the SLO (default 0.9)")
    p.add_argument("--tail", action="store_true", help="the tail SLO: also each stream's p99 ITL <= its itl_p99_s")
    p.add_argument("--max-engines", type=int, default=8, help="largest layout considered (default 8)")
    p.add_argument("--check", type=int, default=6, help="candidates simulated per rate (default 6)")
    p.add_argument("--engine-hour-cost", type=float, default=None, help="price of one engine-hour, for the report")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the JSON here (default: stdout)")
    p.add_argument("--markdown", help="also write a Markdown report here")
    p.add_argument("--plot", help="also write a PNG chart here (needs matplotlib: pip install -e '.[bench]')")
    p.add_argument("--progress", action="store_true", help="progress bar even when stderr is not a terminal")
    return p


def run(args: argparse.Namespace) -> dict[str, Any]:
    settings = profile.engine_settings(args.profile, end=args.profile_end)
    if args.trace:
        wl = workload.load_trace(args.trace, workload.load(args.slos) if args.slos else None)
    else:
        wl = workload.load(args.workload)
    rates = args.rate or [wl.mean_rate or 2.0]
    bar = Bar(args.progress or sys.stderr.isatty())
    plans = []
    slos: set[tuple[str, float, float, float]] = set()
    for rate in rates:
        jobs = wl.jobs(rate, args.duration, seed=args.seed)
        if not jobs:
            raise ValueError(f"no requests arrive within {args.duration:g} s at {rate:g} req/s")
        duration = args.duration
        if wl.trace:  # a trace may end before --duration: its requests span less time
            duration = min(duration, max(jobs[-1].arrival_s, len(jobs) / rate))
        result = planner.plan(
            settings, jobs, duration, target=args.target, tail=args.tail,
            max_engines=args.max_engines, check=args.check, progress=bar, rate=rate,
        )  # fmt: skip
        plans.append(planner.to_json(result, args.engine_hour_cost))
        slos |= {(j.klass, j.ttft_slo_s, j.itl_p90_slo_s, j.itl_p99_slo_s) for j in jobs}
    return {
        "profile": settings["profile"],
        "workload": args.trace or args.workload,
        "duration_s": args.duration,
        "seed": args.seed,
        "slos": [  # what was planned for, per class: a trace's classes too, and their defaults
            {"class": k, "ttft_s": ttft, "itl_p90_s": p90, "itl_p99_s": p99} for k, ttft, p90, p99 in sorted(slos)
        ],
        "plans": plans,
    }


def plot(doc: dict[str, Any], path: str) -> None:
    try:  # an optional dependency (the bench extra), imported only when a plot is asked for
        matplotlib = importlib.import_module("matplotlib")
        matplotlib.use("Agg")
        plt = importlib.import_module("matplotlib.pyplot")
    except ImportError as e:
        raise ValueError("--plot needs matplotlib: pip install -e '.[bench]'") from e
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for p in doc["plans"]:
        xs = [c["engines"] for c in p["checked"]]
        ys = [c["simulated_attainment"] * 100 for c in p["checked"]]
        ax.scatter(xs, ys, label=f"{p['rate']:g} req/s")
        for c, x, y in zip(p["checked"], xs, ys, strict=True):
            ax.annotate(c["layout"].split(" (")[0].replace("colocated", "colo"), (x, y), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")  # fmt: skip
        ax.axhline(p["target_attainment"] * 100, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("engines")
    ax.set_ylabel("requests within SLO, simulated (%)")
    ax.set_title(f"pdgate plan: {doc['workload']} on {doc['profile']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None, prog: str = "pdgate plan") -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if not 1 <= args.max_engines <= MAX_ENGINES:
        parser.error(f"--max-engines must be 1..{MAX_ENGINES}")
    if not 0 < args.duration <= MAX_DURATION_S:
        parser.error(f"--duration must be in (0, {MAX_DURATION_S:g}] seconds")
    if not 0 < args.target <= 1:
        parser.error("--target is a share in (0, 1]")
    if not 1 <= args.check <= 64:
        parser.error("--check must be 1..64")
    if args.slos and not args.trace:
        parser.error("--slos goes with --trace")
    try:
        doc = run(args)
        if args.plot:
            plot(doc, args.plot)
    except OSError as e:  # a trace or output file: its name and the reason, not the errno's repr
        parser.fail(f"{e.filename}: {e.strerror}" if e.filename and e.strerror else str(e))
    except ValueError as e:
        parser.fail(str(e))
    text = json.dumps(doc, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    else:
        print(text)
    if args.markdown:
        Path(args.markdown).write_text("\n".join(planner.markdown(p, doc) for p in doc["plans"]))
    for p in doc["plans"]:
        rec = p["recommended"]
        line = f"{p['rate']:g} req/s: " + (
            f"{rec['layout']} ({planner.engines(rec['engines'])}, {rec['simulated_attainment']:.1%} within SLO)"
            if rec
            else f"no layout up to {args.max_engines} engines meets the SLO"
        )
        print(line, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(prog="python -m engine_model.plan_cli"))
