"""The one small interface every routing policy implements.

A request context (token ids, what each endpoint already caches of them, headers) and views of the
endpoints go in; a decision comes out. Policies are plain classes of four kinds, wired per pool by
``pipeline.RoutingPipeline`` as the YAML says:

- a **filter** drops candidates that must not serve the request;
- a **scorer** rates each candidate in 0..1 (the pipeline sums the scores with their weights);
- a **picker** chooses one candidate from the weighted scores;
- a **decider** chooses the path (P/D or direct) once the decode endpoint is known, and says why.

Policies see only what is handed to them (no globals, no I/O): live signals arrive as fields of
``EndpointView`` and ``RequestContext``, or as per-request data in ``RequestContext.data`` (typed
keys, ``data.py``), which a policy may also publish for others (``Publisher``), so every policy is a
pure function of its inputs.

Parameters: a built-in policy subclasses ``Policy[ItsParams]`` (``params.py``), where ``ItsParams``
is a pydantic model (``extra="forbid"``, so a typo is an error): the one place its parameters,
defaults and bounds are declared. The config loader checks a policy's YAML parameters against it at
parse time, so each error names its YAML location; the registry builds the policy from the
validated model, with its instance name. A third-party policy with a ``Params`` model that is not a
``Policy`` is built as ``factory(**validated)``, one without as ``factory(**params)``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal, Protocol, runtime_checkable

from policies.beliefs.blockhash import BlockHash
from policies.data import Key, RequestData

# Where an engine runs, as (label key, value) pairs sorted by key: the zone from its EndpointSlice
# (``topology.kubernetes.io/zone``), Node labels discovery was asked to read (an EC2 network spine),
# or what a static endpoint's config says. Policies that pair a prefill engine with a decode engine
# compare them (KV moves over EFA only inside one availability zone).
Topology = tuple[tuple[str, str], ...]
ZONE = "topology.kubernetes.io/zone"


class Path(StrEnum):
    PD = "pd"
    DIRECT = "direct"


@dataclass(frozen=True, slots=True)
class EndpointView:
    """What policies may know of one engine at decision time."""

    url: str
    pool: str  # "prefill" or "decode"
    healthy: bool
    in_flight: int  # requests the gateway has open on it
    # Engine-reported (scraped /metrics); None when unknown or too old to trust.
    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None  # 0..1
    # Uncached prompt tokens the gateway has sent there whose prefill has not visibly finished.
    backlog_tokens: int = 0
    # Prefill speed measured on its prefill legs (seconds per computed prompt token); None until seen.
    prefill_s_per_token: float | None = None
    models: frozenset[str] | None = None  # what the engine's /v1/models lists; None: not known yet
    topology: Topology = ()
    # LoRA (vllm:lora_requests_info): how many adapters one batch can run (--max-loras; None: LoRA
    # off or not known) and the adapters it has requests for now (they hold those slots).
    lora_slots: int | None = None
    lora_active: frozenset[str] = frozenset()

    def where(self, key: str) -> str | None:
        """The engine's value of topology label ``key`` (None: not known)."""
        return next((v for k, v in self.topology if k == key), None)


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    prefill: tuple[EndpointView, ...]
    decode: tuple[EndpointView, ...]


@dataclass(frozen=True, slots=True)
class HandoverEstimate:
    """Predicted seconds from a prefill leg's answer to the decode engine's first token (the KV
    pull, the decode engine's queue and first step), and where the figure comes from."""

    seconds: float
    source: str  # "pair" (measured on this prefill/decode pair), "pool" (measured across pairs), "config"
    samples: int = 0


class Measured(Protocol):
    """What the gateway has measured on real requests (fed by the lifecycle hooks, read by policies)."""

    def handover(self, prefill: str, decode: str, tokens: int, prior_s_per_token: float) -> HandoverEstimate | None:
        """The P/D hand-over time for ``tokens`` pulled from ``prefill`` to ``decode`` (None: not
        measured yet); ``prior_s_per_token`` is the slope to assume until the measurements show one."""
        ...


class _NothingMeasured:
    def handover(self, prefill: str, decode: str, tokens: int, prior_s_per_token: float) -> HandoverEstimate | None:
        return None


