"""Who a request is for and how urgent it is; how much of each pool every tenant is using.

A tenant is the API key's name (its line in the keys file; an unnamed key gets a name that says
nothing about it, ``key_tenants``), else, with keys off, the value of ``fairness.tenant_header``.
A request's class is its key's (or tenant's) default, or the one its ``x-pdgate-priority``
header asks for when the key may use it; its TTFT objective is the class's, or its
``x-pdgate-ttft-ms`` header's. ``Tenancy`` is built per config version; ``Usage`` outlives
reloads, since what a tenant used does not change with the config.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from gateway.config import AdminConfig, FairnessConfig, KeyEntry
from gateway.http.errors import APIError

OTHER = "other"  # tenants past fairness.max_tenants, and in metrics past the top N
_NAME = re.compile(r"[A-Za-z0-9._:-]{1,64}")
_MAX_TTFT_MS = 3_600_000
_MS = re.compile(r"[0-9]{1,7}")  # ASCII digits only (str.isdigit also takes '²', which int() refuses)
_PRUNE_EVERY_S = 1.0  # a full tenant table is swept of faded tenants at most this often
_MIN_SECRET_CHARS = 16  # admin.tenant_label_secret_env: shorter could be guessed with the key


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    weight: float
    priority: str  # its default class
    allow: frozenset[str]  # classes its header may ask for (its default included)


@dataclass(frozen=True, slots=True)
class Identity:
    """What admission needs to know about one request."""

    tenant: str
    weight: float
    cls: str
    priority: int  # lower goes first; vLLM's ``priority`` value
    ttft_slo_s: float | None
    sheddable: bool


def label_secret(cfg: AdminConfig) -> bytes | None:
    """The secret unnamed keys' tenants are named with (``admin.tenant_label_secret_env``), or None.
    Named but unset in the environment, empty or short, or an empty name: a config error (never a
    quiet fallback)."""
    name = cfg.tenant_label_secret_env
    if name is None:
        return None
    value = os.environ.get(name, "").strip()
    if len(value) < _MIN_SECRET_CHARS:
        raise ValueError(
            f"admin.tenant_label_secret_env: environment variable {name!r} must hold at least "
            f"{_MIN_SECRET_CHARS} characters ({'unset' if name not in os.environ else 'too short'})"
        )
    return value.encode()


def key_tenants(keys: Sequence[KeyEntry], secret: bytes | None = None) -> list[str]:
    """Each key's tenant: the name its line gives (``tenant=``), else one that says nothing about
    the key. The name is a metric label on an unauthenticated ``/metrics``, in the access log and in
    shared state, so a plain hash of the key would let anyone guess a weak key offline. With
    ``secret``: ``key-`` and 10 hex of HMAC-SHA256(secret, key), the same in every worker and
    replica given the same secret, whatever the keys' order. Without: ``key-<n>``, its place among
    the unnamed keys (1-based, file first, then the variable): the same in every process reading
    the same keys, but it moves when an unnamed key before it is added or removed."""
    names: list[str] = []
    unnamed = 0
    for e in keys:
        if e.tenant:
            names.append(e.tenant)
            continue
        unnamed += 1
        names.append(
            f"key-{unnamed}"
            if secret is None
            else "key-" + hmac.new(secret, e.key.encode(), hashlib.sha256).hexdigest()[:10]
        )
    return names


class Tenancy:
    """One config version's tenants and classes."""

    def __init__(self, cfg: FairnessConfig, keys: Sequence[KeyEntry] = (), label_secret: bytes | None = None) -> None:
        self.cfg = cfg
        self._weights = {name: t.weight for name, t in cfg.tenants.items()}
        names = key_tenants(keys, label_secret)
        named = {*cfg.tenants, *(e.tenant for e in keys if e.tenant)}
        for e, name in zip(keys, names, strict=True):
            # An unnamed key under a configured name would take that tenant's weight and classes.
            if not e.tenant and name in named:
                raise ValueError(
                    f"auth: an unnamed key's tenant would be {name!r}, a tenant named in the config: "
                    "name that key (tenant=) or rename the tenant"
                )
            if e.weight is not None and self._weights.setdefault(name, e.weight) != e.weight:
                raise ValueError(f"auth: tenant {name!r} is given two weights")
            for c in (e.priority, *e.allow):
                if c is not None and c not in cfg.classes:
                    raise ValueError(f"auth: {c!r} is not a class in fairness.classes")
        self._by_key = [self._tenant(name, e.priority, e.allow) for e, name in zip(keys, names, strict=True)]
        self._named = {name: self._tenant(name) for name in cfg.tenants}
        self._default = self._tenant("default")

    def _tenant(self, name: str, priority: str | None = None, allow: Sequence[str] = ()) -> Tenant:
        t = self.cfg.tenants.get(name)
        default = priority or (t.priority if t else None) or self.cfg.default_priority
        allowed = frozenset((default, *allow, *(t.allow if t else ())))
        return Tenant(name, self._weights.get(name, 1.0), default, allowed)

    @property
    def names(self) -> list[str]:
        """The tenants the config knows by name (first to get metric labels)."""
        return list(dict.fromkeys([*self.cfg.tenants, *(t.name for t in self._by_key)]))

    def identify(self, headers: Mapping[str, str], key_index: int | None, *, admin: bool = False) -> Identity:
        """Raises 400 for an unusable header, 403 for a class the key may not use. ``admin``
        (``/debug/route``): the tenant header names any tenant, and any class may be asked for."""
        cfg = self.cfg
        if key_index is not None:
            tenant = self._by_key[key_index]
        elif (cfg.tenant_header or admin) and (name := headers.get(cfg.tenant_header or "x-pdgate-tenant")) is not None:
            if not _NAME.fullmatch(name) or name == OTHER:
                raise APIError(
                    400,
                    f"The {cfg.tenant_header} header must be 1-64 of A-Z a-z 0-9 . _ : - (and not '{OTHER}').",
                    code="invalid_tenant",
                )
            tenant = self._named.get(name) or Tenant(
                name, 1.0, cfg.default_priority, frozenset((cfg.default_priority,))
            )
        else:
            tenant = self._default
        cls_name = tenant.priority
        asked = headers.get(cfg.priority_header)
        if asked is not None:
            if asked not in cfg.classes:
                raise APIError(
                    400,
                    f"The {cfg.priority_header} header names no priority class (classes: "
                    f"{', '.join(sorted(cfg.classes))}).",
                    code="invalid_priority",
                )
            if asked not in tenant.allow and not admin:
                raise APIError(
                    403,
                    f"This API key may not use the priority class `{asked}`.",
                    type_="permission_error",
                    code="priority_not_allowed",
                )
            cls_name = asked
        cls = cfg.classes[cls_name]
        slo = cls.ttft_slo_s
        given = headers.get(cfg.ttft_header)
        if given is not None:
            if not _MS.fullmatch(given) or not 0 < int(given) <= _MAX_TTFT_MS:
                raise APIError(
                    400,
                    f"The {cfg.ttft_header} header must be whole milliseconds, 1 to {_MAX_TTFT_MS}.",
                    code="invalid_ttft_objective",
                )
            slo = int(given) / 1000
        return Identity(tenant.name, tenant.weight, cls_name, cls.priority, slo, cls.sheddable)


