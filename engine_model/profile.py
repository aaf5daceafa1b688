"""Engine profiles: YAML files of simulator settings derived from a model and a GPU node.

A profile (``engine_model/profiles/NAME.yaml``, or any file) has an ``engine`` section of
:class:`engine_model.config.SimConfig` fields plus documentation-only sections (``model``,
``hardware``, ``sources``) saying where each number comes from. Where a number is uncertain,
``ranges`` gives its value at the low-cost and at the high-cost end of what the sources allow
(``[cheap, costly]``: for a bandwidth the larger number comes first); ``engine`` holds the
central value, and benchmarks run at both ends with ``end="low"`` / ``end="high"``.
``checks`` are measured cases the model must reproduce
(:mod:`engine_model.calibration`). ``pdgate sim --profile NAME`` starts from it; flags given on the
command line override it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

from engine_model.yamlfile import read_yaml

PROFILE_DIR = Path(__file__).with_name("profiles")
_DOC_KEYS = {"name", "description", "model", "hardware", "sources", "checks"}
ENDS = ("low", "high")
# What each kind of SimConfig field accepts from YAML (bool is an int to Python, not to a profile).
_TYPES: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "int": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "float": ("a number", lambda v: isinstance(v, int | float) and not isinstance(v, bool)),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "str": ("a string", lambda v: isinstance(v, str)),
    "str | None": ("a string", lambda v: v is None or isinstance(v, str)),
}


def available() -> list[str]:
    """Names of the bundled profiles."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def profile_path(name_or_path: str) -> Path:
    """A bundled profile's file by name, or the file itself."""
    p = PROFILE_DIR / f"{name_or_path}.yaml"
    if p.is_file():
        return p
    p = Path(name_or_path)
    if p.is_file():
        return p
    raise ValueError(f"unknown profile {name_or_path!r}: not a file, and not one of {', '.join(available())}")


def load(name_or_path: str) -> dict[str, Any]:
    """The whole profile document, validated: unknown engine keys are errors (a typo would
    otherwise silently fall back to a default)."""
    from engine_model.config import SimConfig

    path = profile_path(name_or_path)
    doc = read_yaml(path, "profile") or {}
    if not isinstance(doc, dict) or not isinstance(doc.get("engine"), dict):
        raise ValueError(f"profile {path.name}: needs an 'engine' mapping")
    unknown = set(doc) - _DOC_KEYS - {"engine", "ranges"}
    if unknown:
        raise ValueError(f"profile {path.name}: unknown top-level keys {sorted(unknown)}")
    not_engine = {"profile", "time_scale", "faults", "kv_events_config", "l2_url", "l2_key_prefix"}
    not_engine |= {"lora_modules", "allow_runtime_lora_updating"}  # what is served, not the hardware
    known = {f.name: str(f.type) for f in fields(SimConfig) if f.name not in not_engine}
    bad = set(doc["engine"]) - set(known)
    if bad:
        raise ValueError(f"profile {path.name}: unknown engine settings {sorted(bad)}")
    for key, value in doc["engine"].items():  # a wrong type would surface later as a TypeError traceback
        wanted, fits = _TYPES.get(known[key], ("", lambda v: True))
        if not fits(value):
            raise ValueError(f"profile {path.name}: engine.{key} must be {wanted}, got {value!r}")
    ranges = doc.setdefault("ranges", {}) or {}
    if not isinstance(ranges, dict):
        raise ValueError(f"profile {path.name}: ranges must be a mapping of engine settings to [low, high]")
    for key, span in ranges.items():
        if key not in doc["engine"]:
            raise ValueError(f"profile {path.name}: range for {key!r}, which the engine section does not set")
        ok = isinstance(span, list) and len(span) == 2 and all(isinstance(v, (int, float)) for v in span)
        if not ok or not min(span) <= doc["engine"][key] <= max(span):
            raise ValueError(
                f"profile {path.name}: ranges.{key} must be [low-cost value, high-cost value] around the engine's value"
            )
    doc["ranges"] = ranges
    doc.setdefault("name", path.stem)
    return doc


def engine_settings(name_or_path: str, end: str | None = None) -> dict[str, Any]:
    """The profile's ``SimConfig`` keyword arguments (plus ``profile``: its name, with
    ``@low``/``@high`` when ``end`` puts every ranged setting at its low- or high-cost end)."""
    if end is not None and end not in ENDS:
        raise ValueError(f"end must be one of {', '.join(ENDS)}, got {end!r}")
    doc = load(name_or_path)
    settings = dict(doc["engine"])
    if end is not None:
        settings.update({k: span[ENDS.index(end)] for k, span in doc["ranges"].items()})
    name = str(doc["name"]) + (f"@{end}" if end else "")
    return {**settings, "profile": name}
