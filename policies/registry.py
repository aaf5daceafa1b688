"""Policies by name: the built-in ones plus third-party ones from the ``pdgate.policies`` entry points.

Adding a policy: one module, one test, one line below."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib.metadata import entry_points
from typing import Any

from .bounded_load import BoundedLoad
from .cost_model import CostModel
from .least_inflight import LeastInflight
from .load import Load
from .max_score import MaxScore
from .prefix_affinity import PrefixAffinity
from .session_affinity import SessionAffinity
from .token_threshold import TokenThreshold

ENTRY_POINT_GROUP = "pdgate.policies"

BUILTIN: Mapping[str, Callable[..., Any]] = {
    "token_threshold": TokenThreshold,  # decider
    "bounded_load": BoundedLoad,  # filter
    "cost_model": CostModel,  # decider
    "prefix_affinity": PrefixAffinity,  # scorer
    "load": Load,  # scorer
    "session_affinity": SessionAffinity,  # scorer
    "max_score": MaxScore,  # picker
    "least_inflight": LeastInflight,  # picker
}


class PolicyError(ValueError):
    """Unknown policy name or parameters the policy does not accept."""


def _lookup(name: str) -> Callable[..., Any]:
    if name in BUILTIN:
        return BUILTIN[name]
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            return ep.load()
    known = sorted(set(BUILTIN) | {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})
    raise PolicyError(f"unknown policy {name!r} (known: {', '.join(known)})")


def build(name: str, params: Mapping[str, Any], kind: type) -> Any:
    """Instantiate policy ``name`` with ``params`` and check it implements ``kind``."""
    factory = _lookup(name)
    try:
        policy = factory(**params)
    except (TypeError, ValueError) as err:
        raise PolicyError(f"policy {name!r}: {err}") from None
    if not isinstance(policy, kind):
        raise PolicyError(f"policy {name!r} is not a {kind.__name__}")
    return policy
