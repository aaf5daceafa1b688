"""A migratable stream's token events read without parsing their JSON.

Every token event of one vLLM stream is the same bytes but for its text and its token id: the
same id, object, creation time and model, the same nulls (``logprobs``, ``finish_reason``,
``stop_reason``) in the same order. ``TokenShape`` is learnt from one such event that the
parsed path (gateway/request/stitch.py, ``Answer``) has read (the first that qualifies among
the first few of an answer's first part), and recognises the next ones by their bytes: the head
up to the text's opening quote, the bytes between its closing quote and the id list, and the
end. An event read so is exactly the learnt one with another text and id (the text holds no
quote, backslash or control character and is valid UTF-8, the id is one JSON integer under
10**9), so it parses to what the parsed path would read from it: its text is the bytes decoded,
its id the integer. Its other fields say nothing the parsed path records: a shape is learnt only
from an event without usage, prompt ids, system fingerprint or metrics. Anything else (an escape
in the text, several ids, a finish reason, usage, another framing) does not match and is
parsed, as before.

Why: parsing and re-serialising each event cost ~3.2 us per event in a tight loop, about 7 of
the ~49 us of gateway CPU a relayed chunk took with migration on (docs/benchmarks.md); reading
the shape costs about half.
``tests/gateway/test_token_shape.py`` checks both paths give the same bytes and the same record.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from gateway.request.protocol import Kind

_TEXT = "\ue000pdgate-text\ue001"  # private-use markers: no engine text is made of these
_IDS = "\ue000pdgate-ids\ue001"
_TEXT_BYTES = _TEXT.encode()
_IDS_BYTES = b'"' + _IDS.encode() + b'"'  # serialised as a string, where the id list goes
_ESCAPED = re.compile(rb"[\\\x00-\x1f]")  # what a JSON string must escape, but for the quote
_RECORDED = frozenset(("usage", "prompt_token_ids", "system_fingerprint", "metrics"))  # what Answer keeps
_DATA = b"data: "
_END = b"\n\n"


class TokenShape:
    """The bytes every token event of one stream shares; ``read`` tells the rest."""

    __slots__ = ("_after", "_after_len", "_head", "_mid", "_mid_len", "_start", "_stripped")

    def __init__(self, head: bytes, mid: bytes, after: bytes) -> None:
        self._head = head  # ``data: {...`` up to and including the text's opening quote
        self._start = len(head)
        self._mid = mid  # the text's closing quote ... ``"token_ids":[``
        self._mid_len = len(mid)
        self._after = after  # ``]`` and the rest of the event
        self._after_len = len(after)
        self._stripped = b"null" + after[1:] + _END  # the ids' place when the client did not ask

    @classmethod
    def learn(cls, kind: Kind, obj: dict[str, Any], raw: bytes) -> TokenShape | None:
        """The shape of ``raw`` (an event's JSON), which parsed to ``obj``: a token event with
        one id and nothing the parsed path records but its text and id (no finish, usage, prompt
        ids, fingerprint or metrics), serialised as orjson would. None otherwise."""
        if not _RECORDED.isdisjoint(obj):
            return None
        choices = obj.get("choices")
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            return None
        c = choices[0]
        ids = c.get("token_ids")
        if ids.__class__ is not list or len(ids) != 1 or ids[0].__class__ is not int:
            return None
        if c.get("finish_reason") is not None or c.get("prompt_token_ids") is not None:
            return None
        if kind == "chat":
            delta = c.get("delta")
            if not isinstance(delta, dict) or delta.keys() != {"content"} or not isinstance(delta["content"], str):
                return None
            probe_choice = {**c, "delta": {"content": _TEXT}, "token_ids": _IDS}
        else:
            if not isinstance(c.get("text"), str):
                return None
            probe_choice = {**c, "text": _TEXT, "token_ids": _IDS}
        if orjson.dumps(obj) != raw:  # the engine serialises otherwise (spaces, escapes): parse all
            return None
        probe = orjson.dumps({**obj, "choices": [probe_choice]})
        if probe.count(_TEXT_BYTES) != 1 or probe.count(_IDS_BYTES) != 1:  # an engine's own text holds one
            return None
        head, _, rest = probe.partition(_TEXT_BYTES)
        mid, ids_after_text, after = rest.partition(_IDS_BYTES)
        if not ids_after_text:  # the ids before the text: not a shape ``read`` knows
            return None
        return cls(_DATA + head, mid + b"[", b"]" + after)

    def read(self, event: bytes, stop: int) -> tuple[str, int, int] | None:
        """For ``event[:stop]`` (``data: {...}``, its blank line not counted): its text, its
        token id and where the ids start (``event[:cut]`` + ``stripped`` is the event without
        them), or None when it is not of this shape."""
        if not event.startswith(self._head):
            return None
        start = self._start
        i = event.find(b'"', start, stop)  # the text's closing quote: it holds none (nor backslashes)
        if i < 0 or not event.startswith(self._mid, i) or _ESCAPED.search(event, start, i) is not None:
            return None
        cut = i + self._mid_len
        end = stop - self._after_len
        if end < cut or not event.startswith(self._after, end):
            return None
        digits = event[cut:end]
        if not digits.isdigit() or len(digits) > 9 or (digits[0] == 48 and len(digits) > 1):
            return None  # one JSON integer (no sign, no leading 0) that a token id array holds
        try:
            text = event[start:i].decode()
        except UnicodeDecodeError:
            return None
        return text, int(digits), cut - 1

    @property
    def stripped(self) -> bytes:
        """What follows ``event[:cut]`` when the ids are taken out: ``null``, the event's end, its blank line."""
        return self._stripped
