"""The planner against brute force: for three workloads, every layout up to ``--max-engines``
simulated (the reference), next to what ``pdgate plan`` recommends and predicts.

Checks (issue 16): the recommended split within one engine of the best split found by brute
force (prefill and decode counts each), and the analytical model's predicted goodput of the
recommended layout within 15% of its simulated goodput.

    python -m bench.planner_check [--out docs/benchmarks/planner-check.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from engine_model import planner, profile, workload

CASES = (("mix", 4.0), ("long", 2.0), ("chat", 16.0))


def check(name: str, rate: float, args: argparse.Namespace) -> dict:
    settings = profile.engine_settings(args.profile, end=args.profile_end)
    jobs = workload.load(name).jobs(rate, args.duration, seed=args.seed)
    t0 = time.monotonic()
    plan = planner.plan(settings, jobs, args.duration, tail=args.tail, max_engines=args.max_engines)
    plan_s = time.monotonic() - t0
    rec = plan.recommended
    t0 = time.monotonic()
    cands = planner.candidates(args.max_engines, (4096,))
    if rec is not None and rec[0].candidate not in cands:
        cands.append(rec[0].candidate)
    runs = planner.brute_force(settings, jobs, args.duration, cands, tail=args.tail)
    brute_s = time.monotonic() - t0
    best, best_res = runs[0]
    out: dict = {
        "workload": name,
        "rate": rate,
        "requests": len(jobs),
        "plan_wall_s": round(plan_s, 1),
        "brute_force_wall_s": round(brute_s, 1),
        "brute_force_best": {"layout": best.name, "prefill": best.layout.prefill, "decode": best.layout.decode,
                             "simulated_attainment": round(best_res.attainment(args.tail), 4)},
        "all": [{"layout": c.name, "engines": c.engines, "simulated_attainment": round(r.attainment(args.tail), 4)}
                for c, r in runs],
    }  # fmt: skip
    if rec is None:
        out["recommended"] = None
        out["ok"] = best_res.attainment(args.tail) < 0.9  # nothing meets it in either
        return out
    est, res = rec
    sim_gp = res.goodput(args.tail)
    model_gp = est.attainment * len(jobs) / args.duration
    lay = est.candidate.layout
    out["recommended"] = {
        "layout": est.candidate.name, "prefill": lay.prefill, "decode": lay.decode,
        "simulated_goodput": round(sim_gp, 3), "predicted_goodput": round(model_gp, 3),
        "goodput_error": round(model_gp / sim_gp - 1, 4) if sim_gp else None,
    }  # fmt: skip
    within_one = abs(lay.prefill - best.layout.prefill) <= 1 and abs(lay.decode - best.layout.decode) <= 1
    out["split_within_one_engine"] = within_one
    out["goodput_within_15pct"] = bool(sim_gp) and abs(model_gp / sim_gp - 1) <= 0.15
    out["ok"] = within_one and out["goodput_within_15pct"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", default="llama-3.3-70b-tp8-h100")
    p.add_argument("--profile-end", choices=("low", "high"), default=None)
    p.add_argument("--max-engines", type=int, default=4)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--standard", dest="tail", action="store_false", help="the standard SLO (default: the tail SLO)")
    p.add_argument("--out", default="docs/benchmarks/planner-check.json")
    args = p.parse_args(argv)
    results = []
    for name, rate in CASES:
        r = check(name, rate, args)
        results.append(r)
        rec = r["recommended"]
        print(f"{name} @ {rate:g} req/s: brute force {r['brute_force_best']['layout']}, plan "
              f"{rec['layout'] if rec else 'none'}"
              + (f" (goodput predicted {rec['predicted_goodput']:g} vs simulated {rec['simulated_goodput']:g})"
                 if rec else "") + f" -> {'ok' if r['ok'] else 'MISS'}", file=sys.stderr)  # fmt: skip
    doc = {"profile": args.profile, "profile_end": args.profile_end, "slo": "tail" if args.tail else "standard",
           "max_engines": args.max_engines, "duration_s": args.duration, "seed": args.seed,
           "cases": results}  # fmt: skip
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
