"""An ``Exchange`` run in-process, through its real ASGI endpoint, against scripted engine legs: for
tests of the request lifecycle (accounting, hooks, failover, the client leaving) with no HTTP on
either side. The gateway's own objects do the work; only the engines' answers are scripted."""

from __future__ import annotations

import asyncio
from collections import defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from gateway.config import GatewayConfig, ModelConfig, TokenizerConfig, TracingConfig, parse_config
from gateway.context import Runtime, Services
from gateway.engines.legs import KVReleaser
from gateway.engines.pools import Pools
from gateway.engines.transport import ServerDisconnected
from gateway.engines.upstream import EngineError, EngineGone
from gateway.fairness.admission import Gate
from gateway.http.handlers import Gateway
from gateway.ops.metrics import GatewayMetrics
from gateway.ops.requestlog import AccessLog
from gateway.ops.tracing import Tracing
from gateway.request.relay import InferenceEndpoint
from gateway.request.router import Router
from gateway.tokenization.tokenizer import ModelTokenizer, Tokenizers
from policies.base import Decision, Finished, LegReport, RequestContext
from policies.beliefs.estimates import EngineEstimates
from policies.beliefs.prefix_index import PrefixIndex
from policies.beliefs.prefix_learning import InFlightPrefixes, PrefixBeliefs
from policies.hooks import Hooks

P, D, D2 = "http://p:1", "http://d:1", "http://d2:1"
KV = {
    "do_remote_prefill": True,
    "remote_engine_id": "e",
    "remote_block_ids": [[1]],
    "remote_host": "h",
    "remote_port": 1,
    "remote_request_id": "r",
    "remote_prefill_cached_tokens": 0,
}


@dataclass
class FakeResponse:
    """An engine's answer: ``chunks`` in order; the first waits for ``gate`` if given, those after
    ``hold_after`` chunks for ``held``; after ``break_after`` chunks the connection breaks."""

    chunks: list[bytes]
    status: int = 200
    gate: asyncio.Event | None = None
    break_after: int | None = None
    hold_after: int | None = None
    held: asyncio.Event = field(default_factory=asyncio.Event)
    content_type: bytes = b"application/json"
    closed: bool = False
    released: bool = False
    _sent: int = 0

    def header(self, name: bytes) -> bytes | None:
        return self.content_type if name == b"content-type" else None

    async def read_some(self) -> bytes:
        if self.gate is not None:
            await self.gate.wait()
            self.gate = None
        if self.hold_after is not None and self._sent >= self.hold_after:
            await self.held.wait()
        if self.break_after is not None and self._sent >= self.break_after:
            raise ServerDisconnected("engine went away")
        if self._sent >= len(self.chunks):
            return b""
        self._sent += 1
        return self.chunks[self._sent - 1]

    async def read(self) -> bytes:
        out = []
        while chunk := await self.read_some():
            out.append(chunk)
        return b"".join(out)

    def end_first(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def release(self) -> None:
        self.released = True


def answer(body: dict, **kw: Any) -> FakeResponse:
    return FakeResponse([orjson.dumps(body)], **kw)


def stream(*texts: str, **kw: Any) -> FakeResponse:
    chunks = [b'data: {"choices":[{"text":"%s"}]}\n\n' % t.encode() for t in texts] + [b"data: [DONE]\n\n"]
    return FakeResponse(chunks, content_type=b"text/event-stream", **kw)


def completion(text: str = "ok", kv: dict | None = None, cached: int | None = None) -> dict:
    usage: dict[str, Any] = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "choices": [{"index": 0, "text": text}],
        "usage": usage,
        "kv_transfer_params": kv,
    }


class FakeUpstream:
    """Answers each leg with what the test queued for that engine url (a response, an error, or a
    function of the request body that returns one), else for that leg kind ("prefill", "decode"),
    whichever engine it goes to."""

    def __init__(self) -> None:
        self.script: dict[str, deque[Any]] = defaultdict(deque)
        self.calls: list[tuple[str, str, dict]] = []  # (url, leg, body)
        self.paths: list[str] = []  # the route of each call

    def on(self, url: str, *answers: Any) -> None:
        self.script[url].extend(answers)

    async def post(
        self, ep: Any, path: str, body: dict, request_id: str, *, leg: str, headers: dict | None = None
    ) -> FakeResponse:
        self.calls.append((ep.url, leg, body))
        self.paths.append(path)
        queue = self.script[ep.url] or self.script[leg]
        if not queue:
            raise AssertionError(f"nothing scripted for {ep.url} ({leg})")
        got = queue.popleft()
        if callable(got) and not isinstance(got, BaseException):  # an answer made from the request body
            got = got(body)
        if isinstance(got, BaseException):
            if isinstance(got, EngineError) and got.code == "engine_unreachable" and not isinstance(got, EngineGone):
                ep.mark_down("connect failed")
            raise got
        return got

    async def read_json(self, resp: FakeResponse, leg: str) -> dict:
        return orjson.loads(await resp.read())


