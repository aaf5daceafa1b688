"""Engine streams' event framing (gateway/engines/sse.py), by the WHATWG server-sent events rules."""

from __future__ import annotations

import pytest

from gateway.engines import sse


@pytest.mark.parametrize(
    ("event", "data"),
    [
        (b'data: {"a":1}', b'{"a":1}'),  # vLLM's
        (b'data:{"a":1}', b'{"a":1}'),  # no space after the colon
        (b"data:  two spaces", b" two spaces"),  # only one space goes
        (b": keep-alive", None),  # a comment
        (b": ping\ndata: [DONE]", b"[DONE]"),
        (b"event: message\nid: 7\nretry: 100\ndata: x", b"x"),  # fields without use here
        (b"data: a\ndata: b", b"a\nb"),  # data over several lines
        (b"data", b""),  # a field name alone: empty data
        (b"id: 1", None),
        (b': ping\rdata: {"a":1}', b'{"a":1}'),  # line ends mixed within one event
        (b'data: {"a":1}\rid: 1', b'{"a":1}'),
    ],
)
def test_an_events_data(event, data):
    assert sse.data(event) == data


def test_line_ends_are_made_lf():
    assert sse.normalize(b"data: a\r\n\r\ndata: b\r\rdata: c\n\n") == b"data: a\n\ndata: b\n\ndata: c\n\n"


def test_the_data_of_whole_events_in_any_framing():
    assert sse.payloads(b": hi\n\ndata: 1\n\ndata: 2") == [b"1"]  # the last is still arriving
    assert sse.payloads(b": hi\n\ndata: 1\n\ndata: 2", arriving=True) == [b"1", b"2"]
    assert sse.payloads(b"data: 1\r\n\r\n: ka\r\n\r\ndata: 2\r\n") == [b"1"]  # one line end: not whole
    assert sse.payloads(b"data: 1\r\n\r\ndata: 2\r\n\r") == [b"1", b"2"]  # CR after a line end: a blank line


def test_an_event_is_bounded_while_incomplete():
    events = sse.Events(limit=100)
    assert events.feed(b"data: {}\n\ndata: {") == [b"data: {}"] and not events.oversized
    assert events.feed(b"x" * 200) == []
    assert events.oversized
