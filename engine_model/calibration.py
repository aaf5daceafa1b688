"""A profile's predictions next to the measurements it cites.

A profile may carry ``checks``: cases measured by someone else (prefill of an N-token prompt,
one decode step, a later chunk of a long prompt, a KV hand-over), each with the measured value
in milliseconds (a number, or ``[low, high]``) and its source. ``kv_transfer`` is the transfer
window alone; ``handover`` is prefill's end to the decode engine's first token (the fixed
hand-over latency, the pull, the recomputed last prompt token). :func:`compare` computes what the
engine model predicts for each; the test suite holds every bundled profile to its checks, and
``python -m engine_model.calibration PROFILE`` prints the table (the docs' calibration table comes from it).

    python -m engine_model.calibration llama-3.3-70b-tp8-h100 [--end low|high] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, replace
from typing import Any

from engine_model import profile
from engine_model.config import SimConfig, attention_pairs

KINDS = ("prefill", "prefill_chunk", "decode_step", "kv_transfer", "handover")
DEFAULT_TOLERANCE = 0.25


@dataclass(frozen=True)
class Check:
    """One measured case and what the model says of it."""

    case: str
    kind: str
    measured_ms: tuple[float, float]  # low, high (equal for a single figure)
    predicted_ms: float
    tolerance: float
    source: str

    @property
    def error(self) -> float:
        """Relative distance from the measured figure (0 inside a measured range)."""
        low, high = self.measured_ms
        if self.predicted_ms < low:
            return (self.predicted_ms - low) / low
        if self.predicted_ms > high:
            return (self.predicted_ms - high) / high
        return 0.0

    @property
    def ok(self) -> bool:
        return abs(self.error) <= self.tolerance


def predict_ms(cfg: SimConfig, kind: str, case: dict[str, Any]) -> float:
    """The model's figure for one case, in milliseconds of real (unscaled) time."""
    cfg = replace(cfg, time_scale=1.0)
    if kind == "prefill":
        t = cfg.prefill_time(int(case["tokens"]))
    elif kind == "prefill_chunk":
        tokens, prefix = int(case["tokens"]), int(case["prefix"])
        t = cfg.step_time(tokens, 0, 0, attention_pairs(tokens, prefix))
    elif kind == "decode_step":
        batch, context = int(case["batch"]), int(case["context"])
        t = cfg.step_time(0, batch, batch * context)
    elif kind in ("kv_transfer", "handover"):
        tokens = int(case["tokens"])
        t = replace(cfg, block_size=int(case.get("block_size", cfg.block_size))).kv_transfer_time(tokens)
        if kind == "kv_transfer":  # the transfer window alone
            t -= cfg.kv_transfer_latency
        else:  # prefill's end to decode's first token: the fixed part, the pull, the recomputed last token
            t += cfg.step_time(1, 0, 0, attention_pairs(1, tokens - 1))
    else:
        raise ValueError(f"unknown check kind {kind!r}: one of {', '.join(KINDS)}")
    return t * 1000


def _measured(value: Any, where: str) -> tuple[float, float]:
    if isinstance(value, (int, float)) and value > 0:
        return float(value), float(value)
    if isinstance(value, list) and len(value) == 2 and all(isinstance(v, (int, float)) for v in value):
        low, high = sorted(float(v) for v in value)
        if low > 0:
            return low, high
    raise ValueError(f"{where}: measured_ms must be a positive number or [low, high]")


def compare(name_or_path: str, end: str | None = None) -> list[Check]:
    """Every check of the profile, predicted with its settings (``end``: its ranges' low or high end)."""
    doc = profile.load(name_or_path)
    cfg = SimConfig(**profile.engine_settings(name_or_path, end=end))
    out = []
    for i, item in enumerate(doc.get("checks") or []):
        where = f"profile {doc['name']}: checks[{i}]"
        if not isinstance(item, dict) or not item.get("source") or item.get("kind") not in KINDS:
            raise ValueError(f"{where}: needs a kind ({', '.join(KINDS)}), a case and a source")
        case = dict(item.get("case") or {})
        out.append(
            Check(
                case=str(item.get("name") or case),
                kind=item["kind"],
                measured_ms=_measured(item.get("measured_ms"), where),
                predicted_ms=predict_ms(cfg, item["kind"], case),
                tolerance=float(item.get("tolerance", DEFAULT_TOLERANCE)),
                source=str(item["source"]),
            )
        )
    return out


def markdown(checks: list[Check]) -> str:
    rows = ["| case | measured ms | model ms | error | source |", "|---|---|---|---|---|"]
    for c in checks:
        low, high = c.measured_ms
        measured = f"{low:,.1f}" if low == high else f"{low:,.1f}-{high:,.1f}"
        rows.append(f"| {c.case} | {measured} | {c.predicted_ms:,.1f} | {c.error:+.0%} | {c.source} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", help="a bundled profile name or a YAML file")
    parser.add_argument("--end", choices=("low", "high"), default=None, help="the profile's ranges at this end")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    checks = compare(args.profile, args.end)
    if args.json:
        print(json.dumps([asdict(c) | {"error": c.error, "ok": c.ok} for c in checks], indent=1))
    else:
        print(markdown(checks))
    return 0 if all(c.ok for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
