"""The two context objects: a Runtime is built from a config and the process's Services, and
Services answer for what lives with the process."""

from __future__ import annotations

import pytest

from gateway.config import TokenizerConfig, parse_config
from gateway.context import Learners, Runtime, Services
from gateway.engines.legs import KVReleaser
from gateway.engines.pools import Pools
from gateway.engines.upstream import Upstream, make_client
from gateway.fairness.admission import Gate
from gateway.ops.live_planner import Demand
from gateway.ops.metrics import BeliefAudit, GatewayMetrics
from gateway.ops.requestlog import AccessLog
from gateway.ops.tracing import Tracing
from gateway.tokenization.tokenizer import Tokenizers
from policies.beliefs.estimates import EngineEstimates
from policies.beliefs.prefix_index import PrefixIndex
from policies.beliefs.prefix_learning import InFlightPrefixes, PrefixBeliefs

CFG = parse_config(
    {
        "models": [{"name": "m", "tokenizer": "/tok", "max_model_len": 4096}],
        "pools": {"prefill": {"endpoints": ["http://p0:8000"]}, "decode": {"endpoints": ["http://d0:8000"]}},
        "routing": {"decode": {"scorers": [{"name": "session_affinity", "instance": "by_user", "header": "x-u"}]}},
    }
)


def _services(*, assembled: bool) -> Services:
    pools, index = Pools(CFG.pools.prefill.urls, CFG.pools.decode.urls), PrefixIndex()
    metrics = GatewayMetrics(pools)
    engines = make_client(CFG.engines)
    learners = Learners(PrefixBeliefs(index, InFlightPrefixes()), EngineEstimates(), BeliefAudit(metrics), Demand())
    return Services(
        pools,
        metrics,
        Tracing(CFG.telemetry.tracing),
        AccessLog(CFG.telemetry.access_log, lambda line: None),
        Gate(CFG.admission.max_in_flight),
        KVReleaser(Upstream(engines, CFG.timeouts)),
        index=index,
        learners=learners if assembled else None,
        engines=engines if assembled else None,
    )


async def test_a_runtime_is_the_config_made_of_the_process_services() -> None:
    services = _services(assembled=True)
    runtime = Runtime.build(CFG, "v1", services, Tokenizers([], TokenizerConfig()), "admin-token")
    assert runtime.version == "v1" and runtime.admin_token == "admin-token"
    assert "decode.scorers.by_user" in [name for name, _ in runtime.router.pipeline.members()]  # instance names
    assert {"prefix_beliefs", "engine_estimates", "belief_audit", "demand"} <= set(runtime.hooks.names)
    assert runtime.api_keys == ()  # no keys configured: none needed
    runtime.tokenizers.close()


def test_a_runtime_needs_assembled_services() -> None:
    with pytest.raises(ValueError, match="assembled services"):
        Runtime.build(CFG, "v1", _services(assembled=False), Tokenizers([], TokenizerConfig()), None)


def test_an_engine_leaving_the_config_is_forgotten_by_every_learner() -> None:
    services = _services(assembled=True)
    hashes = [1, 2, 3]
    services.index.learn("http://d0:8000", hashes)
    services.index.learn("http://p0:8000", hashes)
    assert services.index.match(hashes) == {"http://d0:8000": 3, "http://p0:8000": 3}
    services.forget("http://d0:8000")
    assert services.index.match(hashes) == {"http://p0:8000": 3}  # the other engine's beliefs stay
