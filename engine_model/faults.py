"""Fault injection: make one simulated engine fail on purpose, precisely and at runtime.

The gateway's failure handling (retry a failed prefill elsewhere, fall back to direct, retry a
decode leg that failed before its first byte, end a broken stream with an error event, eject
failing endpoints) is tested end to end against simulators with these faults. A test needs
"fail exactly the next decode leg", so every fault can be limited to request kinds and to the
next N matching requests; a load test needs "fail 2% of requests", so a probability with a
seed works too.

The spec, the same JSON for ``--faults`` and ``PUT /sim/faults`` (every key optional; a fault
that is absent is off)::

    {"seed": 7,
     "error":     {"status": 500, "on": "all", "count": null, "probability": 1.0},
     "hang":      {"on": ["decode"], "count": 1},
     "slow":      {"first_byte_delay": 2.0, "chunk_delay": 0.1, "on": "all"},
     "drop":      {"after_chunks": 3, "on": ["decode", "direct"]},
     "kv_refuse": {"count": 1}}

Common keys: ``on`` (``all`` or a list of ``prefill``, ``decode``, ``direct``; ``plain`` is
an alias of ``direct``), ``count`` (the next N matching requests, then the fault is spent;
null: no limit) and ``probability`` (drawn per matching request from a PRNG seeded with
``seed``; a request that is not drawn does not use up ``count``). What each fault does:

* ``error``: answer HTTP 500 (vLLM's GenerationError body) or 503 (vLLM's RetryableRequestError
  body) instead of running the request. A decode leg's prefill blocks are released, as vLLM
  does for a request rejected before its engine.
* ``hang``: read the request and never answer; when the client closes the connection the
  request is forgotten (a decode leg releases its prefill blocks). Nothing reaches the engine.
* ``slow``: ``first_byte_delay`` seconds before the response starts (status line included),
  ``chunk_delay`` seconds before every SSE event after the first (each event is then sent on
  its own). The request runs meanwhile.
* ``drop``: streaming: close the connection after ``after_chunks`` SSE events (never after
  the last one, so the client never sees ``[DONE]``); otherwise: send the headers and half the
  body, then close. The request's engine work is aborted.
* ``kv_refuse`` (on a prefill engine; ``on`` does not apply): refuse the next decode engine's
  KV read on the side channel. The decode leg then fails as vLLM 0.32 fails a NIXL transfer
  (see :mod:`engine_model.kv_transfer`); the refused blocks stay held until ``--kv-expiry``, since the
  failed read carries no notification.

At most one of error/hang applies to a request (error is drawn first); slow and drop combine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("engine_model.faults")

FAULT_NAMES = ("error", "hang", "slow", "drop", "kv_refuse")
SCOPES = ("prefill", "decode", "direct")
_KIND_OF_SCOPE = {"prefill": "prefill", "decode": "decode", "direct": "plain", "plain": "plain"}
_SCOPE_OF_KIND = {"prefill": "prefill", "decode": "decode", "plain": "direct"}
_COMMON = ("on", "count", "probability")
_PARAMS: dict[str, dict[str, Any]] = {
    "error": {"status": 500},
    "hang": {},
    "slow": {"first_byte_delay": 0.0, "chunk_delay": 0.0},
    "drop": {"after_chunks": 0},
    "kv_refuse": {},
}
ERROR_STATUSES = (500, 503)

Send = Callable[[dict[str, Any]], Awaitable[None]]


class FaultSpecError(ValueError):
    """A fault spec that cannot be used (the message says where)."""


class ConnectionDropped(Exception):
    """Raised after a partial response: the ASGI server then closes the connection."""


@dataclass
class Fault:
    """One configured fault and how much of it is left."""

    name: str
    kinds: frozenset[str]  # engine request kinds: plain, prefill, decode
    count: int | None
    probability: float
    params: dict[str, Any]
    remaining: int | None = None

    def __post_init__(self) -> None:
        self.remaining = self.count

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.params)
        if self.name != "kv_refuse":
            on = sorted(_SCOPE_OF_KIND[k] for k in self.kinds)
            out["on"] = "all" if len(on) == len(SCOPES) else on
        out.update(count=self.count, remaining=self.remaining, probability=self.probability)
        return out


def _number(where: str, v: Any, *, integer: bool = False, lo: float = 0.0, hi: float | None = None) -> Any:
    if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)):
        raise FaultSpecError(f"{where} must be {'an integer' if integer else 'a number'}, got {v!r}")
    if v < lo or (hi is not None and v > hi):
        bound = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
        raise FaultSpecError(f"{where} must be {bound}, got {v!r}")
    return v if integer else float(v)


def _kinds(name: str, on: Any) -> frozenset[str]:
    if on == "all":
        return frozenset(_SCOPE_OF_KIND)
    items = [on] if isinstance(on, str) else on
    if not isinstance(items, list) or not items or not all(isinstance(x, str) for x in items):
        raise FaultSpecError(f'{name}.on must be "all" or a non-empty list of {", ".join(SCOPES)}')
    bad = [x for x in items if x not in _KIND_OF_SCOPE]
    if bad:
        raise FaultSpecError(f"{name}.on: unknown request kind {bad[0]!r} (known: all, {', '.join(SCOPES)})")
    return frozenset(_KIND_OF_SCOPE[x] for x in items)


def parse_fault(name: str, spec: Any) -> Fault:
    if not isinstance(spec, dict):
        raise FaultSpecError(f"{name} must be an object")
    allowed = set(_PARAMS[name]) | (set(_COMMON) - ({"on"} if name == "kv_refuse" else set()))
    unknown = sorted(set(spec) - allowed)
    if unknown:
        raise FaultSpecError(f"{name}: unknown key {unknown[0]!r} (allowed: {', '.join(sorted(allowed))})")
    params = dict(_PARAMS[name])
    if name == "error":
        status = spec.get("status", 500)
        if status not in ERROR_STATUSES or isinstance(status, bool):
            raise FaultSpecError(f"error.status must be 500 or 503, got {status!r}")
        params["status"] = status
    elif name == "slow":
        for key in ("first_byte_delay", "chunk_delay"):
            params[key] = _number(f"slow.{key}", spec.get(key, 0.0))
        if not (params["first_byte_delay"] or params["chunk_delay"]):
            raise FaultSpecError("slow needs first_byte_delay or chunk_delay above 0")
    elif name == "drop":
        params["after_chunks"] = _number("drop.after_chunks", spec.get("after_chunks", 0), integer=True)
    count = spec.get("count")
    if count is not None:
        count = _number(f"{name}.count", count, integer=True, lo=1)
    probability = _number(f"{name}.probability", spec.get("probability", 1.0), hi=1.0)
    kinds = frozenset(_SCOPE_OF_KIND) if name == "kv_refuse" else _kinds(name, spec.get("on", "all"))
    return Fault(name, kinds, count, probability, params)


def parse_spec(spec: Any) -> tuple[dict[str, Fault], int | None]:
    """Validate a whole spec: ``({name: Fault}, seed)``. Raises FaultSpecError."""
    if spec is None:
        return {}, None
    if not isinstance(spec, dict):
        raise FaultSpecError("the fault spec must be a JSON object")
    unknown = sorted(set(spec) - set(FAULT_NAMES) - {"seed"})
    if unknown:
        raise FaultSpecError(f"unknown fault {unknown[0]!r} (known: {', '.join(FAULT_NAMES)}, seed)")
    seed = spec.get("seed")
    if seed is not None:
        seed = _number("seed", seed, integer=True)
    faults = {n: parse_fault(n, spec[n]) for n in FAULT_NAMES if spec.get(n) is not None}
    return faults, seed


@dataclass
class Plan:
    """What the faults do to one request (decided once, when its kind is known)."""

    error_status: int | None = None
    hang: bool = False
    first_byte_delay: float = 0.0
    chunk_delay: float = 0.0
    drop_after: int | None = None
    applied: list[str] = field(default_factory=list)

    @property
    def shapes_response(self) -> bool:
        return bool(self.first_byte_delay or self.chunk_delay or self.drop_after is not None)


class Faults:
    """The faults of one engine (owned by its SimState) and how often each was injected."""

    def __init__(self, spec: Any = None) -> None:
        self.faults: dict[str, Fault] = {}
        self.seed: int | None = None
        self.rng = random.Random()
        self.injected = dict.fromkeys(FAULT_NAMES, 0)
        self.configure(spec)

    def configure(self, spec: Any) -> None:
        """Replace the faults with ``spec`` (all or nothing); ``injected`` keeps counting."""
        faults, seed = parse_spec(spec)
        self.faults, self.seed = faults, seed
        self.rng = random.Random(seed)
        if faults:
            log.warning("faults on: %s", self.snapshot()["faults"])

    def clear(self) -> None:
        """No faults, counters back to zero."""
        self.configure(None)
        self.injected = dict.fromkeys(FAULT_NAMES, 0)

    def snapshot(self) -> dict[str, Any]:
        faults: dict[str, Any] = {"seed": self.seed}
        faults.update({n: f.describe() for n, f in self.faults.items()})
        return {"faults": faults, "injected": dict(self.injected)}

    def _fire(self, name: str, kind: str) -> bool:
        f = self.faults.get(name)
        if f is None or kind not in f.kinds or f.remaining == 0:
            return False
        if f.probability < 1.0 and self.rng.random() >= f.probability:
            return False
        if f.remaining is not None:
            f.remaining -= 1
        self.injected[name] += 1
        return True

    def plan(self, kind: str) -> Plan:
        """Draw the faults for one HTTP request of engine kind ``kind`` (plain|prefill|decode)."""
        p = Plan()
        if not self.faults:
            return p
        if self._fire("error", kind):
            p.error_status = self.faults["error"].params["status"]
            p.applied.append("error")
            return p
        if self._fire("hang", kind):
            p.hang = True
            p.applied.append("hang")
            return p
        if self._fire("slow", kind):
            p.first_byte_delay = self.faults["slow"].params["first_byte_delay"]
            p.chunk_delay = self.faults["slow"].params["chunk_delay"]
            p.applied.append("slow")
        if self._fire("drop", kind):
            p.drop_after = self.faults["drop"].params["after_chunks"]
            p.applied.append("drop")
        return p

    def refuse_kv_read(self) -> bool:
        """Whether to refuse this KV read (the prefill side of a pull)."""
        return self._fire("kv_refuse", "prefill")


class FaultySend:
    """An ASGI ``send`` for one response, delayed and cut as its :class:`Plan` says.

    ``closed`` is set when the client goes away: pending delays end at once and nothing more
    is sent, so a long ``first_byte_delay`` does not outlive its client.
    """

    def __init__(self, send: Send, plan: Plan, stream: bool, closed: asyncio.Event) -> None:
        self.send = send
        self.plan = plan
        self.stream = stream
        self.closed = closed
        self.events_sent = 0

    async def _wait(self, seconds: float) -> bool:
        """Sleep ``seconds`` unless the client leaves first; True while it is still there."""
        if seconds > 0 and not self.closed.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.closed.wait(), seconds)
        return not self.closed.is_set()

    async def __call__(self, message: dict[str, Any]) -> None:
        if self.closed.is_set():
            return
        if message["type"] == "http.response.start":
            if await self._wait(self.plan.first_byte_delay):
                await self.send(message)
            return
        if message["type"] != "http.response.body":
            await self.send(message)
            return
        if self.stream:
            await self._stream_body(message.get("body", b""), bool(message.get("more_body")))
        else:
            await self._full_body(message.get("body", b""), bool(message.get("more_body")))

    async def _full_body(self, body: bytes, more: bool) -> None:
        if self.plan.drop_after is None or more:
            await self.send({"type": "http.response.body", "body": body, "more_body": more})
            return
        await self.send({"type": "http.response.body", "body": body[: len(body) // 2], "more_body": True})
        raise ConnectionDropped(f"fault: connection closed after {len(body) // 2} of {len(body)} body bytes")

    async def _stream_body(self, body: bytes, more: bool) -> None:
        plan = self.plan
        events = [e + b"\n\n" for e in body.split(b"\n\n") if e]
        cut = plan.drop_after
        if cut is not None and not more:
            cut = min(cut, self.events_sent + len(events) - 1)  # never let the last event through
        if not plan.chunk_delay and (cut is None or self.events_sent + len(events) <= cut):
            await self.send({"type": "http.response.body", "body": body, "more_body": more})
            self.events_sent += len(events)
            return
        for i, event in enumerate(events):
            if cut is not None and self.events_sent >= cut:
                raise ConnectionDropped(f"fault: connection closed after {self.events_sent} stream events")
            if self.events_sent and not await self._wait(plan.chunk_delay):
                return
            last = i == len(events) - 1
            await self.send({"type": "http.response.body", "body": event, "more_body": more or not last})
            self.events_sent += 1
        if not events and not more:
            if cut is not None:
                raise ConnectionDropped(f"fault: connection closed after {self.events_sent} stream events")
            await self.send({"type": "http.response.body", "body": b"", "more_body": False})


class DropLogFilter(logging.Filter):
    """Keeps the ASGI server's traceback for an injected drop out of the log (one warning instead)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, ConnectionDropped):
            log.warning("%s", exc)
            return False
        return True


__all__ = [
    "FAULT_NAMES",
    "ConnectionDropped",
    "DropLogFilter",
    "FaultSpecError",
    "Faults",
    "FaultySend",
    "Plan",
    "parse_spec",
]
