"""Typed policy parameters: one pydantic model per policy, and ``Policy``, the base that holds it.

One model per policy is the single description of its YAML parameters (names, defaults, bounds), so
the config loader can check them at parse time and report each error at its YAML location, the
registry can build the policy from validated values, and direct construction in code is held to the
same rules. A built-in policy names its model once, as the type argument of its base:

    class TokenThresholdParams(PolicyParams):
        threshold: StrictInt = Field(4096, gt=0, description="...")

    class TokenThreshold(Policy[TokenThresholdParams]):
        def decide(self, ctx, decode, prefill):
            ... self.params.threshold ...          # typed

    TokenThreshold(threshold=2048)                  # validated like the YAML (ValueError)
    TokenThreshold(TokenThresholdParams(threshold=2048), name="long_prompts")
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Generic, TypeVar, cast, get_args, get_origin

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


P = TypeVar("P", bound=BaseModel)


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


class Policy(Generic[P]):
    """Base of the built-in policies: its validated parameters (``params``, a ``P``) and the name of
    this instance (``name``: what the config calls it, by default its policy name).

    ``Cls(**values)`` validates ``values`` with ``Cls.Params`` (a ValueError names the parameter);
    ``Cls(params)`` takes an instance of it as it is (``Params`` validates on construction). Typed
    code reads ``policy.params.threshold``; ``policy.threshold`` works too, untyped (tests, scripts).
    A policy with state of its own sets it up in ``setup``. Instances compare by type, name and
    parameters."""

    Params: ClassVar[type[BaseModel]] = NoParams  # set from the type argument: class X(Policy[XParams])
    type_name: ClassVar[str] = ""  # the default instance name; the class name in snake case unless set

    params: P
    name: str

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for base in getattr(cls, "__orig_bases__", ()):
            args = get_args(base)
            if get_origin(base) is Policy and args and isinstance(args[0], type) and issubclass(args[0], BaseModel):
                cls.Params = args[0]
        if "type_name" not in cls.__dict__:
            cls.type_name = _snake(cls.__name__)

    def __init__(self, params: P | None = None, /, *, name: str | None = None, **values: Any) -> None:
        cls = type(self)
        if params is None:
            try:
                params = cast(P, validate(cls.Params, cls.type_name, values))
            except ValidationError as err:
                raise ValueError(f"{cls.__name__}: {describe(err)}") from None
        elif values:
            raise TypeError(f"{cls.__name__}: give its Params or keyword values, not both")
        elif not isinstance(params, cls.Params):
            raise TypeError(f"{cls.__name__}: {params!r} is not a {cls.Params.__name__}")
        self.params = params
        self.name = name or cls.type_name
        self.setup()

    def setup(self) -> None:
        """State of the policy's own (caches, turns): set up once its parameters are known."""

    if not TYPE_CHECKING:  # typed code reads ``params`` (mypy then catches a misspelt parameter)

        def __getattr__(self, attr: str) -> Any:
            # Only reached for attributes the instance lacks: the parameters, read by name.
            if attr in ("params", "name") or attr.startswith("__"):
                raise AttributeError(attr)
            params = self.__dict__.get("params")
            if params is not None and attr in type(params).model_fields:
                return getattr(params, attr)
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {attr!r}")

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        assert isinstance(other, Policy)
        return (self.name, self.params) == (other.name, other.params)

    def __hash__(self) -> int:
        return hash((type(self), self.name, self.params))

    def __repr__(self) -> str:
        shown = [f"{k}={v!r}" for k, v in self.params]
        if self.name != type(self).type_name:
            shown.append(f"name={self.name!r}")
        return f"{type(self).__name__}({', '.join(shown)})"
