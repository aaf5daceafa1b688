"""The one small interface every routing policy implements.

A request context (token ids, what each endpoint already caches of them, headers) and views of the
endpoints go in; a decision comes out. Policies are plain classes of four kinds, wired per pool by
``pipeline.RoutingPipeline`` as the YAML says:

- a **filter** drops candidates that must not serve the request;
- a **scorer** rates each candidate in 0..1 (the pipeline sums the scores with their weights);
- a **picker** chooses one candidate from the weighted scores;
- a **decider** chooses the path (P/D or direct) once the decode endpoint is known, and says why.

Policies see only what is handed to them (no globals, no I/O): live signals arrive as fields of
``EndpointView`` and ``RequestContext``, so every policy is a pure function of its inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol, runtime_checkable


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
    # Prefill speed learned from observed prefill legs (seconds per uncached token); None until seen.
    prefill_s_per_token: float | None = None


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    prefill: tuple[EndpointView, ...]
    decode: tuple[EndpointView, ...]


@dataclass(frozen=True, slots=True)
class RequestContext:
    model: str
    request_id: str
    token_ids: Sequence[int]  # the (first) prompt's tokens, exactly as the engine will see them
    local_only: str | None = None  # why the request cannot take the P/D path, if it cannot
    headers: Mapping[str, str] = field(default_factory=dict)
    # Leading prompt tokens each endpoint (by url) already holds in its prefix cache.
    cached_tokens: Mapping[str, int] = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        return len(self.token_ids)

    def cached(self, url: str) -> int:
        """Cached leading tokens on ``url``. vLLM always computes the last prompt token, so at
        most all but one count."""
        n = len(self.token_ids)
        return min(self.cached_tokens.get(url, 0), max(n - 1, 0))

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
class Filter(Protocol):
    def filter(self, ctx: RequestContext, candidates: Sequence[EndpointView]) -> Sequence[EndpointView]: ...


@runtime_checkable
class Scorer(Protocol):
    def score(self, ctx: RequestContext, candidates: Sequence[EndpointView]) -> Sequence[float]:
        """One score in 0..1 per candidate, in order; higher is better."""
        ...


@runtime_checkable
class Picker(Protocol):
    def pick(self, ctx: RequestContext, candidates: Sequence[EndpointView], scores: Sequence[float]
             ) -> EndpointView: ...


@runtime_checkable
class Decider(Protocol):
    def decide(self, ctx: RequestContext, decode: EndpointView, prefill: PrefillFinder) -> PathChoice: ...