class _Fading:
    """A sum that halves every ``half_life_s``: recent use weighs, old use fades."""

    __slots__ = ("at", "value")

    def __init__(self) -> None:
        self.value, self.at = 0.0, 0.0

    def read(self, now: float, half_life_s: float) -> float:
        return self.value * math.exp2(-(now - self.at) / half_life_s) if self.value else 0.0

    def add(self, amount: float, now: float, half_life_s: float) -> None:
        self.value, self.at = self.read(now, half_life_s) + amount, now


class Usage:
    """Per tenant and phase, what it has taken of the pools lately, the order of fair queueing:
    ``prefill`` tokens sent to the prefill pool; ``decode`` occupancy taken on the decode pool (a
    running sequence x its expected output tokens, per decode leg started, corrected to the tokens
    it produced when the request ends); both as sums fading by
    half every ``half_life_s``, so a tenant that just had the pool waits behind one that did not,
    and a burst is forgiven in a few half-lives. ``gateway``: its requests in flight (the gateway's
    own slots); ``occupancy``: the expected output of its decode legs running now (a gauge). Other
    replicas' figures come from shared state (``others``, replaced each sync; empty when Redis is
    down: local use only). At most ``max_tenants`` are tracked; the rest count as ``other``."""

    PHASES = ("prefill", "decode", "gateway", "occupancy")

    def __init__(
        self, half_life_s: float = 10.0, max_tenants: int = 10_000, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.half_life_s = half_life_s
        self.max_tenants = max_tenants
        self._clock = clock
        self._prefill: dict[str, _Fading] = {}
        self._decode_taken: dict[str, _Fading] = {}
        self._decode: dict[str, float] = {}
        self._gateway: dict[str, int] = {}
        self._names: set[str] = set()  # every tenant in the tables above
        self._next_prune = 0.0
        self.others: dict[str, dict[str, float]] = {p: {} for p in self.PHASES}

    def configure(self, half_life_s: float, max_tenants: int) -> None:
        self.half_life_s, self.max_tenants = half_life_s, max_tenants

    def key(self, tenant: str) -> str:
        """The name ``tenant`` is tracked under (bounded memory whatever names clients send): a
        full table is swept of tenants whose use has faded, at most every ``_PRUNE_EVERY_S``."""
        if tenant in self._names:
            return tenant
        if len(self._names) >= self.max_tenants and self._clock() >= self._next_prune:
            self._prune()
        if len(self._names) >= self.max_tenants:
            return OTHER
        self._names.add(tenant)
        return tenant

    def _prune(self) -> None:
        now, h = self._clock(), self.half_life_s
        self._next_prune = now + _PRUNE_EVERY_S
        for fading in (self._prefill, self._decode_taken):
            for name in [n for n, f in fading.items() if f.read(now, h) < 1.0]:
                del fading[name]
        self._names = (set(self._prefill) | set(self._decode_taken) | set(self._decode) | set(self._gateway)) - {OTHER}

    def prefill_sent(self, tenant: str, tokens: int) -> None:
        if tokens > 0:
            self._prefill.setdefault(self.key(tenant), _Fading()).add(tokens, self._clock(), self.half_life_s)

    def decode_started(self, tenant: str, tokens: float) -> str:
        """Returns the key to end it with."""
        k = self.key(tenant)
        self._decode[k] = self._decode.get(k, 0.0) + tokens
        self._decode_taken.setdefault(k, _Fading()).add(tokens, self._clock(), self.half_life_s)
        return k

    def decode_ended(self, key: str, tokens: float) -> None:
        left = self._decode.get(key, 0.0) - tokens
        if left > 0.5:
            self._decode[key] = left
        else:
            self._decode.pop(key, None)

    def now(self) -> float:
        return self._clock()

    def decode_settled(self, key: str, charged: float, produced: int, since: float) -> None:
        """A request's decode use, charged at ``since`` as its legs' expected output (``max_tokens``,
        or the default when it sent none), corrected to the tokens it produced, as if they had been
        charged evenly as they came: a client that omits ``max_tokens`` pays for a long answer, and
        one that asks for too many is not overcharged."""
        fading = self._decode_taken.get(key)
        if fading is None:
            return
        now, h = self._clock(), self.half_life_s
        rate = max(0.0, now - since) * math.log(2) / h
        left = math.exp(-rate)  # what remains now of a use taken at ``since``
        spread = produced * (-math.expm1(-rate) / rate if rate > 0 else 1.0)  # of one taken evenly since
        fading.add(max(spread - charged * left, -fading.read(now, h)), now, h)

    def request_started(self, tenant: str) -> str:
        k = self.key(tenant)
        self._gateway[k] = self._gateway.get(k, 0) + 1
        return k

    def request_ended(self, key: str) -> None:
        left = self._gateway.get(key, 0) - 1
        if left > 0:
            self._gateway[key] = left
        else:
            self._gateway.pop(key, None)

    def local(self, phase: str, tenant: str) -> float:
        if phase in ("prefill", "decode"):
            f = (self._prefill if phase == "prefill" else self._decode_taken).get(tenant)
            return f.read(self._clock(), self.half_life_s) if f is not None else 0.0
        return float((self._decode if phase == "occupancy" else self._gateway).get(tenant, 0))

    def of(self, phase: str, tenant: str) -> float:
        """This replica's and the others' use, in the phase's unit."""
        return self.local(phase, tenant) + self.others[phase].get(tenant, 0.0)

    def snapshot(self) -> dict[str, dict[str, float]]:
        """This replica's use per phase and tenant (faded-out tenants dropped): for shared state."""
        self._prune()
        now, h = self._clock(), self.half_life_s
        return {
            "prefill": {n: f.read(now, h) for n, f in self._prefill.items()},
            "decode": {n: f.read(now, h) for n, f in self._decode_taken.items()},
            "gateway": {n: float(c) for n, c in self._gateway.items()},
            "occupancy": dict(self._decode),
        }

    def tenants(self) -> set[str]:
        return (
            set(self._prefill)
            | set(self._decode_taken)
            | set(self._decode)
            | set(self._gateway)
            | {t for phase in self.others.values() for t in phase}
        )


class Labels:
    """Tenant names as metric label values: the configured tenants first, then the first others
    seen, up to ``top`` in all; every other tenant is ``other`` (bounded cardinality)."""

    def __init__(self, top: int, names: Sequence[str] = ()) -> None:
        self.top = top
        self._given: set[str] = set()
        self.configure(top, names)

    def configure(self, top: int, names: Sequence[str]) -> None:
        self.top = top
        for n in names:
            if len(self._given) < top:
                self._given.add(n)

    def __call__(self, tenant: str) -> str:
        if tenant in self._given:
            return tenant
        if len(self._given) < self.top and tenant != OTHER:
            self._given.add(tenant)
            return tenant
        return OTHER
