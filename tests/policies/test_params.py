"""Policy parameters: every built-in policy's ``Params`` (defaults, bounds, no bools for numbers),
the same rules for YAML-built and directly constructed policies, and the ``Params`` convention for
third-party policies."""

from __future__ import annotations

import re

import pytest
from pydantic import BaseModel, Field

from policies import registry
from policies.base import Decider, Filter, Path, PathChoice, Picker, Scorer
from policies.params import Policy, PolicyParams
from policies.token_threshold import TokenThreshold, TokenThresholdParams

from .helpers import ctx, ep

KIND = {
    "token_threshold": Decider,
    "cost_model": Decider,
    "bounded_load": Filter,
    "prefix_affinity": Scorer,
    "load": Scorer,
    "lora_affinity": Scorer,
    "session_affinity": Scorer,
    "max_score": Picker,
    "least_inflight": Picker,
    "same_zone": Filter,
    "topology": Scorer,
}

# The defaults docs/configuration.md's policy table documents.
DOCUMENTED = {
    "token_threshold": {"threshold": 4096},
    "cost_model": {
        "kv_bytes_per_token": 327680,
        "kv_bandwidth_gbps": 400,
        "prefill_tokens_per_s": 10000,
        "decode_prefill_factor": 1.0,
        "pd_overhead_s": 0.005,
        "min_gain_s": 0,
        "itl_budget_s": 0.05,
        "prefill_chunk_tokens": 8192,
        "l1_gbytes_per_s": 440,
        "l2_gbytes_per_s": 10,
        "l2_latency_s": 0.005,
    },
    "bounded_load": {"load_factor": 1.25, "slack": 2},
    "prefix_affinity": {},
    "load": {"inflight_weight": 1, "waiting_weight": 1, "running_weight": 0.25, "kv_weight": 1, "scale_floor": 4},
    "lora_affinity": {"free_slot": 0.8, "full_slots": 0.4},
    "session_affinity": {"header": "x-session-id", "load_factor": 1.25, "vnodes": 64},
    "max_score": {"tie_margin": 1e-6},
    "least_inflight": {},
    "same_zone": {"key": "topology.kubernetes.io/zone", "strict": True},
    "topology": {"levels": ("topology.kubernetes.io/zone", "topology.k8s.aws/network-node-layer-3")},
}

COUNTS = {("token_threshold", "threshold"), ("session_affinity", "vnodes")}  # integers only
NUMERIC = [
    (name, key)
    for name, defaults in DOCUMENTED.items()
    for key, v in defaults.items()
    if isinstance(v, int | float) and not isinstance(v, bool)
]


def test_every_builtin_policy_is_covered():
    assert set(KIND) == set(DOCUMENTED) == set(registry.BUILTIN)


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_defaults_are_the_documented_ones_however_the_policy_is_made(name):
    factory = registry.BUILTIN[name]
    documented = DOCUMENTED[name]
    assert factory.Params().model_dump() == documented  # also: no undocumented parameter
    for policy in (registry.build(name, {}, KIND[name]), factory()):
        assert {key: getattr(policy, key) for key in documented} == documented


