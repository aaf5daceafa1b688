"""Held requests, ended by Envoy's access log entries (gRPC access log service v3).

The picker keeps no connection to the client and sees no response byte (the shipped Envoy config
keeps it off the response path), so what ``serve`` learns from relaying the answer comes back
here: Envoy streams one ``HTTPAccessLogEntry`` per request, with the request's id (``x-request-id``,
which the picker sets), the status, the engine that served it (``upstream_remote_address``) and the
time to its first byte. Each entry ends its held request (``PickExchange.served``); a request no
entry ends within ``epp.completion_timeout_s`` is released as unconfirmed (a lost entry, an Envoy
restart), and at most ``MAX_HELD`` are held, the oldest released first, so nothing a client or a
silent Envoy does grows without bound.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from google.protobuf.duration_pb2 import Duration

from gateway.epp.proto import envoy_subset_pb2 as pb

log = logging.getLogger(__name__)

MAX_HELD = 100_000

# How a request ended, as Envoy logged it: status, the engine (``ip:port``, None: none reached), the
# seconds to its first byte and in all (None: not logged).
Ending = tuple[int, str | None, float | None, float | None]


class Held(Protocol):
    held: bool

    def served(
        self, status: int, upstream: str | None, first_byte_s: float | None, duration_s: float | None
    ) -> None: ...

    def unconfirmed(self) -> None: ...


class Completions:
    """Requests routed and not yet reported on, by request id."""

    def __init__(self, timeout_s: float, max_held: int = MAX_HELD) -> None:
        self.timeout_s = timeout_s
        self.max_held = max_held
        self._held: OrderedDict[str, tuple[Held, asyncio.TimerHandle]] = OrderedDict()
        self.reported = 0  # entries that ended a held request
        self.unmatched = 0  # entries for no held request (refused ones, another picker's, late ones)
        self.unconfirmed = 0  # held requests released without an entry
        # where the endings of requests this picker does not hold go (gateway/epp/sharing.py)
        self.forward: Callable[[tuple[str, *Ending]], None] | None = None

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, request_id: str, exchange: Held) -> None:
        loop = asyncio.get_running_loop()
        previous = self._held.pop(request_id, None)
        if previous is not None:  # the same id again (a client's own X-Request-Id): the older one ends
            self._expire(previous)
        while len(self._held) >= self.max_held:
            _, oldest = self._held.popitem(last=False)
            self._expire(oldest)
        timer = loop.call_later(self.timeout_s, self._timed_out, request_id)
        self._held[request_id] = (exchange, timer)

    def _timed_out(self, request_id: str) -> None:
        entry = self._held.pop(request_id, None)
        if entry is not None:
            self._expire(entry)

    def _expire(self, entry: tuple[Held, asyncio.TimerHandle]) -> None:
        exchange, timer = entry
        timer.cancel()
        self.unconfirmed += 1
        exchange.unconfirmed()

    def report(self, entry: pb.HTTPAccessLogEntry) -> None:
        """One access log entry: the held request it names ends (or, held by another picker, it is
        passed on)."""
        request_id = entry.request.request_headers.get("x-request-id") or entry.request.request_id
        common = entry.common_properties
        upstream = None
        if common.HasField("upstream_remote_address") and common.upstream_remote_address.HasField("socket_address"):
            sock = common.upstream_remote_address.socket_address
            host = f"[{sock.address}]" if ":" in sock.address else sock.address
            upstream = f"{host}:{sock.port_value}"
        first_byte = common.time_to_first_upstream_rx_byte
        first = _seconds(first_byte) if common.HasField("time_to_first_upstream_rx_byte") else None
        duration = _seconds(common.duration) if common.HasField("duration") else None
        status = entry.response.response_code.value if entry.response.HasField("response_code") else 0
        ending: Ending = (status, upstream, first, duration)
        if not self.end(request_id, ending):
            self.unmatched += 1
            if self.forward is not None and request_id:
                self.forward((request_id, *ending))

    def end(self, request_id: str, ending: Ending) -> bool:
        """The held request ``request_id`` ended so; False when this picker holds no such request."""
        held = self._held.pop(request_id, None)
        if held is None:
            return False
        exchange, timer = held
        timer.cancel()
        self.reported += 1
        try:
            exchange.served(*ending)
        except Exception:  # one request's bookkeeping never stops the stream of entries
            log.exception("access log entry for request %s", request_id)
        return True

    def close(self) -> None:
        """Stopping: every held request released (as unconfirmed)."""
        while self._held:
            _, entry = self._held.popitem(last=False)
            self._expire(entry)


def _seconds(d: Duration) -> float:
    return d.seconds + d.nanos / 1e9
