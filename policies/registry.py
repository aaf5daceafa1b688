"""Policies by name: the built-in ones plus third-party ones from the ``pdgate.policies`` entry points.

Adding a policy: one module, one test, one line below. A policy class that declares ``Params`` (a
pydantic model, see ``params.py``) gets its parameters validated against it, here and by the config
loader (errors at their YAML location); a ``Policy`` subclass is built from the validated model with
its instance name, another with ``Params`` as ``factory(**validated)``, one without ``Params`` as
``factory(**params)``."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from importlib.metadata import entry_points
from typing import Any

from pydantic import BaseModel, ValidationError

from . import params as _params
from .base import Decider, Filter, Picker, Scorer
from .bounded_load import BoundedLoad
from .cost_model import CostModel
from .least_inflight import LeastInflight
from .load import Load
from .lora_affinity import LoraAffinity
from .max_score import MaxScore
from .prefix_affinity import PrefixAffinity
from .same_zone import SameZone
from .session_affinity import SessionAffinity
from .token_threshold import TokenThreshold
from .topology import TopologyAffinity

ENTRY_POINT_GROUP = "pdgate.policies"

BUILTIN: Mapping[str, Callable[..., Any]] = {
    "token_threshold": TokenThreshold,  # decider
    "bounded_load": BoundedLoad,  # filter
    "cost_model": CostModel,  # decider
    "prefix_affinity": PrefixAffinity,  # scorer
    "load": Load,  # scorer
    "lora_affinity": LoraAffinity,  # scorer (requests naming a LoRA adapter)
    "session_affinity": SessionAffinity,  # scorer
    "same_zone": SameZone,  # filter (prefill pool: pairs with the decode engine's zone)
    "topology": TopologyAffinity,  # scorer (prefill pool: the decode engine's network neighbours)
    "max_score": MaxScore,  # picker
    "least_inflight": LeastInflight,  # picker
}


# Every kind a policy can be, by the name the YAML and the messages use.
KINDS: Mapping[type, str] = {Filter: "filter", Scorer: "scorer", Picker: "picker", Decider: "decider"}


class PolicyError(ValueError):
    """Unknown policy name or parameters the policy does not accept."""


def lookup(name: str) -> Callable[..., Any]:
    """The factory (usually the class) registered as ``name``."""
    if name in BUILTIN:
        return BUILTIN[name]
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            try:
                factory: Callable[..., Any] = ep.load()  # what the entry point names is called as the factory
            except Exception as err:  # a broken plugin is a config error, not a crash of check-config
                raise PolicyError(f"policy {name!r} cannot be loaded: {err}") from None
            return factory
    known = sorted(set(BUILTIN) | {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})
    raise PolicyError(f"unknown policy {name!r} (known: {', '.join(known)})")


def params_model(factory: Callable[..., Any]) -> type[BaseModel] | None:
    """The policy's ``Params`` model, if it declares one."""
    model = getattr(factory, "Params", None)
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def validate_params(name: str, params: Mapping[str, Any], also_known: Iterable[str] = ()) -> BaseModel | None:
    """``params`` validated by policy ``name``'s ``Params`` (None: it declares none, so only building
    it can tell). Raises PolicyError for an unknown name and ValidationError, located within
    ``params``, for bad parameters; ``also_known``: other keys of the same YAML mapping, for the
    did-you-mean of an unknown parameter."""
    model = params_model(lookup(name))
    return None if model is None else _params.validate(model, name, params, also_known)


def kind_error(name: str, kind: type) -> str | None:
    """Why policy ``name`` cannot serve as a ``kind`` (None: it can, or only building it can tell)."""
    factory = lookup(name)
    try:
        if not isinstance(factory, type) or issubclass(factory, kind):
            return None
        actual = [k for proto, k in KINDS.items() if issubclass(factory, proto)]
    except TypeError:  # a protocol with data members cannot check a class
        return None
    wanted = KINDS.get(kind, kind.__name__)
    return (
        f"policy {name!r} is a {' and a '.join(actual)}, not a {wanted}"
        if actual
        else f"policy {name!r} is not a {wanted}"
    )


def build(name: str, params: Mapping[str, Any], kind: type, instance: str | None = None) -> Any:
    """Instantiate policy ``name`` with ``params`` and check it implements ``kind``. ``instance``:
    the instance's name (default ``name``), which a ``Policy`` carries as its ``name``."""
    factory = lookup(name)
    model = params_model(factory)
    try:
        if model is None:
            policy = factory(**params)
        elif isinstance(factory, type) and issubclass(factory, _params.Policy):
            policy = factory(_params.validate(model, name, params), name=instance or name)
        else:
            policy = factory(**dict(_params.validate(model, name, params)))
    except ValidationError as err:
        raise PolicyError(f"policy {name!r}: {_params.describe(err)}") from None
    except (TypeError, ValueError) as err:
        raise PolicyError(f"policy {name!r}: {err}") from None
    if not isinstance(policy, kind):
        raise PolicyError(kind_error(name, kind) or f"policy {name!r} is not a {KINDS.get(kind, kind.__name__)}")
    return policy
