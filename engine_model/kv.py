"""The KV side channel between simulated engines (the stand-in for NIXL's handshake + READ).

Wire format: TCP; every message is a 4-byte big-endian length followed by that many
bytes of JSON (one object). The client sends a request and reads exactly one reply on
the same connection; connections are kept open and reused.

Requests (``op``), all naming the ``engine_id`` the caller expects to reach:

* ``read``   ``{request_id, block_ids: [[...]], num_tokens}`` -> ``{status, engine_id,
  block_size, tags}``. ``status`` is ``ok`` (the handle is held) or ``unknown`` (no such
  handle, or it expired); either way the blocks are read, as NIXL reads memory by block id,
  and ``tags`` says what KV they hold now: per block, a chained digest of the tokens it was
  computed from (null for a block since reallocated), so the decode side can tell the right
  KV from someone else's. ``bad_blocks``: block ids outside the pool (the transfer cannot be
  set up); ``engine_mismatch``: wrong engine.
* ``notify`` ``{request_id}`` -> ``{status}``: the decode engine is done with the blocks
  (or dropped the request before reading): the prefill engine frees them. An unknown
  handle is counted in vllm:nixl_num_notifications_after_expiry.
* ``hb``     ``{request_ids: [...]}``: lease renewal for handles whose decode request is
  still queued (vLLM's heartbeats).

Every reply carries the answering engine's ``engine_id``; the decode side fails the
request when it is not the one named in ``kv_transfer_params`` (vLLM: "Remote NIXL agent
engine ID mismatch"). A peer that cannot be reached is retried until the handshake
timeout, like a ZMQ REQ socket with a 5 s receive timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections.abc import Callable
from typing import Any

import orjson

log = logging.getLogger("engine_model.kv")

_HEADER = struct.Struct("!I")
MAX_FRAME = 64 * 1024 * 1024

Handler = Callable[[dict[str, Any]], dict[str, Any]]


class KVError(Exception):
    """The side channel could not deliver a request or its reply."""


def encode_frame(obj: dict[str, Any]) -> bytes:
    data = orjson.dumps(obj)
    return _HEADER.pack(len(data)) + data


async def read_frame(reader: asyncio.StreamReader) -> dict[str, Any]:
    (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    if size > MAX_FRAME:
        raise KVError(f"frame of {size} bytes is too large")
    obj = orjson.loads(await reader.readexactly(size))
    if not isinstance(obj, dict):
        raise KVError("a frame must hold a JSON object")
    return obj


class KVServer:
    """Answers side-channel requests with the engine's handlers (one per ``op``)."""

    def __init__(self, handlers: dict[str, Handler], host: str, port: int = 0) -> None:
        self.handlers = handlers
        self.host = host
        self.port = port
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.StreamWriter] = set()

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for w in list(self._conns):
                w.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._conns.add(writer)
        try:
            while True:
                try:
                    msg = await read_frame(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                handler = self.handlers.get(msg.get("op", ""))  # no handler for "" (nor for no op)
                if handler is None:
                    reply = {"status": "bad_request", "error": f"unknown op {msg.get('op')!r}"}
                else:
                    try:
                        reply = handler(msg)
                    except Exception as e:  # never kill the channel over one bad message
                        log.exception("side-channel handler failed")
                        reply = {"status": "error", "error": str(e)}
                writer.write(encode_frame(reply))
                await writer.drain()
        except (KVError, ValueError, ConnectionError) as e:
            log.warning("dropping side-channel connection: %s", e)
        finally:
            self._conns.discard(writer)
            writer.close()


class KVClient:
    """Calls peers' side channels over pooled connections."""

    def __init__(self, connect_timeout: float = 5.0, retry_interval: float = 0.05) -> None:
        self.connect_timeout = connect_timeout
        self.retry_interval = retry_interval
        self._idle: dict[tuple[str, int], list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]] = {}

    async def call(self, host: str, port: int, msg: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.connect_timeout if timeout is None else timeout)
        key = (host, port)
        data = encode_frame(msg)
        for _ in range(2):
            conn, fresh = await self._get(key, deadline)
            reader, writer = conn
            try:
                writer.write(data)
                await writer.drain()
                reply = await asyncio.wait_for(read_frame(reader), max(deadline - loop.time(), 0.001))
            except TimeoutError as e:
                writer.close()
                raise KVError(f"no reply from {host}:{port} before the timeout") from e
            except (OSError, asyncio.IncompleteReadError, KVError, ValueError) as e:
                writer.close()
                if fresh:
                    raise KVError(f"side channel {host}:{port} failed: {e}") from e
                continue  # a pooled connection went stale: try a fresh one
            except BaseException:
                writer.close()  # cancelled mid-call: the connection's state is unknown
                raise
            self._idle.setdefault(key, []).append(conn)
            return reply
        raise KVError(f"side channel {host}:{port} keeps failing")  # pragma: no cover

    async def _get(
        self, key: tuple[str, int], deadline: float
    ) -> tuple[tuple[asyncio.StreamReader, asyncio.StreamWriter], bool]:
        idle = self._idle.get(key)
        while idle:
            reader, writer = idle.pop()
            if not writer.is_closing() and not reader.at_eof():
                return (reader, writer), False
            writer.close()
        loop = asyncio.get_running_loop()
        last: Exception | None = None
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise KVError(f"cannot reach side channel {key[0]}:{key[1]}: {last}")
            try:
                conn = await asyncio.wait_for(asyncio.open_connection(*key), remaining)
                return conn, True
            except TimeoutError as e:
                last = e
            except OSError as e:
                last = e
                await asyncio.sleep(min(self.retry_interval, max(deadline - loop.time(), 0)))

    async def close(self) -> None:
        for conns in self._idle.values():
            for _, writer in conns:
                writer.close()
        self._idle.clear()
