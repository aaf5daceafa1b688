"""Engine profiles: YAML files of simulator settings derived from a model and a GPU node.

A profile (``sim/profiles/NAME.yaml``, or any file) has an ``engine`` section of
:class:`sim.config.SimConfig` fields plus documentation-only sections (``model``,
``hardware``, ``sources``) saying where each number comes from. ``pdgate sim --profile NAME``
starts from it; flags given on the command line override it.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml

PROFILE_DIR = Path(__file__).with_name("profiles")
_DOC_KEYS = {"name", "description", "model", "hardware", "sources"}


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
    from sim.config import SimConfig

    path = profile_path(name_or_path)
    doc = yaml.safe_load(path.read_text()) or {}
    if not isinstance(doc, dict) or not isinstance(doc.get("engine"), dict):
        raise ValueError(f"profile {path.name}: needs an 'engine' mapping")
    unknown = set(doc) - _DOC_KEYS - {"engine"}
    if unknown:
        raise ValueError(f"profile {path.name}: unknown top-level keys {sorted(unknown)}")
    known = {f.name for f in fields(SimConfig)} - {"profile", "time_scale", "faults", "kv_events_config"}
    bad = set(doc["engine"]) - known
    if bad:
        raise ValueError(f"profile {path.name}: unknown engine settings {sorted(bad)}")
    doc.setdefault("name", path.stem)
    return doc


def engine_settings(name_or_path: str) -> dict[str, Any]:
    """The profile's ``SimConfig`` keyword arguments (plus ``profile``: its name)."""
    doc = load(name_or_path)
    return {**doc["engine"], "profile": str(doc["name"])}
