"""A migratable request's answer, made of one or more engine streams.

The decode leg of a migratable request asks its engine for the generated token ids
(``return_token_ids``) and streams, even when the client did not ask to stream (the whole answer
is then assembled here, in vLLM 0.32's shape). ``Answer`` reads each engine event once: it keeps
the token ids behind the text the client has been sent, and strips the ids the client did not ask
for, so the client sees exactly what the engine would have sent without them. After a migration
(gateway/request/migration.py), the continuation is a ``/v1/completions`` stream over the prompt plus the
output kept; ``Answer`` makes its events look like the rest of the client's answer: the first
part's id, object, creation time and model, chat deltas for a chat client, usage counting the
original prompt and the tokens of every part, and none of the text the client already has (the
continuation reproduces it first; it is checked, then dropped).

Only the events of migratable requests are read; every other answer is relayed byte for byte. Of
those, the token events of the first part that have the shape of one parsed before them are read
from their bytes (gateway/request/token_shape.py), the rest parsed.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

import orjson

from gateway.engines import sse
from gateway.request.protocol import Kind
from gateway.request.token_shape import TokenShape

DONE = b"data: [DONE]\n\n"
_NOT_OPENAI = "the decode engine sent an event not of the OpenAI shape"
TAIL_CHARS = 4096  # of the text sent to a streaming client, what a resume check compares
LEARN_EVENTS = 8  # token events of a part looked at for its shape (gateway/request/token_shape.py)


class Broken(Exception):
    """The engine's stream failed after its first token: an error event (``error_event``), an
    event that is not JSON (``bad_event``), or an end before the answer was whole (``ended``)."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(message)
        self.cause = cause


class Diverged(Exception):
    """A continuation's first text is not the text the client already has (sampling differed)."""