NOTHING_MEASURED: Measured = _NothingMeasured()

# The gateway's measurements, published for each request (``gateway/request/router.py``); read as
# ``ctx.data.get(MEASURED, NOTHING_MEASURED)``.
MEASURED = Key[Measured]("measured", "what the gateway has measured on real requests (P/D hand-over)")


@dataclass(frozen=True, slots=True)
class RequestContext:
    model: str
    request_id: str
    token_ids: Sequence[int]  # the (first) prompt's tokens, exactly as the engine will see them
    local_only: str | None = None  # why the request cannot take the P/D path, if it cannot
    headers: Mapping[str, str] = field(default_factory=dict)
    # Leading prompt tokens each endpoint (by url) is believed to hold in its prefix cache: what
    # requests confirmed or the engine's KV events say (``settled_tokens``), plus what requests
    # still in flight are bringing there.
    cached_tokens: Mapping[str, int] = field(default_factory=dict)
    settled_tokens: Mapping[str, int] = field(default_factory=dict)
    block_hashes: Sequence[BlockHash] = ()  # the prompt's full KV blocks, hashed as the engines do
    block_size: int = 0  # 0: prefix routing is off
    # While the prefill pool chooses: the decode engine already chosen, which will pull the KV from
    # the prefill engine (pairing policies compare topologies). None while the decode pool chooses.
    paired: EndpointView | None = None
    # The LoRA adapter the request names (its ``model``), None for a base model.
    adapter: str | None = None
    # Per-request data by typed key (``data.py``): what the gateway and policies publish for other
    # policies (and the lifecycle hooks) to read. One slot per request, shared by ``replace``d copies.
    data: RequestData = field(default_factory=RequestData, compare=False)

    @property
    def prompt_tokens(self) -> int:
        return len(self.token_ids)

    def cached(self, url: str) -> int:
        """Cached leading tokens on ``url`` as the engine will count them: vLLM computes the last
        prompt token whatever it holds, and takes cache hits in whole blocks, so at most the whole
        blocks within all but the last token count."""
        return self._capped(self.cached_tokens.get(url, 0))

    def settled(self, url: str) -> int:
        """Like ``cached``, without what requests still in flight are bringing."""
        return self._capped(self.settled_tokens.get(url, 0))

    def _capped(self, tokens: int) -> int:
        room = max(len(self.token_ids) - 1, 0)
        if self.block_size:
            room -= room % self.block_size
        return min(tokens, room)

    def uncached(self, url: str) -> int:
        return len(self.token_ids) - self.cached(url)


@dataclass(frozen=True, slots=True)
class PathChoice:
    path: Path
    reason: str  # a short code, few distinct values: used as a metric label
    detail: str = ""  # the same for humans, with the numbers (logs, debug header, /debug/route)
    # Predicted seconds to first token per path ("direct", "pd"), when the decider predicts (traces).
    predicted_ttft: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True, slots=True)
class Decision:
    path: Path
    decode: EndpointView
    prefill: EndpointView | None
    reason: str
    detail: str = ""
    predicted_ttft: tuple[tuple[str, float], ...] = ()


# The decider asks for the prefill endpoint only when it needs it (a short prompt never does);
# the answer is None when the P/D path is not possible for this request.
PrefillFinder = Callable[[], EndpointView | None]


@runtime_checkable
class Publisher(Protocol):
    """A policy (of any kind) that publishes per-request data before the pools choose: called once
    per request, when the gateway prepares it, in the pipeline's order (decider, then each pool's
    filters, scorers and picker). What it puts in ``ctx.data`` every policy of the request can read."""

    def publish(self, ctx: RequestContext) -> None: ...


@runtime_checkable
class Filter(Protocol):
    def filter(self, ctx: RequestContext, candidates: Sequence[EndpointView]) -> Sequence[EndpointView]:
        """The candidates that may serve. Filters are soft: one that keeps none is skipped for that
        request, unless it raises ``NoPairing`` (a pairing that must not be made at all)."""
        ...


