"""The belief-error accounting: what routing believed an engine held, against what the engine said
it served from its cache, exported per pool for operators (pdgate_prefix_belief_*)."""

from __future__ import annotations

from gateway.engines.pools import Pools
from gateway.ops.metrics import BeliefAudit, GatewayMetrics
from policies.base import LegOutcome, LegReport, Path, RequestContext
from tests.promtext import sample

D, P = "http://d", "http://p"


def ctx(believed: dict[str, int], block_size: int = 16) -> RequestContext:
    return RequestContext("m", "r", list(range(1001)), cached_tokens=believed, block_size=block_size)


def leg(kind: str, url: str, cached: int | None, path: Path = Path.DIRECT) -> LegReport:
    return LegReport(kind, url, LegOutcome.OK, path, 0.1, cached_tokens=cached)  # type: ignore[arg-type]


def test_each_reported_leg_is_one_check_with_its_signed_error():
    metrics = GatewayMetrics(Pools([P], [D]))
    audit = BeliefAudit(metrics)
    audit.on_leg_done(ctx({D: 512}), leg("decode", D, 512))  # exact
    audit.on_leg_done(ctx({D: 512}), leg("decode", D, 0))  # believed 512 the engine did not have
    audit.on_leg_done(ctx({}), leg("prefill", P, 256, Path.PD))  # it had 256 the gateway did not know
    page = metrics.render().decode()

    def checks(pool: str, result: str) -> float:
        return sample(page, "pdgate_prefix_belief_checks_total", pool=pool, result=result)

    assert (checks("decode", "exact"), checks("decode", "over"), checks("decode", "under")) == (1, 1, 0)
    assert (checks("prefill", "exact"), checks("prefill", "under")) == (0, 1)
    # Wrong beliefs only, by how far off and which way.
    assert sample(page, "pdgate_prefix_belief_error_tokens_sum", pool="decode", direction="over") == 512
    assert sample(page, "pdgate_prefix_belief_error_tokens_count", pool="decode") == 1
    assert sample(page, "pdgate_prefix_belief_error_tokens_sum", pool="prefill", direction="under") == 256
    assert sample(page, "pdgate_prefix_belief_error_tokens_bucket", pool="decode", le="256.0") == 0
    assert sample(page, "pdgate_prefix_belief_error_tokens_bucket", pool="decode", le="1024.0") == 1


def test_legs_without_a_report_or_without_prefix_routing_are_not_checked():
    metrics = GatewayMetrics(Pools([P], [D]))
    audit = BeliefAudit(metrics)
    audit.on_leg_done(ctx({D: 512}), leg("decode", D, None, Path.PD))  # P/D decode legs report P's hit: None
    audit.on_leg_done(ctx({}, block_size=0), leg("decode", D, 0))  # prefix routing off: no belief to check
    page = metrics.render().decode()
    assert (
        sum(
            sample(page, "pdgate_prefix_belief_checks_total", pool=pool, result=r)
            for pool in ("prefill", "decode")
            for r in ("exact", "over", "under")
        )
        == 0
    )
