"""What every config section is built on: strict frozen models, errors at a YAML location, and
the checks several sections share (URLs, Kubernetes labels, named files)."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    ValidationError,
)
from pydantic_core import InitErrorDetails, PydanticCustomError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _check_label(key: str, value: str | None = None) -> None:
    """A Kubernetes label key (and value), as the API server would accept it."""
    from gateway.engines.discovery import LABEL_KEY, LABEL_VALUE  # discovery imports this module

    if len(key) > 317 or not LABEL_KEY.fullmatch(key):
        raise ValueError(f"{key!r} is not a Kubernetes label key")
    if value is not None and (len(value) > 63 or not LABEL_VALUE.fullmatch(value)):
        raise ValueError(f"{value!r} (label {key}) is not a Kubernetes label value")


def check_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"endpoint {url!r} must be an http(s) URL with a host")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"endpoint {url!r} must be a base URL (no path, query or fragment)")
    return url.rstrip("/")


Loc = tuple[str | int, ...]


def _error(loc: Loc, value: Any, kind: str, message: str) -> InitErrorDetails:
    return InitErrorDetails(type=PydanticCustomError(kind, "{msg}", {"msg": message}), loc=loc, input=value)


def _raise(title: str, errors: list[InitErrorDetails]) -> None:
    """Report ``errors`` at their locations (below the model being validated), all at once."""
    if errors:
        raise ValidationError.from_exception_data(title, errors)


def read_file(path: str) -> str:
    """A file the config names, read now (``GatewayConfig.read_text`` prefers the pinned copy)."""
    return Path(path).read_text(encoding="utf-8")


def _not_blank(value: str | None) -> str | None:
    """A secret's file or variable name: unset, or a name. An empty one would read as "no keys" and
    switch authentication off without saying so."""
    if value is not None and not value.strip():
        raise ValueError(
            "is empty: name the file or variable, or remove the key (and say disabled: true to "
            "switch this off on purpose)"
        )
    return value