class NoPairing(Exception):
    """A filter's verdict that no candidate may serve this request (e.g. no prefill engine in the
    decode engine's zone): the pool chooses none, and the request takes the direct path with
    ``reason`` (a short code, used as a metric label)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(detail or reason)  # the detail, with the numbers, for logs
        self.reason = reason


@runtime_checkable
class Scorer(Protocol):
    def score(self, ctx: RequestContext, candidates: Sequence[EndpointView]) -> Sequence[float]:
        """One score in 0..1 per candidate, in order; higher is better."""
        ...


@runtime_checkable
class Picker(Protocol):
    def pick(
        self, ctx: RequestContext, candidates: Sequence[EndpointView], scores: Sequence[float]
    ) -> EndpointView: ...


@runtime_checkable
class Decider(Protocol):
    def decide(self, ctx: RequestContext, decode: EndpointView, prefill: PrefillFinder) -> PathChoice: ...


# -- lifecycle hooks ------------------------------------------------------------------------------
# What happened to a routed request, for whatever learns from it (the prefix index, the measured
# hand-over and prefill speeds, a third-party policy): a policy or learner implements any of
# ``on_routed``, ``on_leg_done`` and ``on_finished`` (see ``Lifecycle``), and the gateway calls it
# once per event, on the event loop, off the request's critical path, in event order.


class LegOutcome(StrEnum):
    OK = "ok"  # the engine answered: the KV handle (prefill), the whole answer or stream (decode)
    CUT = "cut"  # the answer broke off, or the client left, after the first token: prefill was done
    REJECTED = "rejected"  # the engine refused the request (4xx) before running it
    UNREACHED = "unreached"  # the engine never got the request (connection refused)
    FAILED = "failed"  # error, timeout or broken stream before the first token
    ABANDONED = "abandoned"  # the client left (or the gateway stopped) before the first token


@dataclass(frozen=True, slots=True)
class LegReport:
    """One engine leg, once it is over."""

    leg: Literal["prefill", "decode"]
    url: str
    outcome: LegOutcome
    path: Path  # the path this leg served (a decode leg is ``pd`` when it carried a KV handle)
    seconds: float  # sent to the last byte (prefill: the KV handle; decode: the end of the answer)
    first_token_s: float | None = None  # decode streams: sent to first token (P/D: the hand-over)
    uncached_tokens: int = 0  # the gateway's belief: prompt tokens the engine had to compute
    queued_tokens: int = 0  # uncached prompt tokens the gateway had sent there before this one
    # The engine's own count of prompt tokens served from its prefix cache (vLLM: the prefill
    # handle's remote_prefill_cached_tokens, or usage.prompt_tokens_details.cached_tokens with
    # --enable-prompt-tokens-details); None when it did not say.
    cached_tokens: int | None = None
    prefill_url: str | None = None  # decode legs on the P/D path: the engine the KV came from
    status: int = 0  # the engine's HTTP status (0: no answer)

    @property
    def prefilled(self) -> bool:
        """The engine holds the prompt's KV now (it computed or received it)."""
        return self.outcome is LegOutcome.OK or self.outcome is LegOutcome.CUT


@dataclass(frozen=True, slots=True)
class Finished:
    """A request's end, as the client saw it."""

    status: int
    path: str  # the path that served it: pd, direct, or none (the gateway answered itself)
    legs: tuple[LegReport, ...]
    e2e_s: float
    ttft_s: float | None = None
    output_tokens: int | None = None
    # A migration's continuation (its context's prompt is the request's prompt plus the output kept,
    # its legs the continuation's): the request's own ``Finished`` comes separately, so counters of
    # requests skip these.
    continuation: bool = False


class Lifecycle(Protocol):
    """The hooks; implement any subset (the gateway calls only the methods present)."""

    def on_routed(self, ctx: RequestContext, decision: Decision) -> None:
        """The route is chosen and the first leg is on its way."""
        ...

    def on_leg_done(self, ctx: RequestContext, leg: LegReport) -> None:
        """One engine leg ended (every attempt: failover makes several)."""
        ...

    def on_finished(self, ctx: RequestContext, decision: Decision, result: Finished) -> None:
        """The client's answer is complete (or abandoned)."""
        ...


HOOKS = ("on_routed", "on_leg_done", "on_finished")
