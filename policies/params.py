"""Typed policy parameters: the pydantic model each policy declares as ``Params``.

One model per policy is the single description of its YAML parameters (names, defaults, bounds), so
the config loader can check them at parse time and report each error at its YAML location, the
registry can build the policy from validated values, and direct construction in code is held to the
same rules (``check_fields`` in the dataclass's ``__post_init__``).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable, Mapping
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError, PydanticKnownError


class PolicyParams(BaseModel):
    """Base of the built-in policies' ``Params``: unknown keys are errors, values cannot change."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class NoParams(PolicyParams):
    """The ``Params`` of a policy that takes none."""


def _number(value: object) -> object:
    # YAML's true/yes and quoted numbers are not numbers; int stays int (no silent float conversion).
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PydanticKnownError("float_type")
    return value


# An int or a float, never a bool or a string; bounds go on the field (Field(gt=0), Field(ge=0), ...).
Number = Annotated[int | float, BeforeValidator(_number)]


def _error(kind: str, message: str) -> PydanticCustomError:
    # The message goes in as context, so braces in it stay literal.
    return PydanticCustomError(kind, "{msg}", {"msg": message})


def _unknown(key: str, policy: str, params: Iterable[str], also: Iterable[str]) -> PydanticCustomError:
    params = sorted(params)
    close = difflib.get_close_matches(key, [*params, *also], n=1, cutoff=0.6)
    if close:
        return _error("unknown_parameter", f"unknown parameter (did you mean {close[0]!r}?)")
    if not params:
        return _error("unknown_parameter", f"unknown parameter: policy {policy!r} takes none")
    return _error("unknown_parameter", f"unknown parameter of policy {policy!r} (known: {', '.join(params)})")


def validate(
    model: type[BaseModel], policy: str, params: Mapping[str, Any], also_known: Iterable[str] = ()
) -> BaseModel:
    """``params`` validated by ``model``. Raises ValidationError with locations relative to the
    params mapping; an unknown key says which known name it is closest to (``also_known``: names
    that may sit next to the params in the same YAML mapping, such as ``weight``)."""
    try:
        return model.model_validate(dict(params))
    except ValidationError as err:
        also = list(also_known)
        details: list[InitErrorDetails] = []
        for e in err.errors(include_url=False):
            if e["type"] == "extra_forbidden" and len(e["loc"]) == 1:
                kind = _unknown(str(e["loc"][0]), policy, model.model_fields, also)
            else:  # kept as pydantic said it
                kind = _error(e["type"], e["msg"])
            details.append(InitErrorDetails(type=kind, loc=e["loc"], input=e["input"]))
        raise ValidationError.from_exception_data(err.title, details) from None


def describe(err: ValidationError) -> str:
    """One line for an error without a YAML location around it: ``loc: message; ...``."""
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" if e["loc"] else e["msg"]
        for e in err.errors(include_url=False)
    )


def check_fields(policy: Any) -> None:
    """Validate a policy dataclass's init fields with its ``Params`` and keep the validated values,
    so ``TokenThreshold(threshold=0)`` in code fails like ``threshold: 0`` in the YAML."""
    values = {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy) if f.init}
    try:
        checked = type(policy).Params.model_validate(values)
    except ValidationError as err:
        raise ValueError(f"{type(policy).__name__}: {describe(err)}") from None
    for name, value in checked:
        object.__setattr__(policy, name, value)  # frozen dataclasses too