@pytest.mark.parametrize(("name", "key"), NUMERIC)
@pytest.mark.parametrize("value", [True, False, "1"])
def test_numbers_refuse_bools_and_strings(name, key, value):
    """YAML's true/yes/on are not numbers: ``threshold: yes`` is refused, not read as 1."""
    expected = f"{key}: Input should be a valid {'integer' if (name, key) in COUNTS else 'number'}"
    with pytest.raises(registry.PolicyError, match=f"^policy '{name}': {re.escape(expected)}$"):
        registry.build(name, {key: value}, KIND[name])
    with pytest.raises(ValueError, match=re.escape(expected)):
        registry.BUILTIN[name](**{key: value})


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("token_threshold", {"threshold": 0}, "threshold: Input should be greater than 0"),
        ("token_threshold", {"threshold": 1.5}, "threshold: Input should be a valid integer"),
        ("cost_model", {"kv_bandwidth_gbps": 0}, "kv_bandwidth_gbps: Input should be greater than 0"),
        ("cost_model", {"pd_overhead_s": -0.1}, "pd_overhead_s: Input should be greater than or equal to 0"),
        ("bounded_load", {"load_factor": 0.99}, "load_factor: Input should be greater than or equal to 1"),
        ("bounded_load", {"slack": -1}, "slack: Input should be greater than or equal to 0"),
        ("load", {"kv_weight": -1}, "kv_weight: Input should be greater than or equal to 0"),
        ("session_affinity", {"header": ""}, "header: String should have at least 1 character"),
        ("session_affinity", {"header": 5}, "header: Input should be a valid string"),
        ("session_affinity", {"vnodes": 0}, "vnodes: Input should be greater than 0"),
        ("session_affinity", {"load_factor": 0.5}, "load_factor: Input should be greater than or equal to 1"),
        ("max_score", {"tie_margin": -1e-3}, "tie_margin: Input should be greater than or equal to 0"),
    ],
)
def test_out_of_range_values_name_the_parameter(name, params, message):
    with pytest.raises(registry.PolicyError, match=f"^policy '{name}': {re.escape(message)}$"):
        registry.build(name, params, KIND[name])
    with pytest.raises(ValueError, match=re.escape(message)):
        registry.BUILTIN[name](**params)


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("token_threshold", {"treshold": 7}, "treshold: unknown parameter (did you mean 'threshold'?)"),
        ("load", {"waiting": 1}, "waiting: unknown parameter (did you mean 'waiting_weight'?)"),
        (
            "cost_model",
            {"speed": 1},
            "speed: unknown parameter of policy 'cost_model' (known: decode_prefill_factor, "
            "itl_budget_s, kv_bandwidth_gbps, kv_bytes_per_token, l1_gbytes_per_s, l2_gbytes_per_s, l2_latency_s, "
            "min_gain_s, pd_overhead_s, prefill_chunk_tokens, prefill_tokens_per_s)",
        ),
        ("prefix_affinity", {"min_blocks": 2}, "min_blocks: unknown parameter: policy 'prefix_affinity' takes none"),
        ("least_inflight", {"_turns": {}}, "_turns: unknown parameter: policy 'least_inflight' takes none"),
    ],
)
def test_unknown_parameters_suggest_the_known_ones(name, params, message):
    with pytest.raises(registry.PolicyError, match=f"^policy '{name}': {re.escape(message)}$"):
        registry.build(name, params, KIND[name])


def test_values_in_range_are_kept_as_given():
    """Integers stay integers (the accepted values are today's: any number in range)."""
    built = registry.build(
        "cost_model", {"itl_budget_s": 0, "kv_bytes_per_token": 1024, "kv_bandwidth_gbps": 100}, Decider
    )
    assert (built.itl_budget_s, built.kv_bytes_per_token, built.kv_bandwidth_gbps) == (0, 1024, 100)
    assert registry.build("bounded_load", {"load_factor": 1, "slack": 0}, Filter).load_factor == 1
    assert registry.build("session_affinity", {"header": "X-Chat"}, Scorer).header == "x-chat"


def test_a_params_model_builds_the_policy_as_it_is():
    """The one positional argument is the policy's ``Params`` (validated when it was made); values
    go by keyword."""
    policy = TokenThreshold(TokenThresholdParams(threshold=10), name="short")
    assert (policy.params.threshold, policy.threshold, policy.name) == (10, 10, "short")
    with pytest.raises(ValueError, match="threshold\n  Input should be greater than 0"):
        TokenThresholdParams(threshold=0)
    with pytest.raises(TypeError, match=r"^TokenThreshold: 10 is not a TokenThresholdParams$"):
        TokenThreshold(10)
    with pytest.raises(TypeError, match="not both"):
        TokenThreshold(TokenThresholdParams(), threshold=5)


def test_a_policy_in_the_wrong_place_says_what_it_is():
    with pytest.raises(registry.PolicyError, match=r"^policy 'token_threshold' is a decider, not a picker$"):
        registry.build("token_threshold", {}, Picker)
    assert registry.kind_error("load", Filter) == "policy 'load' is a scorer, not a filter"
    assert registry.kind_error("load", Scorer) is None


class _Margin:
    """A third-party decider that declares its parameters."""

    class Params(BaseModel):
        model_config = {"extra": "forbid"}
        margin_tokens: int = Field(100, gt=0)

    def __init__(self, margin_tokens: int = 100) -> None:
        self.margin_tokens = margin_tokens

    def decide(self, ctx, decode, prefill):
        return PathChoice(Path.PD if ctx.prompt_tokens > self.margin_tokens else Path.DIRECT, "margin")


