"""Mid-stream migration as the request lives it: whether its answer may go on elsewhere, and
carrying it on when a decode leg breaks off after its first token.

``Migrator`` decides once, before the first engine is asked, whether the request is migratable
(``answer``, which reads its engine events, or ``unmigratable``, why not): a migratable request's
decode leg streams with the generated token ids, whatever the client asked, so that its answer can
go on elsewhere. When the relay reports a cut, ``migrate`` continues the answer from the text the
client has: a new ``Part`` over the prompt plus the output kept, routed like a request (waiting for
room, avoiding the engines that failed) and opened through the request's ``EngineLegs``, inside a
``migration`` span. It keeps the request's migration records (``rec.migrations``) and their
metrics, from pending to ok, failed, skipped or abandoned. What may migrate, from where and as what
(without I/O) is gateway/request/migration.py; stitching the parts' events into one answer is
gateway/request/stitch.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.context import Runtime, Services
from gateway.http.errors import APIError
from gateway.ops.requestlog import RequestRecord
from gateway.ops.tracing import RequestTrace
from gateway.request.capacity import Room
from gateway.request.engine_legs import EngineLegs, OpenDecode, Part
from gateway.request.migration import continuation_body, output_budget, resume_point, unmigratable
from gateway.request.protocol import ParsedRequest
from gateway.request.stitch import Answer
from gateway.tokenization.tokenizer import PromptIds

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Cut:
    """A decode leg that failed after its first token: why (a metric label) and what the client
    gets if the answer cannot go on."""

    reason: str
    err: APIError


def settle(rec: RequestRecord, svc: Services, result: str) -> None:
    """The pending migration, if any, ends with ``result`` (its continuation went well, failed
    too, or the client left first)."""
    for m in rec.migrations:
        if m["result"] == "pending":
            m["result"] = result
            svc.metrics.migration(m["reason"], result)


def whole_as_sent(req: ParsedRequest, migrates: bool, min_tokens: int) -> str | None:
    """Why a non-streamed request goes as sent (None: it migrates). A short answer is cheaper
    to regenerate from the start on a failure (``failover.decode_retries``) than to assemble from
    an engine stream every time (about half the gateway's CPU for a 16-token answer,
    docs/benchmarks.md)."""
    if not migrates:
        return "non_streaming"
    budget = output_budget(req)
    if min_tokens and budget is not None and budget <= min_tokens:
        return "short_answer"
    return None


class Migrator:
    """One request's migrations. ``parts`` is the request's list of parts, which each continuation
    joins; ``room`` the request's wait for room on the engines."""

    def __init__(
        self,
        rt: Runtime,
        svc: Services,
        rec: RequestRecord,
        req: ParsedRequest,
        prompts: PromptIds,
        headers: Mapping[str, str],
        *,
        legs: EngineLegs,
        room: Room,
        parts: list[Part],
    ) -> None:
        self.rt = rt
        self.svc = svc
        self.rec = rec
        self.req = req
        self.prompts = prompts
        self.headers = headers  # the client's: a continuation is prepared with them, as the request was
        self.legs = legs
        self.room = room
        self.parts = parts
        self.answer: Answer | None = None  # a migratable request's answer (its events are read)
        self.unmigratable: str | None = None  # else why not
        migration = rt.cfg.routing.migration
        why = unmigratable(req, prompts.approximate_reason) if migration.enabled else "disabled"
        if why is None and not req.stream:
            why = whole_as_sent(req, migration.non_streaming, migration.non_streaming_min_tokens)
        if why is None and migration.max_per_request > 0:
            opts = req.body.get("stream_options") or {}
            max_model_len = rt.served(req.model)[0].cfg.max_model_len  # type: ignore[index]
            self.answer = Answer(
                req.kind,
                stream=req.stream,
                wants_ids=bool(req.body.get("return_token_ids")),
                usage=bool(opts.get("include_usage")),
                continuous=bool(opts.get("include_usage") and opts.get("continuous_usage_stats")),
                prompt=prompts[0],
                # the role chunk: the prompt's ids, and its text if asked for (escaped)
                max_event_bytes=(1 << 16) + 12 * max_model_len + 6 * req.raw_size,
            )
        else:
            self.unmigratable = why or "limit"

    def engine_request(self) -> tuple[dict[str, Any], bool]:
        """The body and stream flag of the request's own decode leg: a migratable one streams from
        its engine with the generated token ids, whatever the client asked."""
        req = self.req
        if self.answer is None:
            return req.body, req.stream
        body = {**req.body, "return_token_ids": True}
        if not req.stream:
            body.update(stream=True, stream_options={"include_usage": True})
        return body, True

    def settle(self, result: str) -> None:
        """The pending migration, if any, ends with ``result``."""
        settle(self.rec, self.svc, result)

    def not_migratable(self, cut: Cut) -> None:
        """A decode leg of a request that was never migratable failed mid-answer."""
        self._not_migrated(cut, self.unmigratable or "disabled")

    async def migrate(self, failed: OpenDecode, cut: Cut, answer: Answer) -> OpenDecode | None:
        """Continue the answer on another decode engine: the prompt plus the output kept, routed
        like a request. None when it cannot (the reason is logged and counted)."""
        self.legs.failed_decode.add(failed.ep.url)
        settle(self.rec, self.svc, "failed")  # an earlier migration's continuation failed too
        why = self._why_not(cut, answer)
        if why is not None:
            self._not_migrated(cut, why)
            return None
        t0 = time.perf_counter()
        record: dict[str, Any] = {
            "reason": cut.reason,
            "from": failed.ep.url,
            "to": None,
            "path": None,
            "tokens": 0,
            "result": "pending",
        }
        self.rec.migrations.append(record)
        span, trace = self.rec.trace.child(
            "migration", {"pdgate.migration.reason": cut.reason, "pdgate.migration.from": failed.ep.url}
        )
        try:
            part = await self._continuation(answer, trace)
            record["tokens"] = kept = answer.output_tokens
            span.set("pdgate.migration.kept_tokens", kept)
            if part is None:
                why = "no_resume_point"
                log.warning(
                    "request %s: not migrated (%s): the text sent does not join the tokens received",
                    self.rec.request_id,
                    why,
                )
                record["result"] = "skipped"
                self.svc.metrics.migration(cut.reason, "skipped", why)
                span.end(why)
                return None
            log.warning(
                "request %s: decode leg on %s failed mid-answer (%s); continuing after %d tokens",
                self.rec.request_id,
                failed.ep.url,
                cut.reason,
                kept,
            )
            deadline = time.monotonic() + self.rt.cfg.admission.queue_timeout_s
            route, _ = await self.room.pick(part.prep, deadline, exclude=self.legs.failed_decode, sheddable=False)
            part.decision = route.decision
            leg = await self.legs.open(part)
        except APIError as err:
            log.warning("request %s: migration failed: %s", self.rec.request_id, err)
            record["result"] = "failed"
            self.svc.metrics.migration(cut.reason, "failed")
            span.end(str(err))
            return None
        except BaseException:
            span.end("abandoned")
            raise
        seconds = time.perf_counter() - t0
        record.update(to=leg.ep.url, path=leg.path.value, ms=round(seconds * 1000, 3))
        span.set("pdgate.migration.to", leg.ep.url)
        span.set("pdgate.migration.path", leg.path.value)
        span.end()
        self.svc.metrics.migrated(self.rec.model, leg.path.value, kept, seconds)
        return leg

    def _why_not(self, cut: Cut, answer: Answer) -> str | None:
        migration = self.rt.cfg.routing.migration
        if cut.reason == "diverged":
            return "diverged"
        if answer.unresumable is not None:
            return answer.unresumable
        if not answer.prompt_confirmed and self.prompts.approximate_reason:
            return "prompt_unknown"  # the gateway's count may be off and the engine did not say its own
        if sum(1 for m in self.rec.migrations if m["result"] != "skipped") >= migration.max_per_request:
            return "limit"
        if migration.deadline_s and self.rec.since_start() > migration.deadline_s:
            return "deadline"
        return None

    def _not_migrated(self, cut: Cut, why: str) -> None:
        log.warning(
            "request %s: decode leg failed mid-answer (%s); not migrated: %s", self.rec.request_id, cut.reason, why
        )
        self.rec.migrations.append({"reason": cut.reason, "result": "skipped", "why": why})
        self.svc.metrics.migration(cut.reason, "skipped", why)

    async def _continuation(self, answer: Answer, trace: RequestTrace) -> Part | None:
        """The next part: where the answer resumes (None: nowhere safe), its body and context."""
        req = self.req
        served = self.rt.served(req.model)
        assert served is not None
        tok, adapter = served
        prompt = answer.prompt()
        budget = output_budget(req)
        point = await self.rt.tokenizers.run(
            resume_point,
            tok.backend,
            prompt,
            answer.ids,
            answer.text_len,
            answer.tail(answer.tail_chars),
            skip_special_tokens=req.body.get("skip_special_tokens") is not False,
            spaces_between_special_tokens=req.body.get("spaces_between_special_tokens") is not False,
            max_tokens=budget,
        )
        if point is None:
            return None
        if answer.prompt_mismatch:
            log.warning(
                "request %s: the engine's prompt token ids differ from the gateway's (%d vs %d tokens); "
                "the continuation uses the engine's",
                self.rec.request_id,
                answer.prompt_tokens,
                len(self.prompts[0]),
            )
        answer.resume(point.tokens, point.overlap)
        ids = [*prompt, *answer.ids]
        body = continuation_body(
            req, ids, point.tokens, max_model_len=tok.cfg.max_model_len, continuous=answer.continuous
        )
        number = len(self.parts)
        request_id = f"{self.rec.request_id}-m{number}"
        salt = req.body.get("cache_salt")
        prep = await self.rt.router.prepare(
            req.model,
            request_id,
            ids,
            None,
            self.headers,
            salt if isinstance(salt, str) else None,
            lora=adapter.lora if adapter is not None else None,
            loadable=adapter is not None and adapter.configured and self.rt.cfg.lora.dynamic_loading,
        )
        part = Part(
            number, "/v1/completions", body, True, prep, request_id, trace, max_head_bytes=answer.max_event_bytes
        )
        self.parts.append(part)
        return part
