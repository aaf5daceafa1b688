"""The decode engine's answer, relayed to the client as it comes, and what the client was told.

``AnswerRelay`` takes over once a decode leg has its first token (or whole answer): it writes the
response on the client's wire (gateway/request/relay.py's ``ClientWire``), the gateway's headers
first, then the engine's body. A migratable request's engine events are read and stitched
(gateway/request/stitch.py): the client gets what the engine would have sent, as an SSE stream or
assembled into one JSON answer, and a decode leg that breaks off mid-answer is handed to the
``Migrator`` (gateway/request/migrator.py), whose continuation is relayed on as if nothing
happened. Every other answer goes byte for byte, and one that breaks off ends with an error event
and ``[DONE]``, as vLLM ends a stream that fails. Either way, after a stream's first chunk the rest
is spliced where the server allows it (gateway/http/splice.py): written onto the client's
connection from the engine connection's callback (a migratable one's events read and rewritten
there, the sink stopping at the first that breaks), without waking the request per chunk.
The relay counts what went out in the record (chunks, output tokens),
ends each decode leg through ``EngineLegs`` (its connection closed or kept, its slot given back,
the hooks told), and keeps the request's ``Outcome``: the status the client got, and whether it has
the whole answer, so that a client hanging up after ``[DONE]`` is not recorded as one that left. A
client that leaves mid-answer cancels the exchange (``ClientWire.watch``): the engine leg is cut
and its connection dropped, which makes vLLM abort the request.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

from gateway.engines.transport import ClientError
from gateway.engines.upstream import EngineError, transport_error
from gateway.http.errors import APIError
from gateway.http.splice import BodyWriter
from gateway.ops.requestlog import RequestRecord
from gateway.request.engine_legs import EngineLegs, OpenDecode
from gateway.request.migrator import Cut, Migrator
from gateway.request.protocol import ParsedRequest
from gateway.request.relay import DONE, ClientWire, Headers
from gateway.request.stitch import Answer, Broken, Diverged
from policies.base import LegOutcome, Path

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Outcome:
    """What the client was told, as the record keeps it: the status, an error, a stream's error
    event after its 200 went out (``error_status``), and whether the client has the whole answer
    (an SSE stream through ``[DONE]``)."""

    status: int = 0
    error: str = ""
    error_status: int | None = None
    answered: bool = False

    def set(self, status: int, error: str = "") -> None:
        self.status, self.error = status, error

    def broke_off(self, err: APIError) -> None:
        """A stream failed after its 200 went out: the client got that status and an error event;
        the record keeps both (an access log that said 502 would not be what the client saw)."""
        self.error, self.error_status = err.message, err.status


class ResponseHeaders(Protocol):
    """The gateway's response headers (``Exchange._headers``)."""

    def __call__(self, *, path: Path | None = None, failed: bool = False) -> Headers: ...


