"""Hostile clients for ``bench.chaos --attacks``: each runs for the whole load, reconnecting or
repeating whenever the gateway cuts it off, and counts what it got back.

On the HTTP front (a connection each, issue 13 and issue 27):

- ``endless_header``: a request header that never ends (64 KiB writes as fast as they go);
- ``slowloris``: a head trickled a byte every half second;
- ``stalled_body``: a request head (with a valid key) and part of its body, then nothing;
- ``after_answer``: ``GET /health`` announcing a 10-byte body it never sends, reads the answer,
  sends one byte and stays idle: how long the gateway keeps such a connection open is recorded
  (before issue 27, forever: the body phase of a route that answers first had no bound);
- ``unauth_after_answer``: the same on ``POST /v1/chat/completions`` without a key (a 401 first).

On the request body:

- ``template_kwargs``: chat requests whose ``chat_template_kwargs`` ask the tokenizer to pad to ten
  million tokens (146 bytes that took ~1 GB before issue 27).

On the KV event feed (the gateway subscribes to a ZMQ PUB it trusts):

- ``kv_forger``: a publisher in place of an engine's feed, sending five batches of a million block
  hashes each, then garbage frames every 50 ms.

The report gives, per kind, the answers by status (``cut``: closed with no answer read) and for the
connection-holding kinds the seconds each connection stayed open (``held_s``: p50 and max).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from typing import Any

import aiohttp

CONNECTION_KINDS = ("endless_header", "slowloris", "stalled_body", "after_answer", "unauth_after_answer")
PACE_S = 0.5  # between one attacker's connections
HELD_CAP_S = 120.0  # an after-answer connection still open this long counts as held for good

_HEADS = {
    "endless_header": b"GET /health HTTP/1.1\r\nHost: x\r\nX-E: ",
    "slowloris": b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ",
    "stalled_body": b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b'Authorization: Bearer %(key)s\r\nContent-Length: 1000\r\n\r\n{"model":',
    "after_answer": b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n",
    "unauth_after_answer": b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b"Content-Length: 10\r\n\r\n",
}


class Seen:
    """What the attackers got: answers by kind and status, and how long connections stayed open."""

    def __init__(self) -> None:
        self.answers: Counter[str] = Counter()
        self.held_s: dict[str, list[float]] = {}

    def held(self, kind: str, seconds: float) -> None:
        self.held_s.setdefault(kind, []).append(seconds)

    def report(self) -> dict[str, Any]:
        held = {}
        for kind, xs in self.held_s.items():
            xs = sorted(xs)
            held[kind] = {"connections": len(xs), "p50": round(xs[len(xs) // 2], 2), "max": round(xs[-1], 2)}
        return {"answers": dict(self.answers), "held_s": held}


async def _status(reader: asyncio.StreamReader, first: bytes = b"", wait_s: float = 2.0) -> str:
    with contextlib.suppress(OSError, RuntimeError, TimeoutError):
        async with asyncio.timeout(wait_s):
            rest = first
            while b"\r\n" not in rest:
                more = await reader.read(4096)
                if not more:
                    break
                rest += more
            if rest.startswith(b"HTTP/1.1 "):
                return rest.split(b" ", 2)[1].decode()
    return ""


async def _closed_after(reader: asyncio.StreamReader, stop: asyncio.Event, cap_s: float) -> float | None:
    """Seconds until the gateway closes the connection (reading and dropping what it sends), or
    None if it is still open at ``cap_s`` or when the run stops."""
    t0 = time.monotonic()
    while not stop.is_set() and time.monotonic() - t0 < cap_s:
        try:
            async with asyncio.timeout(0.5):
                if not await reader.read(65536):
                    return time.monotonic() - t0
        except TimeoutError:
            continue
        except (OSError, RuntimeError):
            return time.monotonic() - t0
    return None


async def connection(kind: str, port: int, seen: Seen, stop: asyncio.Event, key: str = "") -> None:
    """One hostile connection after another, each held as long as the gateway lets it; the next
    one ``PACE_S`` after (holding connections is the attack measured here, not a connection flood).
    ``key``: the API key a ``stalled_body`` client sends (a client with a key, misbehaving)."""
    head = _HEADS[kind].replace(b"%(key)s", key.encode())
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            seen.answers[f"{kind} connect_failed"] += 1
            await asyncio.sleep(0.1)
            continue
        t0 = time.monotonic()
        status, first = "", b""
        try:
            writer.write(head)
            if kind in ("after_answer", "unauth_after_answer"):
                status = await _status(reader)
                writer.write(b"x")  # one byte of the announced body, after the answer
                await writer.drain()
                closed = await _closed_after(reader, stop, HELD_CAP_S)
                if closed is not None or not stop.is_set():  # (open when the run ended: not counted)
                    seen.held(kind, time.monotonic() - t0)
            else:
                while not stop.is_set() and not first:
                    if kind == "endless_header":
                        writer.write(b"a" * 65536)
                        await writer.drain()
                        continue
                    if kind == "slowloris":
                        writer.write(b"z")
                        await writer.drain()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(0.5):
                            first = await reader.read(1)  # an answer (or EOF): the gateway cut this one off
                            if not first:
                                break
                status = await _status(reader, first) if first else ""
                if kind != "endless_header":
                    seen.held(kind, time.monotonic() - t0)
        except (OSError, RuntimeError):
            pass
        seen.answers[f"{kind} {status or 'cut'}"] += 1
        writer.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), PACE_S)


async def template_kwargs(url: str, model: str, headers: dict[str, str], seen: Seen, stop: asyncio.Event) -> None:
    """Chat requests asking the tokenizer to pad to ten million tokens, one after another."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
        "chat_template_kwargs": {"tokenize": True, "padding": "max_length", "max_length": 10_000_000},
    }
    async with aiohttp.ClientSession(headers=headers) as session:
        while not stop.is_set():
            try:
                async with session.post(url + "/v1/chat/completions", json=body) as resp:
                    await resp.read()
                    seen.answers[f"template_kwargs {resp.status}"] += 1
            except aiohttp.ClientError:
                seen.answers["template_kwargs cut"] += 1
            await asyncio.sleep(0.05)


