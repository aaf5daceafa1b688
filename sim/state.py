"""What one simulated engine's app owns (:class:`SimState`): the config, the tokenizer, the engine
and its side-channel server, the KV event publisher, the fault injector, the metrics, the LoRA
adapters requests may name, and the request records behind ``GET /sim/requests`` (:class:`Records`).

Kept apart from the routes so that every route module (:mod:`sim.app`, :mod:`sim.generate`,
:mod:`sim.controls`) and the in-process tests share one definition of an engine's state, and so
that starting and stopping an engine (side channel, publisher, step loop) is in one place.
Nothing here is module-level: each app instance has its own.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from engine_model.config import SimConfig
from engine_model.engine import Engine
from engine_model.faults import Faults
from engine_model.kv import KVServer
from engine_model.kv_events import EventSink, ZmqEventPublisher
from engine_model.metrics import SimMetrics
from engine_model.tokens import load_tokenizer
from sim.asgi import Scope
from sim.lora_routes import LoRARegistry
from sim.parsing import Job
from sim.responses import VLLM_VERSION

log = logging.getLogger("sim.app")  # the app's logger, one name for all its modules


class Records:
    """The last requests the engine saw (sim-only instrumentation)."""

    def __init__(self, maxlen: int = 1000) -> None:
        self.items: deque[dict[str, Any]] = deque(maxlen=maxlen)
        self.counter = 0

    def new(self, scope: Scope, header_id: str | None, endpoint: str) -> dict[str, Any]:
        self.counter += 1
        rec: dict[str, Any] = {
            "n": self.counter,
            "request_id": header_id,
            "headers": {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]},
            "response_id": None,
            "internal_ids": [],
            "endpoint": endpoint,
            "body": None,
            "kind": None,
            "stream": False,
            "status": "running",
            "http_status": None,
            "finish_reasons": [],
            "error": None,
            "fault": None,
            "kv_transfer_params": None,
            "received_at": time.time(),
            "first_token_at": None,
            "finished_at": None,
        }
        self.items.append(rec)
        return rec


def finish_record(job: Job, rec: dict[str, Any], status: str, http_status: int) -> None:
    """Close a request's record once its response is complete."""
    rec["status"] = status
    rec["http_status"] = http_status
    rec["finish_reasons"] = [s.finish_reason for s in job.seqs]
    rec["kv_transfer_params"] = job.seqs[0].kv_out if job.seqs else None
    firsts = [s.first_token_t for s in job.seqs if s.first_token_t is not None]
    if firsts:
        rec["first_token_at"] = time.time() - (time.monotonic() - min(firsts))
    rec["finished_at"] = time.time()


class SimState:
    """Everything one app instance owns (no module-level state)."""

    def __init__(self, cfg: SimConfig, event_sink: EventSink | None = None) -> None:
        """``event_sink``: receives KV events instead of a ZMQ publisher (in-process tests)."""
        self.cfg = cfg
        self.event_sink = event_sink
        self.metrics = SimMetrics(cfg)
        self.tok = load_tokenizer(cfg.tokenizer)
        self.engine: Engine | None = None
        self.kv_server: KVServer | None = None
        self.publisher: ZmqEventPublisher | None = (
            ZmqEventPublisher(cfg.kv_events_config, bind_host=cfg.host) if cfg.kv_events_config.active else None
        )
        self.records = Records()
        self.loras = LoRARegistry(cfg)  # the LoRA adapters requests may name
        self.faults = Faults(cfg.faults)
        self.exit: Callable[[int], None] = os._exit  # POST /sim/crash (tests in-process replace it)
        digest = hashlib.sha256(
            f"{cfg.model}|{cfg.max_model_len}|{cfg.block_size}|{cfg.tokenizer}".encode()
        ).hexdigest()
        self.fingerprint = f"vllm-{VLLM_VERSION}-{digest[:8]}"
        self.created = int(time.time())

    async def start(self) -> None:
        if self.publisher is not None:
            await asyncio.to_thread(self.publisher.start)
        sink = self.event_sink if self.event_sink is not None else self.publisher
        l2 = None
        cfg = self.cfg
        if cfg.l2_url:
            from engine_model.l2_redis import RedisL2

            l2 = RedisL2(cfg.l2_url, cfg.l2_key_prefix, cfg.l2_blocks, cfg.l2_timeout)
        engine = Engine(self.cfg, self.metrics, self.tok.output_vocab, publisher=sink, faults=self.faults, l2=l2)
        self.kv_server = KVServer(
            {"read": engine.kv_read, "notify": engine.kv_notify, "hb": engine.kv_heartbeat},
            self.cfg.host,
            self.cfg.kv_port,
        )
        engine.kv_port = await self.kv_server.start()
        await engine.start()
        self.engine = engine
        try:
            await self.loras.load_static(engine)  # --lora-modules, through the engine's add_lora
        except ValueError:
            await self.stop()
            raise
        log.info(
            "sim engine %s (role %s, model %s) side channel on %s:%s",
            self.cfg.engine_id,
            self.cfg.role,
            self.cfg.model,
            self.cfg.advertised_kv_host,
            engine.kv_port,
        )

    async def stop(self) -> None:
        if self.kv_server is not None:
            await self.kv_server.close()
        if self.engine is not None:
            await self.engine.stop()
        if self.publisher is not None:
            await asyncio.to_thread(self.publisher.shutdown)
