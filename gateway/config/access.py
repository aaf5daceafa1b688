"""Who may call and how they are served: client API keys (and what a key's line says), tenants and
priority classes, fair queueing, the admin token."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from gateway.config.fields import _not_blank, _Strict, read_file

_NAME = r"[A-Za-z0-9._:-]{1,64}"  # tenant and priority class names: also metric label values
_KEY_ATTRS = ("tenant", "weight", "priority", "allow")


@dataclass(frozen=True, slots=True)
class KeyEntry:
    """One client API key and what its line says about its requests (all optional):
    ``<key> tenant=acme weight=2 priority=interactive allow=interactive,batch``."""

    key: str
    tenant: str | None = None
    weight: float | None = None
    priority: str | None = None  # the key's default class
    allow: tuple[str, ...] = ()  # classes its x-pdgate-priority header may ask for


def _key_entry(line: str, where: str) -> KeyEntry:
    key, *attrs = line.split()
    fields: dict[str, Any] = {}
    for attr in attrs:
        name, eq, value = attr.partition("=")
        if not eq or name not in _KEY_ATTRS or not value or name in fields:
            raise ValueError(f"{where}: a key's line may add {', '.join(n + '=' for n in _KEY_ATTRS)} once each")
        if name == "weight":
            try:
                fields[name] = float(value)
            except ValueError:
                fields[name] = -1.0
            if not 0 < fields[name] <= 1000:
                raise ValueError(f"{where}: weight must be a number in (0, 1000]")
        elif name == "allow":
            fields[name] = tuple(value.split(","))
        else:
            fields[name] = value
    for value in (fields.get("tenant"), fields.get("priority"), *fields.get("allow", ())):
        if value is not None and (not re.fullmatch(_NAME, value) or value == "other"):
            raise ValueError(f"{where}: tenant and class names are 1-64 of A-Z a-z 0-9 . _ : -, not 'other'")
    return KeyEntry(key, **fields)


class AuthConfig(_Strict):
    """Client API keys (one per line in the file, or comma-separated in the variable); none: open.
    A key's line may name its tenant, weight and priority classes (``KeyEntry``). Turning keys off
    by a reload needs ``disabled: true`` (``access_switched_off``)."""

    api_keys_file: str | None = None
    api_keys_env: str | None = None
    disabled: bool = Field(
        False,
        description="serve without API keys on purpose: needed for a reload that "
        "switches keys off, and for an auth section that names no keys",
    )

    _secret_names = field_validator("api_keys_file", "api_keys_env")(_not_blank)

    @model_validator(mode="after")
    def _one_meaning(self) -> AuthConfig:
        if self.disabled and (self.api_keys_file or self.api_keys_env):
            raise ValueError("disabled: true and API keys at once: remove one")
        return self

    @property
    def configured(self) -> bool:
        """API keys are named (their file or variable), whatever they hold."""
        return bool(self.api_keys_file or self.api_keys_env)

    def api_keys(self, read: Callable[[str], str] = read_file) -> list[str]:
        return [e.key for e in self.key_entries(read)]

    def key_entries(self, read: Callable[[str], str] = read_file) -> list[KeyEntry]:
        """The keys, ``read`` reading the keys file (``GatewayConfig.read_text``: as pinned)."""
        raw: list[str] = []
        if self.api_keys_file:
            try:
                raw += read(self.api_keys_file).splitlines()
            except OSError as err:
                raise ValueError(f"auth.api_keys_file: cannot read ({err.strerror})") from None
        if self.api_keys_env:
            value = os.environ.get(self.api_keys_env)
            if value is None:
                raise ValueError(f"auth.api_keys_env: environment variable {self.api_keys_env} is not set")
            raw += value.split(",")
        keys = [_key_entry(k.strip(), "auth") for k in raw if k.strip() and not k.strip().startswith("#")]
        if (self.api_keys_file or self.api_keys_env) and not keys:
            raise ValueError("auth: API keys are configured but none was found")
        if len({e.key for e in keys}) != len(keys):
            raise ValueError("auth: a key is listed twice")
        return keys


class PriorityClass(_Strict):
    """A class of requests: lower ``priority`` goes first (vLLM's convention, and the value sent
    to engines run with ``--scheduling-policy priority``)."""

    priority: int = Field(0, ge=-1000, le=1000)
    ttft_slo_s: float | None = Field(None, gt=0, le=3600, description="its TTFT objective (None: none)")
    sheddable: bool = Field(False, description="past its objective: 429 at once, instead of waiting")


class TenantConfig(_Strict):
    weight: float = Field(1.0, gt=0, le=1000, description="its share of each pool, relative to the others'")
    priority: str | None = Field(None, description="its default class (else fairness.default_priority)")
    allow: list[str] = Field(default_factory=list, description="classes its x-pdgate-priority header may ask for")


def _default_classes() -> dict[str, PriorityClass]:
    return {
        "interactive": PriorityClass(priority=-10),
        "standard": PriorityClass(priority=0),
        "batch": PriorityClass(priority=10, sheddable=True),
    }


class FairnessConfig(_Strict):
    """Who waits first when the gateway must queue (gateway/fairness/fairqueue.py): by priority class, then
    by each tenant's weighted use of the pool it waits for (prefill tokens sent to the prefill
    pool, decode occupancy on the decode pool), then in arrival order. Off: one FIFO queue."""

    enabled: bool = False
    classes: dict[str, PriorityClass] = Field(default_factory=_default_classes)
    default_priority: str = "standard"
    tenants: dict[str, TenantConfig] = Field(default_factory=dict, description="weights and classes by name")
    tenant_header: str | None = Field(
        "x-pdgate-tenant", description="the tenant's name when API keys are off (None: one tenant, 'default')"
    )
    priority_header: str = "x-pdgate-priority"
    ttft_header: str = Field("x-pdgate-ttft-ms", description="a request's own TTFT objective, milliseconds")
    engine_priority: bool = Field(
        False,
        description="send the class's priority to the engines (they must run "
        "--scheduling-policy priority: vLLM rejects a non-zero priority otherwise)",
    )
    wait_for_prefill: bool = Field(
        True,
        description="a P/D request waits for room in the prefill pool instead "
        "of going direct (its long prefill would stall the decode engines' streams)",
    )
    default_output_tokens: int = Field(
        256,
        ge=1,
        description="decode occupancy of a request without max_tokens "
        "while it runs (its use is settled to its output at its end)",
    )
    half_life_s: float = Field(10.0, gt=0, le=3600, description="a tenant's use fades by half in this time")
    max_queued: int = Field(
        1024,
        ge=1,
        le=100_000,
        description="requests waiting per queue (the gateway's slots; each engine pool, per model), fairness on or off",
    )
    max_queued_per_tenant: int = Field(256, ge=1, le=100_000, description="one tenant's share of that")
    max_tenants: int = Field(10_000, ge=1, le=1_000_000, description="tenants tracked; others share 'other'")
    metrics_top_tenants: int = Field(20, ge=0, le=1000, description="tenants with their own metric labels")

    @model_validator(mode="after")
    def _names(self) -> FairnessConfig:
        for name in [*self.classes, *self.tenants]:
            if not re.fullmatch(_NAME, name) or name == "other":
                raise ValueError(f"fairness: {name!r} is not a usable name (1-64 of A-Z a-z 0-9 . _ : -, not 'other')")
        if self.default_priority not in self.classes:
            raise ValueError(f"fairness.default_priority: {self.default_priority!r} is not a class")
        for name, t in self.tenants.items():
            for c in [t.priority, *t.allow]:
                if c is not None and c not in self.classes:
                    raise ValueError(f"fairness.tenants.{name}: {c!r} is not a class")
        return self


class AdminConfig(_Strict):
    """GET /admin/config and POST /debug/route: off unless a token is configured. Removing the token
    by a reload needs ``disabled: true`` (``access_switched_off``)."""

    token_env: str | None = Field(None, description="environment variable holding the admin bearer token")
    token_file: str | None = Field(None, description="file holding the admin bearer token")
    protect_metrics: bool = Field(
        False,
        description="GET /metrics needs the admin bearer token too (off: open to "
        "whoever reaches the port, as Prometheus scrapes by default)",
    )
    tenant_label_secret_env: str | None = Field(
        None,
        description="environment variable holding a secret (16+ characters) that names each unnamed API "
        "key's tenant key-<HMAC-SHA256 of the key>; unset: key-1, key-2, ... in the keys' order",
    )
    disabled: bool = Field(
        False, description="admin and debug endpoints off on purpose: needed for a reload that removes the token"
    )

    _secret_names = field_validator("token_env", "token_file")(_not_blank)

    @model_validator(mode="after")
    def _metrics_token(self) -> AdminConfig:
        if self.protect_metrics and not (self.token_env or self.token_file):
            raise ValueError("admin.protect_metrics needs admin.token_env or admin.token_file")
        return self

    @model_validator(mode="after")
    def _one_meaning(self) -> AdminConfig:
        if self.disabled and (self.token_env or self.token_file):
            raise ValueError("disabled: true and a token at once: remove one")
        return self

    def token(self, read: Callable[[str], str] = read_file) -> str | None:
        """The admin bearer token, or None: admin and debug endpoints are off."""
        if self.token_file:
            try:
                token = read(self.token_file).strip()
            except OSError as err:
                raise ValueError(f"admin.token_file: cannot read ({err.strerror})") from None
            return token or None
        if self.token_env:
            return os.environ.get(self.token_env, "").strip() or None
        return None