async def kv_forger(address: str, seen: Seen, stop: asyncio.Event, batches: int = 5, hashes: int = 1_000_000) -> None:
    """A ZMQ PUB at ``address`` (the gateway subscribes to it as an engine's feed): ``batches``
    batches of ``hashes`` block hashes each, in vLLM's wire format, then garbage every 50 ms."""
    import msgspec
    import zmq
    import zmq.asyncio

    from engine_model.kv_events import BlockStored, KVEventBatch

    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(address)
    try:
        await asyncio.sleep(1.0)  # the gateway's SUB connects (it retries on its own)
        encoder = msgspec.msgpack.Encoder()
        seq = 0
        for b in range(batches):
            if stop.is_set():
                return
            start = b * hashes
            event = BlockStored(
                block_hashes=list(range(start, start + hashes)),
                parent_block_hash=None,
                token_ids=[],
                block_size=16,
                lora_id=None,
                medium="GPU",
                lora_name=None,
            )
            payload = encoder.encode(KVEventBatch(ts=time.time(), events=[event]))
            await pub.send_multipart((b"", seq.to_bytes(8, "big"), payload))
            seq += 1
            seen.answers["kv_forger big_batch"] += 1
            await asyncio.sleep(0.5)
        while not stop.is_set():
            await pub.send_multipart((b"", seq.to_bytes(8, "big"), b"\xc1garbage" * 8))
            await pub.send_multipart((b"one frame only",))
            seq += 1
            seen.answers["kv_forger garbage"] += 2
            await asyncio.sleep(0.05)
    finally:
        pub.close(linger=0)
        ctx.term()


async def health_probe(url: str, stalls_ms: list[float], stop: asyncio.Event, every_s: float = 0.1) -> None:
    """``GET /health`` every ``every_s``: how long the gateway's loop took to answer, under attack."""
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            t0 = time.perf_counter()
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with asyncio.timeout(30), session.get(url + "/health") as resp:
                    await resp.read()
            stalls_ms.append((time.perf_counter() - t0) * 1000)
            await asyncio.sleep(every_s)