def unreachable() -> EngineError:
    return EngineError(502, "Could not reach an engine.", code="engine_unreachable")


class Recorder:
    """A lifecycle subscriber that writes down every event."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []

    def on_routed(self, ctx: RequestContext, decision: Decision) -> None:
        self.events.append(("routed", decision))

    def on_leg_done(self, ctx: RequestContext, leg: LegReport) -> None:
        self.events.append(("leg", leg))

    def on_finished(self, ctx: RequestContext, decision: Decision, result: Finished) -> None:
        self.events.append(("finished", result))

    def legs(self) -> list[LegReport]:
        return [e for kind, e in self.events if kind == "leg"]


@dataclass
class Sent:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return orjson.loads(self.body)


@dataclass
class Harness:
    cfg: GatewayConfig
    tokenizers: Tokenizers
    upstream: FakeUpstream = field(default_factory=FakeUpstream)
    recorder: Recorder = field(default_factory=Recorder)
    spans: Any = None  # an OpenTelemetry span exporter: traces on (the SDK's in-memory one, say)

    def __post_init__(self) -> None:
        self.pools = Pools(self.cfg.pools.prefill.urls, self.cfg.pools.decode.urls)
        for ep in self.pools.all():
            ep.mark_up()
        self.index = PrefixIndex()
        self.estimates = EngineEstimates()
        self.beliefs = PrefixBeliefs(self.index, InFlightPrefixes(), caching_off=self.pools.caching_off)
        self.metrics = GatewayMetrics(self.pools)
        self.hook_errors: list[tuple[str, str]] = []
        self.gate = Gate(self.cfg.admission.max_in_flight)
        router = Router(self.cfg.routing, self.pools, self.index, None, self.beliefs.in_flight, self.estimates)
        hooks = Hooks(
            [("recorder", self.recorder), ("prefix_beliefs", self.beliefs), ("engine_estimates", self.estimates)],
            lambda *a: self.hook_errors.append(a),
        )
        runtime = Runtime(self.cfg, "test", router, self.upstream, self.tokenizers, hooks)  # type: ignore[arg-type]
        self.access: list[dict] = []  # the access log's lines, parsed
        access = AccessLog(sink=lambda line: self.access.append(orjson.loads(line)))
        services = Services(
            self.pools, self.metrics, Tracing(TracingConfig(), self.spans), access, self.gate, KVReleaser(self.upstream)
        )  # type: ignore[arg-type]
        self.gateway = Gateway(runtime, services)

    async def send(
        self,
        body: dict,
        *,
        kind: str = "completion",
        leave: asyncio.Event | None = None,
        sent: list[dict] | None = None,
    ) -> Sent:
        """Run one request; ``leave`` set: the client disconnects then. Waits for the hooks too."""
        path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        raw = orjson.dumps(body)
        scope = {
            "type": "http",
            "method": "POST",
            "path": path,
            "query_string": b"",
            "http_version": "1.1",
            "headers": [(b"content-type", b"application/json")],
            "state": {"gw": self.gateway},
        }
        delivered = False
        messages = sent if sent is not None else []

        async def receive() -> dict:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": raw, "more_body": False}
            await (leave or asyncio.Event()).wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            messages.append(message)

        await InferenceEndpoint(kind, path)(scope, receive, send)  # type: ignore[arg-type]
        for _ in range(5):  # the hooks run on the loop's next turns
            await asyncio.sleep(0)
        start = next((m for m in messages if m["type"] == "http.response.start"), None)
        body_out = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body")
        headers = {k.decode(): v.decode() for k, v in (start or {}).get("headers", [])}
        return Sent(start["status"] if start else 0, headers, body_out)

    def close(self) -> None:
        self.tokenizers.close()


def make(tokenizer_dir: Path, spans: Any = None, **overrides: Any) -> Harness:
    """A harness with one prefill engine and two decode engines; ``overrides`` replace config sections;
    ``spans``: a span exporter (tracing on)."""
    data: dict[str, Any] = {
        "models": [{"name": "tiny", "tokenizer": str(tokenizer_dir), "max_model_len": 4096}],
        "pools": {"prefill": {"endpoints": [P]}, "decode": {"endpoints": [D, D2]}},
        "routing": {
            "decider": {"name": "token_threshold", "threshold": 64},
            "decode": {"scorers": [{"name": "prefix_affinity"}], "picker": {"name": "max_score"}},
            "prefix": {"block_size": 16},
            # every non-streamed answer assembled from its engine stream, however short (the
            # tests of that path ask for a few tokens): short ones going as sent is tested apart
            "migration": {"non_streaming_min_tokens": 0},
        },
    }
    data.update(overrides)
    cfg = parse_config(data)
    tok = ModelTokenizer.load(ModelConfig.model_validate(data["models"][0]))
    return Harness(cfg, Tokenizers([tok], TokenizerConfig()), spans=spans)