class AnswerRelay:
    """Sends one request's answer on; the exchange builds it once the first decode leg is open."""

    def __init__(
        self,
        rec: RequestRecord,
        outcome: Outcome,
        legs: EngineLegs,
        migrator: Migrator,
        headers: ResponseHeaders,
        *,
        splice: bool = True,
    ) -> None:
        self.rec = rec
        self.outcome = outcome
        self.legs = legs
        self.migrator = migrator
        self.headers = headers
        self.splice = splice  # engines.splice: a stream's chunks skip the event loop
        self._body_open = False  # a body chunk went out through uvicorn (it opens the chunked body)

    async def send(self, client: ClientWire, req: ParsedRequest, leg: OpenDecode) -> None:
        """Send the decode engine's answer on as it comes. The engine has the prompt's KV from here
        on (it answered), so a stream that breaks off, or a client that leaves, is a ``cut`` leg."""
        resp = leg.stream.resp
        self.rec.path = leg.path.value
        headers = self.headers(path=leg.path)
        content_type = resp.header(b"content-type") or b"application/json"
        answer = self.migrator.answer
        if answer is not None and _is_stream(content_type):
            # a stream for a streaming client; assembled into JSON for one that did not ask to stream
            headers.append((b"content-type", content_type if req.stream else b"application/json"))
            await self._stitched(client, req, leg, headers, answer)
            return
        headers.append((b"content-type", content_type))
        clean = False
        try:
            if req.stream:
                clean = await self._stream(client, leg, headers)
            else:
                clean = await self._whole(client, req, leg, headers)
        finally:
            # the leg went well once the client has the whole answer, whatever happens to the connection now
            outcome = LegOutcome.OK if clean or self.outcome.answered else LegOutcome.CUT
            self.legs.end(leg, outcome, clean, resp.status, self.rec.cached_tokens)

    # -- byte for byte ----------------------------------------------------------------------------------

    async def _whole(self, client: ClientWire, req: ParsedRequest, leg: OpenDecode, headers: Headers) -> bool:
        """A whole answer, sent in one go (true once sent)."""
        resp = leg.stream.resp
        # (a migratable request's engine that answered a whole body although asked to stream)
        body = leg.stream.head if leg.part.stream == req.stream else leg.stream.head + await resp.read()
        self.outcome.set(resp.status)
        await client.whole(resp.status, headers, body)
        self.outcome.answered = True
        self.rec.sent_body(body)
        return True

    async def _stream(self, client: ClientWire, leg: OpenDecode, headers: Headers) -> bool:
        """A stream, chunk by chunk (true when the engine ended it and so did the gateway)."""
        rec, resp, outcome = self.rec, leg.stream.resp, self.outcome
        outcome.set(resp.status)
        await client.start(resp.status, headers)
        chunk, send, read = leg.stream.head, client.asgi_send, resp.read_some
        try:
            if chunk:  # what came with the first token (through uvicorn: it opens the body)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                rec.sent_chunk(chunk)
                if chunk.endswith(DONE):
                    outcome.answered = True
                writer = client.body_writer() if self.splice else None
                if writer is not None:
                    # the rest from the engine connection's callback straight onto the client's
                    await resp.splice(_Relayed(writer, rec, outcome))
                    chunk = b""
                else:
                    chunk = await read()
            while chunk:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                rec.sent_chunk(chunk)
                if chunk.endswith(DONE):
                    outcome.answered = True
                chunk = await read()
        except (TimeoutError, ClientError) as err:
            if outcome.answered:  # the engine broke off after [DONE]: the answer is whole
                await client.end()
                return False
            # Headers are gone already: an error event and [DONE], as vLLM ends a failed stream.
            cut = transport_error(err, "decode")
            self.migrator.not_migratable(Cut(_reason(err), cut))
            outcome.broke_off(cut)
            await client.error(cut, [])
            return False
        await client.end()
        return True

    # -- a migratable answer ----------------------------------------------------------------------------

    async def _stitched(
        self,
        client: ClientWire,
        req: ParsedRequest,
        leg: OpenDecode,
        headers: Headers,
        answer: Answer,
    ) -> None:
        """A migratable answer: each engine event read, the client's written; a decode leg that
        fails mid-way is continued on another engine, as often as the config allows."""
        if req.stream:
            self.outcome.set(200)
            try:
                await client.start(200, headers)
            except BaseException:  # the client left: the leg ends here (its slot, its tenant's use)
                self.legs.end(leg, LegOutcome.CUT, False, leg.stream.resp.status, None)
                raise
        while True:
            cut = await self._part(client, leg, answer)
            if cut is None:
                break
            if answer.finish is not None:  # all there but its end: the usage chunk, [DONE]
                log.info(
                    "request %s: the decode engine's stream broke after its finish reason (%s); the gateway ends it",
                    self.rec.request_id,
                    cut.reason,
                )
                if req.stream:
                    await client.send(answer.close())
                break
            opened = await self.migrator.migrate(leg, cut, answer)
            if opened is None:
                self.rec.output_tokens = answer.output_tokens  # what the client got before the error
                if req.stream:
                    self.outcome.broke_off(cut.err)
                else:
                    self.outcome.set(cut.err.status, cut.err.message)
                await client.error(cut.err, [] if req.stream else self.headers(failed=True))
                return
            leg = opened
        self.migrator.settle("ok")
        self.rec.output_tokens = answer.output_tokens
        if req.stream:
            await client.end()
        else:
            body = answer.whole()
            self.outcome.set(200)
            await client.whole(200, headers, body)
            self.rec.sent_body(body)
        self.outcome.answered = True

    async def _part(self, client: ClientWire, leg: OpenDecode, answer: Answer) -> Cut | None:
        """One part of a migratable answer, until it is whole (None) or breaks off (the cut)."""
        rec, resp = self.rec, leg.stream.resp
        ended, clean, cut = LegOutcome.CUT, False, None
        chunk, send, read = leg.stream.head, client.asgi_send, resp.read_some
        spliced = False
        try:
            while chunk:
                out = answer.feed(chunk)
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
                    rec.sent_chunk(out)
                    self._body_open = True
                answer.check()
                if answer.done:  # whatever happens to the connection now
                    ended = LegOutcome.OK
                    self.outcome.answered = answer.stream  # [DONE] is out: a hang-up now changes nothing
                splice = self.splice and self._body_open and not spliced and not answer.done
                writer = client.body_writer() if splice else None
                if writer is not None:
                    # the rest read and rewritten in the engine connection's callback, written
                    # straight onto the client's; it stops at the first failure
                    sink = _Stitched(writer, answer, rec, self.outcome)
                    await resp.splice(sink)
                    spliced = True
                    answer.check()
                    if answer.done:
                        ended = LegOutcome.OK
                    chunk = b""
                else:
                    chunk = await read()
            answer.ended()
            ended, clean = LegOutcome.OK, True
        except (TimeoutError, ClientError) as err:
            if answer.done:  # the engine broke off after [DONE]: the answer is whole
                ended = LegOutcome.OK
            else:
                cut = Cut(_reason(err), transport_error(err, "decode"))
        except Broken as err:
            cut = Cut(err.cause, EngineError(502, f"The decode engine failed: {err}.", code="engine_error"))
        except Diverged as err:
            log.warning("request %s: %s", self.rec.request_id, err)
            cut = Cut("diverged", EngineError(502, "The decode engine failed mid-answer.", code="engine_error"))
        finally:
            self.legs.end(leg, ended, clean, resp.status, answer.cached_tokens)
        return cut


