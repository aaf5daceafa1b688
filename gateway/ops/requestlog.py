"""What one request measured on its way (times, tokens, endpoints), and its JSON access line.

The record is filled in by the request's ``Exchange`` as it goes, and read once, when the request
is over, by the metrics and the access log.
"""

from __future__ import annotations

import asyncio
import queue
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Protocol

import orjson

from gateway.ops.tracing import NO_TRACE, RequestTrace

# A count is a plain integer of at most 18 digits (not followed by more digits, a fraction or an
# exponent): the relay passes the engine's bytes on unparsed, and a longer number is left unread
# rather than raising past int()'s 4300-digit limit in the splice callback.
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d{1,18})(?![\d.eE])')
_CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d{1,18})(?![\d.eE])')
# An SSE event starts after a blank line; JSON text never holds a raw newline, so a model's own
# "data: " in its text is not one. Pieces follow the engine's reads: a boundary may straddle two.
_EVENT, _DONE_EVENT = b"\n\ndata: ", b"\n\ndata: [DONE]"
_TAIL = len(_DONE_EVENT) - 1  # bytes of the last piece kept to find a straddling boundary
_EVENT_TAIL = len(_EVENT) - 1
_BLANK = b"\n\n"  # a piece ended with its event: the next starts after a blank line


class Observer(Protocol):
    """A stream's inter-token gaps (gateway/ops/histogram.py's ``Tally``)."""

    def observe(self, amount: float) -> None: ...

    def flush(self) -> None: ...


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    kind: str  # chat, completion
    started: float = field(default_factory=time.perf_counter)
    trace: RequestTrace = NO_TRACE
    model: str = "unknown"  # only configured names, once known: metric labels stay bounded
    stream: bool = False
    admitted: bool = False
    path: str = "none"  # pd, direct; none: the gateway answered itself
    reason: str = ""
    decode: str = ""  # endpoint urls, after any failover
    prefill: str = ""
    status: int = 0
    error: str = ""
    prompt_tokens: int = 0
    uncached_tokens: int = 0  # on the decode endpoint chosen
    output_tokens: int | None = None
    cached_tokens: int | None = None  # the decode engine's usage.prompt_tokens_details.cached_tokens
    queue_s: float = 0.0
    tenant: str = ""  # fairness: who the request is for, its class, its tenant's metric label
    priority: str = ""
    tenant_label: str = ""
    tokenize_s: float | None = None
    route_s: float | None = None
    # (outcome, seconds) per prefill attempt of the request as the client sent it; a migration's
    # continuation prefills again, and that leg is told in its migration's record, not here.
    prefill_legs: list[tuple[str, float]] = field(default_factory=list)
    decode_first_token_s: float | None = None
    ttft_s: float | None = None
    e2e_s: float = 0.0
    failover: list[str] = field(default_factory=list)
    migrations: list[dict[str, Any]] = field(default_factory=list)  # decode legs that failed mid-way, and after
    # Streams: the inter-token histogram of this request's model and path (set once the decode leg
    # is open), the last token chunk's time, and how many SSE events with a choice went out.
    itl: Observer | None = None
    last_token_at: float = 0.0
    token_events: int = 0
    sse_tail: bytes = _BLANK  # the stream's last bytes sent (its start counts as after a blank line)
    # A stream that broke off after its 200 went out: the status of the error event the client got
    # instead of the rest (``status`` stays what the client's HTTP response said).
    error_status: int | None = None
    adapter: str = ""  # the LoRA adapter the request named ("": a base model; ``model`` is its base)
    adapter_loads: list[dict[str, Any]] = field(default_factory=list)  # dynamic loads it waited for

    @property
    def prefill_s(self) -> float | None:
        """The prefill leg that counted (the last attempt)."""
        return self.prefill_legs[-1][1] if self.prefill_legs else None

    def since_start(self) -> float:
        return time.perf_counter() - self.started

    def sent_chunk(self, chunk: bytes) -> None:
        """A stream chunk went to the client (the relay's only per-chunk bookkeeping). Chunks with
        no token (the usage chunk, ``[DONE]``) do not count as tokens for TTFT or ITL."""
        tail = self.sse_tail
        if tail is _BLANK and chunk.startswith(b"data: "):  # the usual piece: whole events
            events = 1 + chunk.count(_EVENT)
            empty = chunk.startswith(b"data: [DONE]") + chunk.count(_DONE_EVENT)
        else:
            events = chunk.count(_EVENT) + (tail[-_EVENT_TAIL:] + chunk[:_EVENT_TAIL]).count(_EVENT)
            empty = chunk.count(_DONE_EVENT) + (tail + chunk[:_TAIL]).count(_DONE_EVENT)
        if chunk.endswith(b"\n\n"):
            self.sse_tail = _BLANK
        else:
            self.sse_tail = chunk[-_TAIL:] if len(chunk) >= _TAIL else (tail + chunk)[-_TAIL:]
        if b'"completion_tokens"' in chunk:  # the usage chunk (stream_options.include_usage)
            found = _COMPLETION_TOKENS.findall(chunk)
            if found:
                self.output_tokens = int(found[-1])
            if (cached := _CACHED_TOKENS.search(chunk)) is not None:
                self.cached_tokens = int(cached.group(1))
            empty += chunk.count(b'"choices":[]') + chunk.count(b'"choices": []')
        if events <= empty:  # (more: an event the last piece began, counted there, was [DONE])
            self.token_events = max(0, self.token_events + events - empty)
            return
        self.token_events += events - empty
        now = time.perf_counter()
        if self.ttft_s is None:
            self.ttft_s = now - self.started
        elif self.itl is not None:
            self.itl.observe(now - self.last_token_at)
        self.last_token_at = now

    def sent_body(self, body: bytes) -> None:
        """A whole (non-streamed) answer went to the client."""
        at = body.rfind(b'"completion_tokens"')
        if at >= 0 and (m := _COMPLETION_TOKENS.match(body, at)):
            self.output_tokens = int(m.group(1))
        at = body.rfind(b'"cached_tokens"')
        if at >= 0 and (m := _CACHED_TOKENS.match(body, at)):
            self.cached_tokens = int(m.group(1))

    def finish(self, status: int, error: str = "", error_status: int | None = None) -> None:
        self.status = status
        self.error = error
        self.error_status = error_status
        self.e2e_s = self.since_start()
        if self.output_tokens is None and self.token_events:
            # No usage chunk: one event per token (vLLM's default), less, for chat, the opening role
            # chunk. An estimate; the usage chunk is exact.
            self.output_tokens = max(0, self.token_events - (self.kind == "chat"))

    def access_line(self) -> bytes:
        line: dict[str, Any] = {
            "ts": round(time.time(), 3),
            "request_id": self.request_id,
            "kind": self.kind,
            "model": self.model,
            "stream": self.stream,
            "path": self.path,
            "reason": self.reason,
            "status": self.status,
            "decode": self.decode or None,
            "prefill": self.prefill or None,
            "prompt_tokens": self.prompt_tokens,
            "uncached_tokens": self.uncached_tokens,
            "output_tokens": self.output_tokens,
            "queue_ms": _ms(self.queue_s),
            "tokenize_ms": _ms(self.tokenize_s),
            "route_ms": _ms(self.route_s),
            "prefill_ms": _ms(self.prefill_s),
            "decode_first_token_ms": _ms(self.decode_first_token_s),
            "ttft_ms": _ms(self.ttft_s),
            "total_ms": _ms(self.e2e_s),
        }
        if self.tenant:
            line["tenant"], line["priority"] = self.tenant, self.priority
        if self.adapter:
            line["adapter"] = self.adapter
        if self.adapter_loads:
            line["adapter_loads"] = self.adapter_loads
        if self.failover:
            line["failover"] = self.failover
        if self.migrations:
            line["migrations"] = self.migrations
        if self.error:
            line["error"] = self.error
        if self.error_status is not None:
            line["error_status"] = self.error_status
        span = self.trace.span
        if span is not None:
            line["trace_id"] = format(span.get_span_context().trace_id, "032x")
        return orjson.dumps(line)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


