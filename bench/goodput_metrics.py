"""The scores of a goodput run (:mod:`bench.goodput`): latency percentiles, throughput and goodput
of one point (a configuration, workload and rate), and per configuration the highest rate swept
at which the share of requests meeting their SLO reaches ``ATTAINMENT``.

Pure arithmetic on :class:`bench.goodput_load.Result`, apart from the processes, so that it is
tested without them.
"""

from __future__ import annotations

from typing import Any

from bench.goodput_load import Result
from bench.workloads import Request

ATTAINMENT = 0.9  # "goodput at the SLO": the highest rate where this share of requests met it


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
