"""The one small interface every routing policy implements.

A request context and a snapshot of both pools go in; a decision comes out. Policies are plain
classes: a *decider* chooses the path (P/D or direct) and says why, a *picker* chooses one endpoint
among candidates. ``pipeline.RoutingPipeline`` wires them as the YAML says.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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
    in_flight: int


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

    @property
    def prompt_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True, slots=True)
class PathChoice:
    path: Path
    reason: str  # a short code, few distinct values: used as a metric label
    detail: str = ""  # the same for humans, with the numbers (logs, debug headers)


@dataclass(frozen=True, slots=True)
class Decision:
    path: Path
    decode: EndpointView
    prefill: EndpointView | None
    reason: str
    detail: str = ""


@runtime_checkable
class Decider(Protocol):
    def decide(self, ctx: RequestContext, pools: PoolSnapshot) -> PathChoice: ...


@runtime_checkable
class Picker(Protocol):
    def pick(self, ctx: RequestContext, candidates: Sequence[EndpointView]) -> EndpointView: ...
