"""Routing: each pool's policy pipeline (filters, scorers, picker), the decider, the prefix index,
mid-stream migration and the engine signals routing reads."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import InitErrorDetails

from gateway.config.fields import Loc, _error, _raise, _Strict
from policies import registry
from policies.base import Decider, Filter, Picker, Scorer
from policies.params import Number


class PolicySpec(BaseModel):
    """A policy by registry name plus its own parameters. Name and parameters are checked when the
    config is parsed (against the policy's ``Params``), so each error names its YAML location;
    whether the policy fits its place (filter, scorer, ...) is checked by the pipeline around it."""

    model_config = ConfigDict(extra="allow", frozen=True)
    name: str
    instance: str | None = Field(
        None,
        min_length=1,
        max_length=64,
        pattern=r"^[A-Za-z0-9_-]+$",
        description="this instance's name in traces and hook names (unset: the policy's name); "
        "two instances of one policy in a list need different ones",
    )

    @property
    def params(self) -> dict[str, Any]:
        return dict(self.model_extra or {})

    @property
    def instance_name(self) -> str:
        return self.instance or self.name

    @model_serializer(mode="wrap")
    def _without_unset_instance(self, handler: SerializerFunctionWrapHandler) -> Any:
        # Dumps (the config version, /debug/config) stay as they were for configs that name none.
        data = handler(self)
        if isinstance(data, dict) and data.get("instance", "") is None:
            del data["instance"]
        return data

    @model_validator(mode="after")
    def _known_policy_and_params(self) -> PolicySpec:
        try:
            registry.validate_params(self.name, self.params, also_known=type(self).model_fields)
        except registry.PolicyError as err:  # an unknown name
            _raise("PolicySpec", [_error(("name",), self.name, "unknown_policy", str(err))])
        return self  # a ValidationError from the params goes up as it is: its locations are the keys


class ScorerSpec(PolicySpec):
    weight: Number = Field(1.0, ge=0, description="the scorer's share of the endpoint's total score")


def _fit_errors(loc: Loc, spec: PolicySpec, kind: type) -> list[InitErrorDetails]:
    """Why ``spec``'s policy cannot serve as a ``kind`` at ``loc``. A policy without ``Params`` is
    built to find out (only that can check its parameters)."""
    if why := registry.kind_error(spec.name, kind):
        return [_error((*loc, "name"), spec.name, "policy_kind", why)]
    if registry.params_model(registry.lookup(spec.name)) is None:
        try:
            registry.build(spec.name, spec.params, kind)
        except registry.PolicyError as err:
            return [_error(loc, spec.params, "policy_params", str(err))]
    return []


def _once_each(field: str, specs: Iterable[PolicySpec], kind: type) -> list[InitErrorDetails]:
    """Fit errors of a list of policies, and each repeat of an instance name: the pipeline's trace
    (and a scorer's weight) are per name, and a repeated filter or scorer only says it louder
    (unless it is another instance, with other parameters and its own ``instance`` name)."""
    errors: list[InitErrorDetails] = []
    seen: set[str] = set()
    for i, spec in enumerate(specs):
        errors += _fit_errors((field, i), spec, kind)
        name = spec.instance_name
        if name in seen:
            if spec.instance is None:
                hint = " (give it more weight instead)" if kind is Scorer else ""
                errors.append(
                    _error(
                        (field, i, "name"),
                        spec.name,
                        "duplicate_policy",
                        f"policy {spec.name!r} is already in this list{hint}",
                    )
                )
            else:
                errors.append(
                    _error((field, i, "instance"), name, "duplicate_policy", f"{name!r} is already in this list")
                )
        seen.add(name)
    return errors


class PoolRoutingConfig(_Strict):
    """How one pool chooses an endpoint: filters, then weighted scorers, then the picker."""

    filters: list[PolicySpec] = Field(default_factory=list)
    scorers: list[ScorerSpec] = Field(default_factory=list)
    picker: PolicySpec = PolicySpec(name="max_score")

    @model_validator(mode="after")
    def _policies_fit(self) -> PoolRoutingConfig:
        _raise(
            "PoolRoutingConfig",
            [
                *_once_each("filters", self.filters, Filter),
                *_once_each("scorers", self.scorers, Scorer),
                *_fit_errors(("picker",), self.picker, Picker),
            ],
        )
        return self


def _default_scorers() -> list[ScorerSpec]:
    return [
        ScorerSpec(name="prefix_affinity", weight=2.0),
        ScorerSpec(name="load", weight=1.0),
        ScorerSpec(name="lora_affinity", weight=1.0),  # 0 everywhere for a base-model request
    ]


class PrefixConfig(_Strict):
    """The prefix index: block hashes of real token ids, as the engines compute them."""

    enabled: bool = True
    block_size: int | None = Field(
        None,
        gt=0,
        description="the engines' KV block size; unset: read from their vllm:cache_config_info "
        "(16, vLLM's default, until known)",
    )
    hash_algo: Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"] = Field(
        "sha256",
        description="the engines' --prefix-caching-hash-algo",
    )
    hash_seed: str | None = Field(
        None,
        description="the engines' PYTHONHASHSEED; needed for hashes equal to the engine's own",
    )
    max_learned_blocks: int = Field(
        200_000,
        gt=0,
        description="bound on (endpoint, block) entries learned from routing (~250 bytes each)",
    )
    learned_ttl_s: float = Field(
        600.0,
        gt=0,
        description="how long a block learned from routing counts as cached on an engine without KV events",
    )
    # KV event feeds are unauthenticated ZMQ: what one may make the gateway hold (gateway/engines/kvevents.py)
    max_event_blocks: int = Field(
        262_144,
        gt=0,
        description="bound on blocks held per engine from its KV events (~200 bytes each): past "
        "it the engine's oldest stored blocks are forgotten",
    )
    max_event_batch_blocks: int = Field(
        131_072,
        gt=0,
        description="block hashes (and events) one KV event batch may carry, all its events "
        "together: a larger batch is refused and the engine's entries are dropped",
    )
    max_event_message_bytes: int = Field(
        8 * 1024 * 1024,
        ge=64 * 1024,
        description="longest KV event message (ZMQ_MAXMSGSIZE): ZMQ drops the "
        "connection of a publisher sending a longer one, and the feed reconnects",
    )


class TierCounterCheckConfig(_Strict):
    """The engines' own hit counters (``vllm:prompt_tokens_cached_by_source``) against the tier
    beliefs: an engine that loaded from its tiers far fewer tokens than routing believed it held
    has its tiers distrusted until its counters show tier loads again (docs/kv-tiers.md)."""

    enabled: bool = Field(True, description="check the tier beliefs against the engines' counters")
    min_tokens: int = Field(
        16384, gt=0, description="below-GPU tokens believed on an engine before its counters are judged"
    )
    distrust_below: float = Field(
        0.5, ge=0, le=1, description="counted over believed, below which the engine's tiers are distrusted"
    )


class TiersConfig(_Strict):
    """KV tiers below the engines' GPU caches (LMCache or vLLM's CPU offload): each engine's CPU tier
    (L1) and a store every engine reaches (L2). With tiers on, routing counts what an engine can
    load from them as not to compute, at the costs the decider prices (docs/kv-tiers.md)."""

    enabled: bool = Field(False, description="believe and price the tiers below the GPU (off: GPU hits only)")
    l1_blocks: int | None = Field(
        None,
        ge=0,
        description="blocks each engine's CPU tier holds (LMCache max_local_cpu_size / the KV bytes of a "
        "block); unset: the engine's reported num_cpu_blocks, else nothing is learned into L1",
    )
    l2_blocks: int = Field(
        0, ge=0, description="blocks the shared store holds (0: believe only what the engines report)"
    )
    l2_learn: bool = Field(
        False,
        description="the store is written through (LMCache remote_url): a prompt an engine computed is "
        "believed in L2 too",
    )
    chunk_tokens: int = Field(
        256,
        gt=0,
        description="the tiers' unit (LMCache chunk_size): only whole chunks of a prompt are believed "
        "stored; a multiple of the engines' block size",
    )
    counter_check: TierCounterCheckConfig = TierCounterCheckConfig()


class MigrationConfig(_Strict):
    """A decode leg that fails after its first token continues on another decode engine: the
    prompt plus the tokens generated so far, routed like a new request (docs/operations.md,
    "Mid-stream migration")."""

    enabled: bool = Field(True, description="continue an answer whose decode engine failed mid-way on another one")
    max_per_request: int = Field(
        1, ge=0, le=8, description="migrations one request may use; past them the client gets the error event"
    )
    deadline_s: float = Field(
        600.0, ge=0, description="a request older than this is not migrated any more (0: no limit)"
    )
    non_streaming: bool = Field(
        True,
        description="non-streamed requests migrate too: their decode leg streams "
        "and the gateway assembles the answer (costs gateway CPU per token); false: sent "
        "as the client sent them, a failure mid-answer is retried from the start",
    )
    non_streaming_min_tokens: int = Field(
        64,
        ge=0,
        le=1 << 20,
        description="a non-streamed request that asks for at most this many output tokens "
        "(max_tokens, max_completion_tokens; completions default to 16) goes as sent: a failure "
        "mid-answer regenerates at most this many tokens from the start, cheaper than the gateway "
        "assembling every answer from its engine stream (0: every non-streamed request migrates)",
    )


class RoutingConfig(_Strict):
    decider: PolicySpec = PolicySpec(name="token_threshold")
    decode: PoolRoutingConfig = PoolRoutingConfig(filters=[PolicySpec(name="bounded_load")], scorers=_default_scorers())
    prefill: PoolRoutingConfig = PoolRoutingConfig(scorers=_default_scorers())
    prefix: PrefixConfig = PrefixConfig()
    tiers: TiersConfig = TiersConfig()
    migration: MigrationConfig = MigrationConfig()
    debug_headers: bool = Field(
        False,
        description="add x-pdgate-route (reason, numbers, chosen endpoints) to every response",
    )

    @field_validator("decider", mode="wrap")
    @classmethod
    def _a_decider_first(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> PolicySpec:
        """A policy of another kind (``name: load``) is said to be one before its parameters are
        judged: they were a decider's, and "unknown parameter of policy 'load'" sends the reader
        to the wrong fix."""
        name = value.get("name") if isinstance(value, dict) else None
        if isinstance(name, str):
            try:
                why = registry.kind_error(name, Decider)
            except registry.PolicyError:  # an unknown name: PolicySpec says so
                why = None
            if why:
                _raise("PolicySpec", [_error(("name",), name, "policy_kind", why)])
        spec: PolicySpec = handler(value)
        return spec

    @model_validator(mode="after")
    def _decider_fits(self) -> RoutingConfig:
        _raise("RoutingConfig", _fit_errors(("decider",), self.decider, Decider))
        return self


class SignalsConfig(_Strict):
    """Engine load scraped from each engine's /metrics."""

    scrape_interval_s: float = Field(1.0, gt=0)
    scrape_timeout_s: float = Field(1.0, gt=0)
    max_age_s: float = Field(5.0, gt=0, description="older scraped values are ignored by routing")
