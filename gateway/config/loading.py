"""From a YAML file to a ``GatewayConfig``: duplicate keys refused, errors at their location with
a did-you-mean for unknown keys."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ValidationError,
)

from gateway.config.fields import Loc
from gateway.config.schema import GatewayConfig


class ConfigError(ValueError):
    """A config file that cannot be used; the message says where and why."""


def _render_loc(loc: Iterable[str | int]) -> str:
    """``routing.decode.scorers[1].weight``: list indexes as in the YAML's paths, not as keys."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out or "(top level)"


def _model_in(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """The config model a field holds (in a list, a mapping, an optional), and whether it sits
    under a mapping's keys (names the YAML chose: the next part of a location is one)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    args = get_args(annotation)
    if get_origin(annotation) is dict and len(args) == 2:
        return _model_in(args[1])[0], True
    for arg in args:
        model, keyed = _model_in(arg)
        if model is not None:
            return model, keyed
    return None, False


def _keys_at(loc: Loc) -> list[str]:
    """The keys the mapping at ``loc`` takes (none known: a policy's parameters, a free mapping)."""
    model: type[BaseModel] | None = GatewayConfig
    keyed = False
    for part in loc:
        if keyed or isinstance(part, int):  # a mapping's own key, a list's item: the same model below
            keyed = False
            continue
        field = model.model_fields.get(part) if model is not None else None
        if field is None:
            return []
        model, keyed = _model_in(field.annotation)
    return list(model.model_fields) if model is not None else []


def _unknown_key(loc: Loc) -> str:
    """An unknown key, with the known one it is closest to (``sever`` -> ``server``)."""
    known = _keys_at(loc[:-1])
    close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6) if loc else []
    if close:
        return f"unknown key (did you mean {close[0]!r}?)"
    return f"unknown key (known: {', '.join(sorted(known))})" if known else "unknown key"


def _format_errors(source: str, err: ValidationError) -> str:
    lines = [f"{source}: invalid configuration"]
    for e in err.errors():
        msg = _unknown_key(e["loc"]) if e["type"] == "extra_forbidden" else e["msg"].removeprefix("Value error, ")
        lines.append(f"  {_render_loc(e['loc'])}: {msg}")
    return "\n".join(lines)


def parse_config(data: Any, source: str = "<config>") -> GatewayConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping")
    try:
        return GatewayConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_errors(source, err)) from None


def load_config(path: str | Path, text: str | None = None) -> GatewayConfig:
    """Parse and validate ``path`` (or ``text``, its content already read)."""
    path = Path(path)
    if text is None:
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as err:
            raise ConfigError(f"{path}: cannot read ({err.strerror})") from None
    try:
        data = yaml.load(text, Loader=UniqueKeyLoader)  # a SafeLoader (below)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        kind = ":" if isinstance(err, DuplicateKeyError) else " YAML syntax error:"
        raise ConfigError(f"{path}:{where}{kind} {getattr(err, 'problem', err)}") from None
    return parse_config(data, str(path))


class DuplicateKeyError(yaml.constructor.ConstructorError):
    """A mapping with the same key twice."""


class UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping, at any depth. YAML leaves
    it to the loader and PyYAML keeps the last: a second ``auth: {}`` below the real one would
    silently switch API keys off. Merge keys (``<<: *base``) still override what they merge."""


def _unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> Iterator[dict[Any, Any]]:
    seen: dict[Any, yaml.Node] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            first = seen.setdefault(key, key_node)
        except TypeError:  # an unhashable key: the safe loader refuses it itself
            continue
        if first is not key_node:
            raise DuplicateKeyError(
                None,
                None,
                f"key {key!r} appears twice in one mapping (first at line {first.start_mark.line + 1}); "
                "YAML would keep only the last",
                key_node.start_mark,
            )
    yield from loader.construct_yaml_map(node)


UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)