class LineWriter:
    """Writes lines to ``stream`` in batches, from a thread of its own. Through the logging module a
    line cost ~50 us of event-loop time (record, caller lookup, handler lock, a write per line);
    waking a writer thread per line cost ~25 us more in GIL hand-offs. Lines called in from an
    event loop are gathered there and handed over every ``interval_s``, so the loop pays a list
    append per request and the thread one write per batch."""

    def __init__(self, stream: BinaryIO, interval_s: float = 0.05) -> None:
        self._stream = stream
        self._interval_s = interval_s
        self._batch: list[bytes] = []
        self._timer: asyncio.TimerHandle | None = None
        self._batches: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="pdgate-access-log", daemon=True)
        self._thread.start()

    def __call__(self, line: bytes) -> None:
        self._batch.append(line)
        if self._timer is None:
            try:
                self._timer = asyncio.get_running_loop().call_later(self._interval_s, self._hand_over)
            except RuntimeError:  # no event loop here: hand it over now
                self._hand_over()

    def _hand_over(self) -> None:
        self._timer = None
        if self._batch:
            self._batches.put(b"\n".join(self._batch) + b"\n")
            self._batch = []

    def _run(self) -> None:
        while (data := self._batches.get()) is not None:
            try:
                self._stream.write(data)
                self._stream.flush()
            except (OSError, ValueError):  # stdout closed: nothing better to do than drop the lines
                pass

    def close(self) -> None:
        """Writes what is gathered, then stops."""
        if self._timer is not None:
            self._timer.cancel()
        self._hand_over()
        self._batches.put(None)
        self._thread.join(5)


class AccessLog:
    """One JSON line per request, handed to ``sink`` (default: stdout, written off the event loop)."""

    def __init__(self, enabled: bool = True, sink: Callable[[bytes], None] | None = None) -> None:
        self.enabled = enabled
        self._own: LineWriter | None = None
        if enabled and sink is None:
            sink = self._own = LineWriter(sys.stdout.buffer)
        self._sink = sink

    def write(self, rec: RequestRecord) -> None:
        if self.enabled and self._sink is not None:
            self._sink(rec.access_line())

    def close(self) -> None:
        if self._own is not None:
            self._own.close()