class _Relayed:
    """The client's connection as a splice sink, noting what the byte-for-byte loop notes per
    chunk: the request record's token events (TTFT, ITL) and whether ``[DONE]`` went out."""

    __slots__ = ("_outcome", "_rec", "_writer", "drained", "stopped")

    def __init__(self, writer: BodyWriter, rec: RequestRecord, outcome: Outcome) -> None:
        self._writer, self._rec, self._outcome = writer, rec, outcome
        self.drained = writer.drained
        self.stopped = False  # a byte-for-byte relay takes the stream to its end

    def write(self, data: bytes) -> bool:
        self._rec.sent_chunk(data)
        if data.endswith(DONE):
            self._outcome.answered = True
        return self._writer.write(data)


class _Stitched:
    """The client's connection as a splice sink for a migratable stream: each engine piece read
    and rewritten by the ``Answer`` in the engine connection's callback, what it makes written on;
    at the first failure (``Answer.failure``) the sink stops, and ``_part`` raises it."""

    __slots__ = ("_answer", "_outcome", "_rec", "_writer", "drained", "stopped")

    def __init__(self, writer: BodyWriter, answer: Answer, rec: RequestRecord, outcome: Outcome) -> None:
        self._writer, self._answer, self._rec, self._outcome = writer, answer, rec, outcome
        self.drained = writer.drained
        self.stopped = False

    def write(self, data: bytes) -> bool:
        answer = self._answer
        out = answer.feed(data)
        if answer.failure is not None:
            self.stopped = True
        if answer.done:
            self._outcome.answered = True  # [DONE] is out: a hang-up now changes nothing
        if not out:
            return True
        self._rec.sent_chunk(out)
        return self._writer.write(out)


def _is_stream(content_type: bytes | None) -> bool:
    return content_type is not None and content_type.startswith(b"text/event-stream")


def _reason(err: BaseException) -> str:
    """A broken decode connection as a migration reason."""
    return "timeout" if isinstance(err, TimeoutError) else "disconnected"
