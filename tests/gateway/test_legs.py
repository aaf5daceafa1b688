"""The decode leg's start (gateway/engines/legs.py): reading a stream up to its first token, to
tell a leg that failed before it (retried elsewhere) from one that began answering. And a prefill
answer whose KV handle cannot be sent on: the prefill engine's failure, not the client's."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import orjson
import pytest

from gateway.config import TimeoutsConfig
from gateway.engines.legs import KVReleaser, LegFailed, _read_head, prefill, retryable
from gateway.engines.pools import Pools
from gateway.engines.upstream import Upstream

from .exchange_harness import KV, D, FakeResponse, P, answer, completion
from .test_exchange import LONG, settled

ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}'
TOKEN = b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}'
ERROR = b'data: {"error":{"message":"KV load failed","code":500}}'


class Reads:
    """An engine response whose body comes in the given reads."""

    def __init__(self, *reads: bytes) -> None:
        self._reads = list(reads)

    async def read_some(self) -> bytes:
        return self._reads.pop(0) if self._reads else b""


def framed(events: list[bytes], eol: bytes = b"\n", keepalive: bool = False) -> bytes:
    ka = b": keep-alive" + eol + eol if keepalive else b""
    return b"".join(ka + e + eol + eol for e in events)


@pytest.mark.parametrize(("eol", "keepalive"), [(b"\n", False), (b"\r\n", False), (b"\n", True), (b"\r\n", True)])
async def test_the_head_reads_past_the_role_chunk_to_the_first_token_in_any_framing(eol, keepalive):
    role, token = framed([ROLE], eol, keepalive), framed([TOKEN], eol, keepalive)
    head = await _read_head(Reads(role, token), stream=True, max_head_bytes=4096)  # type: ignore[arg-type]
    assert head == role + token


@pytest.mark.parametrize(("eol", "keepalive"), [(b"\n", False), (b"\r\n", False), (b"\n", True), (b"\r\n", True)])
async def test_an_error_as_the_first_event_after_the_role_chunk_fails_the_leg_before_its_first_token(eol, keepalive):
    with pytest.raises(LegFailed) as failed:
        await _read_head(Reads(framed([ROLE], eol, keepalive), framed([ERROR], eol, keepalive)), True, 4096)  # type: ignore[arg-type]
    assert failed.value.err.status == 502 and "before its first token" in failed.value.err.message


async def test_a_head_of_role_chunks_and_comments_only_is_bounded():
    with pytest.raises(LegFailed) as failed:
        await _read_head(Reads(*[framed([ROLE], keepalive=True)] * 50), True, 1000)  # type: ignore[arg-type]
    assert "oversized" in failed.value.err.message


# -- a KV handle nested deeper than it can be sent on ------------------------------------------------


def deep_prefill_answer() -> bytes:
    """A prefill answer whose KV handle orjson reads (it reads JSON nested up to 1024 levels) but
    cannot write again (it writes 254)."""
    body = orjson.dumps(completion("x", kv={**KV, "remote_block_ids": None}))
    deep = b'"remote_block_ids":' + b"[" * 300 + b"]" * 300
    return body.replace(b'"remote_block_ids":null', deep)


@dataclass
class Answer(FakeResponse):
    content_length: int | None = None  # what the real Upstream reads first


class Transport:
    """The engine transport under the real Upstream: every post answers 200 with ``body``."""

    def __init__(self, body: bytes) -> None:
        self.body, self.posts = body, 0

    async def post(self, url: str, path: str, data: bytes, fields: dict[str, str], t: Any) -> Answer:
        self.posts += 1
        return Answer([self.body])


async def test_a_prefill_answer_whose_kv_handle_cannot_be_sent_on_fails_the_prefill_leg():
    upstream = Upstream(Transport(deep_prefill_answer()), TimeoutsConfig())  # type: ignore[arg-type]
    ep = Pools([P], [D]).prefill[0]
    with pytest.raises(LegFailed) as failed:
        await prefill(upstream, ep, "/v1/completions", {"model": "m", "prompt": "x"}, "r1", {})
    assert failed.value.reached and failed.value.err.status == 502 and failed.value.err.code == "engine_error"
    assert retryable(failed.value.err)  # another prefill engine, or direct: not a 400 for the client


async def test_a_kv_release_that_cannot_be_sent_leaves_no_task_exception():
    transport = Transport(b"")
    releaser = KVReleaser(Upstream(transport, TimeoutsConfig()))  # type: ignore[arg-type]
    kv = orjson.loads(deep_prefill_answer())["kv_transfer_params"]
    releaser.release(Pools([P], [D]).decode[0], "m", kv, "r1")
    [task] = releaser._tasks
    await asyncio.wait([task])
    assert task.exception() is None and transport.posts == 0


async def test_an_unsendable_kv_handle_sends_the_request_direct_not_a_400(h):
    h.upstream.on(P, FakeResponse([deep_prefill_answer()]))
    h.upstream.on("decode", answer(completion("served")))
    r = await h.send({"model": "tiny", "prompt": LONG})
    assert r.status == 200 and r.json()["choices"][0]["text"] == "served"
    assert r.headers["x-pdgate-path"] == "direct" and r.headers["x-pdgate-failover"] == "prefill_fallback_direct"
    (_, _, decode_body) = h.upstream.calls[-1]
    assert "kv_transfer_params" not in decode_body  # the decode engine computes the prompt itself
    settled(h)