class Answer:
    """What the client of one migratable request has been sent, and the rewriting of the engine
    events that make it.

    ``feed`` takes the engine's bytes and returns what goes to a streaming client (nothing for a
    non-streaming one: ``whole`` gives its body at the end); it raises ``Broken`` when the stream
    fails and ``Diverged`` when a continuation does not reproduce the text sent. ``resume`` starts
    the next part.
    """

    def __init__(
        self,
        kind: Kind,
        *,
        stream: bool,
        wants_ids: bool,
        usage: bool,
        continuous: bool,
        prompt: Sequence[int],
        max_event_bytes: int,
        shapes: bool = True,
    ) -> None:
        self.kind: Kind = kind
        self.stream = stream  # the client streams
        self.wants_ids = wants_ids  # the client asked for return_token_ids itself
        self.usage = usage  # a streaming client asked for the usage chunk
        self.continuous = continuous  # ... and usage in every chunk
        self._prompt = prompt  # the gateway's own prompt ids (the engine's, once it says)
        self.prompt_tokens = len(prompt)
        self.engine_prompt: list[int] | None = None  # kept when they differ from the gateway's, or are asked for
        self.prompt_mismatch = False
        self.prompt_confirmed = False  # the engine said which prompt ids it ran
        self.ids = array("I")  # the generated token ids behind the text sent
        self.text_len = 0  # characters of text sent
        self._pieces: list[str] = []  # all of it (non-streaming clients), its end (streaming ones)
        self._kept = 0  # characters in _pieces (streaming clients)
        self._reasoning: list[str] = []
        self.role = "assistant"
        self._head: dict[str, Any] | None = None  # id, object, created, model of the first event
        self._fingerprint: Any = None
        self._metrics: Any = None
        self.finish: tuple[Any, Any] | None = None  # (finish_reason, stop_reason)
        self._usage_seen: dict[str, Any] | None = None
        self.unresumable: str | None = None  # why this answer can no longer be continued elsewhere
        self.done = False  # [DONE] after a finish: the answer is whole
        self.part = 0  # continuations started
        self._base = 0  # generated tokens of earlier parts, in the current part's prompt
        self._skip_text = ""  # text the current part must reproduce first (the client has it)
        self._skip_ids: list[int] = []  # ... and token ids, for a client that asked for them
        self.max_event_bytes = max_event_bytes
        self._events = sse.Events(max_event_bytes)
        self._raw = False
        self._last = b""  # relayed raw: the last bytes, where [DONE] shows
        self.failure: Broken | Diverged | None = None  # what ended the last feed (see ``check``)
        self._shape: TokenShape | None = None  # the part's token events, read without JSON
        self._learn = LEARN_EVENTS if shapes else 0  # parsed token events left to learn it from

    # -- reading the engine ---------------------------------------------------------------------------

    def feed(self, data: bytes) -> bytes:
        """What to send the client for ``data``. When an event fails (``Broken``, ``Diverged``),
        what the events before it make is still returned, and ``failure`` holds the error: the
        caller sends the bytes, then raises it (``check``), so nothing recorded as sent is lost."""
        if self._raw:  # nothing left to read or rewrite: the engine's bytes as they come
            self._last = last = (self._last + data)[-len(DONE) - 2 :]
            self.done = last.endswith(DONE) or (b"\r" in last and sse.normalize(last).endswith(DONE))
            return data
        shape, tried = self._shape, False
        if shape is not None and self.finish is None and self._events.idle and data.endswith(b"\n\n"):
            read = shape.read(data, len(data) - 2)  # the usual read: one token event of the shape
            if read is not None:
                return self._shaped(data, read)
            tried = True
        events = self._events.feed(data)
        try_shape = not tried or len(events) != 1  # the one event of the read is not of the shape
        parts = []
        for event in events:
            try:
                parts.append(self._event(event, try_shape))
            except (Broken, Diverged) as err:
                self.failure = err
                return b"".join(parts)
        if self._events.oversized:  # after the whole events before it
            self.failure = Broken("bad_event", f"an engine stream event is over {self.max_event_bytes} bytes")
            return b"".join(parts)
        out = parts[0] if len(parts) == 1 else b"".join(parts)
        if self.unresumable == "no_token_ids" and self.stream and not self.part:
            # An engine that sends no token ids (vLLM before 0.10.2): this answer cannot be
            # continued, so the rest is relayed as it comes, at no cost per event.
            self._raw = True
            rest = self._events.rest()
            self._last = rest[-len(DONE) - 2 :]
            out += rest
        return out

    def check(self) -> None:
        """Raise what failed in the last ``feed``, if anything did."""
        if self.failure is not None:
            failure, self.failure = self.failure, None
            raise failure

    def ended(self) -> None:
        """The engine's body ended: whole only after [DONE]."""
        if not self.done:
            raise Broken("ended", "the decode engine's stream ended before the answer was complete")

    def _shaped(self, event: bytes, read: tuple[str, int, int]) -> bytes:
        """A token event of the learnt shape: what the parsed path would have made of it."""
        text, token, cut = read
        self.ids.append(token)
        if text:
            self._sent(text)
        if not self.stream:
            return b""
        if self.wants_ids:
            return event if event.endswith(b"\n\n") else event + b"\n\n"
        return event[:cut] + self._shape.stripped  # type: ignore[union-attr]

    def _event(self, event: bytes, try_shape: bool) -> bytes:
        shape = self._shape if try_shape else None
        if shape is not None and self.finish is None:
            read = shape.read(event, len(event))
            if read is not None:
                return self._shaped(event, read)
        if event.startswith(b"data: "):  # vLLM's framing: one data line, read as it comes
            try:
                return self._payload(event[6:])
            except Broken as err:
                if err.cause != "bad_event" or (b"\n" not in event and b"\r" not in event):
                    raise
            # more lines than one (fields, comments, data continued): read by the rules below
        payload = sse.data(event)
        if payload is None:  # a comment (a proxy's keep-alive) or an event without data: nothing to say
            return b""
        return self._payload(payload)

    def _payload(self, payload: bytes) -> bytes:
        if payload == b"[DONE]":
            self.done = True
            return DONE if self.stream else b""
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            raise Broken("bad_event", "the decode engine sent an event that is not JSON") from None
        if not isinstance(obj, dict):
            raise Broken("bad_event", "the decode engine sent an event that is not a JSON object")
        if "error" in obj and "choices" not in obj:
            err = obj["error"]
            message = err.get("message") if isinstance(err, dict) else err
            raise Broken("error_event", f"the decode engine reported an error: {str(message)[:200]}")
        if self.finish is not None and obj.get("choices"):
            raise Broken("bad_event", "the decode engine sent tokens after its finish reason")
        try:
            return self._first(obj, payload) if self.part == 0 else self._continued(obj)
        except (AttributeError, TypeError, KeyError, ValueError):  # choices not a list of objects, ...
            raise Broken("bad_event", _NOT_OPENAI) from None

    def _first(self, obj: dict[str, Any], raw: bytes) -> bytes:
        """An event of the request's own stream: recorded, the ids stripped if not asked for."""
        if self._head is None:
            self._head = {k: obj.get(k) for k in ("id", "object", "created", "model")}
        changed = False
        if obj.get("prompt_token_ids") is not None:  # chat: the role chunk carries the prompt
            changed |= self._engine_prompt(obj, obj)
        choices = obj.get("choices")
        if choices:
            c = choices[0]
            if self.kind == "chat":
                delta = c.get("delta") or {}
                text = delta.get("content") or ""
                if text.__class__ is not str:  # before anything is recorded of the event
                    raise Broken("bad_event", _NOT_OPENAI)
                if len(delta) != 1 or "content" not in delta:  # the role chunk, or parsers' fields
                    self._parsed(delta)
            else:
                text = c.get("text") or ""
                if text.__class__ is not str:
                    raise Broken("bad_event", _NOT_OPENAI)
                if c.get("prompt_token_ids") is not None:  # completions: the first token chunk carries it
                    changed |= self._engine_prompt(c, c)
            if self._learn and self._shape is None and self.part == 0:
                self._learn -= 1
                self._shape = TokenShape.learn(self.kind, obj, raw)
            ids = c.get("token_ids")
            if ids.__class__ is list and not self.wants_ids:
                c["token_ids"] = None
                changed = True
        # What goes out is made before the event's tokens are recorded: JSON that orjson reads but
        # cannot write (nested past 254 levels) then fails the event with nothing of it kept.
        out = b"data: " + (orjson.dumps(obj) if changed else raw) + b"\n\n" if self.stream else b""
        if choices:
            self._took(c, text, ids)
        if len(obj) > 5:  # beyond id, object, created, model, choices: usage and the like
            self._observe(obj)
        return out

    def _continued(self, obj: dict[str, Any]) -> bytes:
        """An event of a continuation (a completions stream), rewritten as the client's."""
        head = self._head or {}
        choices = obj.get("choices")
        if not choices:  # the usage chunk
            if obj.get("usage") is None:
                return b""
            self._observe(obj)
            if not (self.stream and self.usage):
                return b""
            out = {**head, "choices": [], "usage": self._usage(obj["usage"])}
            for key in ("system_fingerprint", "metrics"):
                if key in obj:
                    out[key] = obj[key]
            return _sse(out)
        c = choices[0]
        fr = c.get("finish_reason")
        engine_text = c.get("text") or ""
        if engine_text.__class__ is not str:
            raise Broken("bad_event", _NOT_OPENAI)
        if obj.get("usage") is not None and obj["usage"].__class__ is not dict:
            raise Broken("bad_event", _NOT_OPENAI)
        text = self._reproduced(engine_text)
        engine_ids = c.get("token_ids")
        ids = self._reproduced_ids(engine_ids) if engine_ids.__class__ is list else None
        if fr is not None and (self._skip_text or self._skip_ids):
            raise Diverged("the continuation ended before it reproduced what the client has")
        event = self._rewritten(obj, c, text, ids, reproduced=bool(engine_text) and not text)
        self._took(c, text, engine_ids)  # once what goes out is made (see _first)
        self._observe(obj)
        return event

    def _rewritten(self, obj: dict[str, Any], c: dict[str, Any], text: str, ids: Any, reproduced: bool) -> bytes:
        """A continuation's token event as the client's (nothing when it says nothing new)."""
        fr = c.get("finish_reason")
        # An event whose text the client already has says nothing new, its continuous usage included
        # (the next event's counts cover it): kept, it would repeat a count the client was sent.
        if not self.stream or (
            not text and fr is None and not (self.wants_ids and ids) and ("usage" not in obj or reproduced)
        ):
            return b""
        shown_ids = ids if self.wants_ids else None
        if self.kind == "chat":
            choice: dict[str, Any] = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": fr}
            if fr is not None:
                choice["stop_reason"] = c.get("stop_reason")
            choice["token_ids"] = shown_ids
        else:
            choice = {**c, "text": text, "prompt_token_ids": None, "token_ids": shown_ids}
        out = {**(self._head or {}), "choices": [choice]}
        if obj.get("usage") is not None:
            out["usage"] = self._usage(obj["usage"])
            if self.kind == "chat":
                out["usage"].setdefault("completion_tokens_details", None)
        if "system_fingerprint" in obj:
            out["system_fingerprint"] = obj["system_fingerprint"]
        return _sse(out)

    def _took(self, choice: dict[str, Any], text: str, ids: Any) -> None:
        """A token event: its ids (the engine's ``token_ids``), the text it sends, its finish."""
        fr = choice.get("finish_reason")
        if ids.__class__ is list:
            kept = len(self.ids)
            try:
                self.ids.extend(ids)
            except (OverflowError, TypeError):  # not token ids (a float, a negative, over 2**32)
                del self.ids[kept:]
                raise Broken("bad_event", "the decode engine sent a token id that is not one") from None
        elif text or fr is not None:
            self.unresumable = self.unresumable or "no_token_ids"
        if text:
            self._sent(text)
        if fr is not None:
            self.finish = (fr, choice.get("stop_reason"))

    # -- what the client has ---------------------------------------------------------------------------

    def _sent(self, text: str) -> None:
        self.text_len += len(text)
        self._pieces.append(text)
        if self.stream:  # a stream keeps only its last TAIL_CHARS or so (trimmed now and then)
            self._kept += len(text)
            if self._kept > 2 * TAIL_CHARS:
                self._pieces = ["".join(self._pieces)[-TAIL_CHARS:]]
                self._kept = TAIL_CHARS

    def tail(self, chars: int) -> str:
        """The last ``chars`` characters of the text sent (at most TAIL_CHARS for a stream)."""
        return "".join(self._pieces)[-chars:] if chars else ""

    @property
    def tail_chars(self) -> int:
        return min(self.text_len, TAIL_CHARS) if self.stream else self.text_len

    def _parsed(self, delta: dict[str, Any]) -> None:
        """Deltas beyond role and content come from the engine's output parsers (reasoning, tool
        calls): a completions continuation would not parse its text so."""
        if "role" in delta and isinstance(delta["role"], str):
            self.role = delta["role"]
        if len(delta) <= 2 and delta.keys() <= {"role", "content"}:
            return
        for key in delta.keys() - {"role", "content"}:
            if key in ("reasoning", "reasoning_content") and isinstance(delta[key], str):
                self._reasoning.append(delta[key])
            if delta[key] is not None:
                self.unresumable = self.unresumable or "parsed_output"

    def _engine_prompt(self, holder: dict[str, Any], strip_from: dict[str, Any]) -> bool:
        ids = holder["prompt_token_ids"]
        if isinstance(ids, list):
            self.prompt_confirmed = True
            self.prompt_tokens = len(ids)
            if ids != self._prompt:
                self.prompt_mismatch = True
                self.engine_prompt = ids
            elif self.wants_ids and not self.stream:
                self.engine_prompt = ids
        if self.wants_ids:
            return False
        strip_from["prompt_token_ids"] = None
        return True

    def prompt(self) -> Sequence[int]:
        """The prompt as the engine saw it (its own ids when it said, else the gateway's)."""
        return self.engine_prompt if self.engine_prompt is not None else self._prompt

    def _observe(self, obj: dict[str, Any]) -> None:
        usage = obj.get("usage")
        if isinstance(usage, dict) and not obj.get("choices"):
            self._usage_seen = usage
        if obj.get("system_fingerprint") is not None:
            self._fingerprint = obj["system_fingerprint"]
        if obj.get("metrics") is not None:
            self._metrics = obj["metrics"]

    def _usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """A continuation's usage as the client's: the original prompt, every part's tokens."""
        out = dict(usage)
        completion = usage.get("completion_tokens")
        completion = self._base + (completion if completion.__class__ is int else 0)
        out["prompt_tokens"] = self.prompt_tokens
        out["completion_tokens"] = completion
        out["total_tokens"] = self.prompt_tokens + completion
        details = out.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            out["prompt_tokens_details"] = {
                **details,
                "cached_tokens": min(details["cached_tokens"], self.prompt_tokens),
            }
        return out

    def _counted_usage(self) -> dict[str, Any]:
        """Usage from what was read, for an answer whose engine sent none."""
        completion = len(self.ids)
        return {
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens + completion,
            "completion_tokens": completion,
        }

    @property
    def output_tokens(self) -> int:
        return len(self.ids)

    @property
    def cached_tokens(self) -> int | None:
        """The current part's engine count of prompt tokens its cache served (its usage chunk)."""
        details = (self._usage_seen or {}).get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return cached if type(cached) is int else None

    # -- a continuation ---------------------------------------------------------------------------------

    def resume(self, tokens: int, overlap: str) -> None:
        """The next part's prompt keeps the first ``tokens`` generated ids; it reproduces
        ``overlap`` (text the client has beyond them) first, which is checked and dropped."""
        dropped = self.ids[tokens:].tolist()
        del self.ids[tokens:]
        self.part += 1
        self._base = tokens
        if self.stream:
            self._skip_text = overlap
            self._skip_ids = dropped if self.wants_ids else []
        elif overlap:  # nothing went out yet: the continuation's text takes its place, unchecked
            text = "".join(self._pieces)
            self._pieces = [text[: len(text) - len(overlap)]]
            self.text_len -= len(overlap)
        self.finish = None
        self._shape = None  # a continuation's events are rewritten, not of the first part's shape
        self._learn = 0
        self._events = sse.Events(self.max_event_bytes)
        self._usage_seen = None

    def _reproduced(self, text: str) -> str:
        skip = self._skip_text
        if not skip:
            return text
        n = min(len(skip), len(text))
        if text[:n] != skip[:n]:
            raise Diverged(f"the continuation's text differs from what the client has ({text[:n]!r} vs {skip[:n]!r})")
        self._skip_text = skip[n:]
        return text[n:]

    def _reproduced_ids(self, ids: list[int]) -> list[int]:
        skip = self._skip_ids
        if not skip:
            return ids
        n = min(len(skip), len(ids))
        if ids[:n] != skip[:n]:
            raise Diverged("the continuation's token ids differ from those the client has")
        self._skip_ids = skip[n:]
        return ids[n:]

    def close(self) -> bytes:
        """The end of a streamed answer whose engine broke off after its finish reason: the usage
        chunk if the client asked for it and it did not come, then [DONE]."""
        self.done = True
        if not self.usage or self._usage_seen is not None:
            return DONE
        out = {**(self._head or {}), "choices": [], "usage": self._counted_usage()}
        if self._fingerprint is not None:
            out["system_fingerprint"] = self._fingerprint
        return _sse(out) + DONE

    # -- a whole answer ---------------------------------------------------------------------------------

    def whole(self) -> bytes:
        """The non-streaming body, in vLLM 0.32's shape, of what the parts generated."""
        head = self._head or {}
        fr, sr = self.finish or ("stop", None)
        ids = self.ids.tolist() if self.wants_ids else None
        prompt = list(self.prompt()) if self.wants_ids else None
        text = "".join(self._pieces)
        usage = self._whole_usage()
        if self.kind == "chat":
            message = {
                "role": self.role,
                "content": text,
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                "reasoning": "".join(self._reasoning) or None,
            }
            body: dict[str, Any] = {
                "id": head.get("id"),
                "object": "chat.completion",
                "created": head.get("created"),
                "model": head.get("model"),
                "choices": [
                    {
                        "index": 0,
                        "message": message,
                        "logprobs": None,
                        "finish_reason": fr or "stop",
                        "stop_reason": sr,
                        "token_ids": ids,
                        "routed_experts": None,
                    }
                ],
                "service_tier": None,
                "system_fingerprint": self._fingerprint,
                "usage": usage,
                "prompt_logprobs": None,
                "prompt_token_ids": prompt,
                "prompt_text": None,
                "kv_transfer_params": None,
                "ec_transfer_params": None,
                "metrics": self._metrics,
            }
        else:
            body = {
                "id": head.get("id"),
                "object": "text_completion",
                "created": head.get("created"),
                "model": head.get("model"),
                "choices": [
                    {
                        "index": 0,
                        "text": text,
                        "logprobs": None,
                        "finish_reason": fr,
                        "stop_reason": sr,
                        "token_ids": ids,
                        "prompt_logprobs": None,
                        "prompt_token_ids": prompt,
                        "routed_experts": None,
                    }
                ],
                "service_tier": None,
                "system_fingerprint": self._fingerprint,
                "usage": usage,
                "kv_transfer_params": None,
                "ec_transfer_params": None,
                "metrics": self._metrics,
            }
        return orjson.dumps(body)

    def _whole_usage(self) -> dict[str, Any]:
        seen = self._usage_seen
        if seen is None:
            seen = self._counted_usage()
        elif self.part:
            seen = self._usage(seen)
        details = seen.get("prompt_tokens_details")
        if isinstance(details, dict):  # the stream leaves out its null fields; a whole answer has them all
            created = details.get("created_cache_tokens")
            details = {
                "cached_tokens": details.get("cached_tokens"),
                "created_cache_tokens": created,
                "multimodal_tokens": details.get("multimodal_tokens"),
            }
        return {
            "prompt_tokens": seen.get("prompt_tokens"),
            "total_tokens": seen.get("total_tokens"),
            "completion_tokens": seen.get("completion_tokens"),
            "prompt_tokens_details": details,
            "completion_tokens_details": seen.get("completion_tokens_details"),
        }


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"