class _Plain:
    """A third-party decider without ``Params``: built as ``factory(**params)``."""

    def __init__(self, pd: bool = False) -> None:
        if not isinstance(pd, bool):
            raise ValueError("pd must be true or false")
        self.pd = pd

    def decide(self, ctx, decode, prefill):
        return PathChoice(Path.PD if self.pd else Path.DIRECT, "plain")


@pytest.fixture
def third_party(monkeypatch):
    class EntryPoint:
        def __init__(self, name, cls):
            self.name, self.cls = name, cls

        def load(self):
            return self.cls

    eps = [EntryPoint("margin", _Margin), EntryPoint("plain", _Plain)]
    monkeypatch.setattr(registry, "entry_points", lambda group: eps if group == registry.ENTRY_POINT_GROUP else [])


def test_third_party_params_are_validated_like_the_builtins(third_party):
    assert registry.build("margin", {"margin_tokens": 5}, Decider).decide(ctx(6), ep("d"), lambda: None).path is Path.PD
    with pytest.raises(
        registry.PolicyError,
        match=re.escape("policy 'margin': margin_token: unknown parameter (did you mean 'margin_tokens'?)"),
    ):
        registry.build("margin", {"margin_token": 5}, Decider)
    with pytest.raises(
        registry.PolicyError, match=re.escape("policy 'margin': margin_tokens: Input should be greater than 0")
    ):
        registry.build("margin", {"margin_tokens": 0}, Decider)


def test_third_party_without_params_gets_a_clear_error(third_party):
    assert registry.build("plain", {"pd": True}, Decider).pd is True
    with pytest.raises(registry.PolicyError, match=r"^policy 'plain': .*unexpected keyword argument 'p'"):
        registry.build("plain", {"p": True}, Decider)
    with pytest.raises(registry.PolicyError, match=r"^policy 'plain': pd must be true or false$"):
        registry.build("plain", {"pd": 1}, Decider)


@pytest.mark.parametrize("name", sorted(registry.BUILTIN))
def test_a_builtin_policy_declares_its_params_once_and_is_named_by_default_as_registered(name):
    cls = registry.BUILTIN[name]
    assert issubclass(cls, Policy) and issubclass(cls.Params, PolicyParams)
    assert cls.type_name == name and cls().name == name
    built = registry.build(name, {}, KIND[name])
    assert built.name == name and built.params == cls.Params()
    assert registry.build(name, {}, KIND[name], instance="second").name == "second"


def test_parameters_are_read_through_params_and_by_name():
    policy = TokenThreshold(threshold=2048)
    assert policy.params == TokenThresholdParams(threshold=2048) and policy.threshold == 2048
    with pytest.raises(AttributeError, match="'TokenThreshold' object has no attribute 'treshold'"):
        _ = policy.treshold
    assert repr(policy) == "TokenThreshold(threshold=2048)"
    assert repr(TokenThreshold(name="long", threshold=5)) == "TokenThreshold(threshold=5, name='long')"
    assert policy == TokenThreshold(threshold=2048) != TokenThreshold(threshold=2048, name="other")
    assert policy != TokenThreshold() and len({policy, TokenThreshold(threshold=2048)}) == 1


class SpanParams(PolicyParams):
    min_tokens: int = Field(1, gt=0)


class Span(Policy[SpanParams]):
    """A third-party decider on the built-ins' base: its parameters once, state in ``setup``."""

    def setup(self) -> None:
        self.seen = 0

    def decide(self, ctx, decode, prefill):
        self.seen += 1
        return PathChoice(Path.PD if ctx.prompt_tokens >= self.params.min_tokens else Path.DIRECT, "span")


def test_a_third_party_policy_on_the_base_gets_its_params_and_instance_name(monkeypatch):
    class EntryPoint:
        name = "span"

        def load(self):
            return Span

    monkeypatch.setattr(registry, "entry_points", lambda group: [EntryPoint()])
    assert Span.Params is SpanParams and Span.type_name == "span"
    built = registry.build("span", {"min_tokens": 5}, Decider, instance="long_only")
    assert (built.name, built.params.min_tokens, built.seen) == ("long_only", 5, 0)
    assert built.decide(ctx(6), ep("d"), lambda: None).path is Path.PD and built.seen == 1
    with pytest.raises(registry.PolicyError, match=re.escape("min_token: unknown parameter (did you mean")):
        registry.build("span", {"min_token": 5}, Decider)
