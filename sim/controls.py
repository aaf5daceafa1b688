"""The simulator's own routes, ``/sim/*`` (not in vLLM): test instrumentation and fault control.

* ``GET /sim/requests``: ``{"engine_id", "role", "requests": [...]}`` with the last 1000
  generation requests, oldest first. Each record: ``request_id`` (the X-Request-Id header,
  or null), ``headers`` (all request headers, lower-case names), ``response_id``,
  ``internal_ids`` (engine request ids; a prefill leg's is its ``remote_request_id``),
  ``endpoint``, ``body`` (the JSON body exactly as received, parsed), ``kind``
  (plain|prefill|decode, null if the body was unusable), ``stream``, ``status``
  (running|completed|aborted|failed), ``http_status``, ``finish_reasons``,
  ``error``, ``kv_transfer_params`` (what the response carried), and wall-clock
  timestamps ``received_at``, ``first_token_at``, ``finished_at``.
* ``DELETE /sim/requests``: forget them.
* ``GET /sim/state``: scheduler and KV snapshot (running, waiting, free blocks, held
  prefill handles, cached blocks, the KV event endpoints as bound and messages published,
  the faults and how often each was injected); ``tiers`` (null without ``--cpu-blocks``): the
  L1's occupancy (``l1: {blocks, capacity, pinned}``), tokens served by each tier, blocks
  stored and evicted, and the shared L2 (``l2: {store, url, key_prefix, capacity, blocks,
  reachable, errors}``, ``blocks`` null while the store does not answer); ``lora`` (null without
  ``--enable-lora``): ``adapters`` served (name -> ``{id, path}``), the engine's ``loaded`` ones
  (least recently used first), ``loads``, ``evictions``, ``in_flight`` (requests per adapter, as
  ``vllm:lora_requests_info`` sees them) and ``deferred`` (waiting for a ``--max-loras`` slot).
* ``GET /sim/faults``, ``PUT /sim/faults`` (JSON spec, replaces the faults), ``DELETE
  /sim/faults`` (no faults, counters reset): fault injection (:mod:`engine_model.faults`), answering
  ``{"faults": {...}, "injected": {...}}``; a bad spec gets 400 ``{"detail": ...}``.
* ``POST /sim/crash``: answers, then exits the process at once (no shutdown, connections cut).

The handlers find their engine's :class:`~sim.state.SimState` on ``request.app.state.sim``. Kept
apart from the vLLM routes (:mod:`sim.app`) so that what a gateway could see on a real engine
and what only tests use stay distinct.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import orjson
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from engine_model.faults import FaultSpecError
from sim.asgi import json_response
from sim.state import SimState

log = logging.getLogger("sim.app")  # the app's logger, one name for all its modules


def _sim(request: Request) -> SimState:
    state: SimState = request.app.state.sim
    return state


async def sim_requests(request: Request) -> Response:
    state = _sim(request)
    if request.method == "DELETE":
        state.records.items.clear()
        return json_response({"cleared": True})
    cfg = state.cfg
    return json_response({"engine_id": cfg.engine_id, "role": cfg.role, "requests": list(state.records.items)})


async def sim_state(request: Request) -> Response:
    state = _sim(request)
    cfg = state.cfg
    e = state.engine
    if e is None:
        return json_response({"ready": False}, 503)
    tiers = e.tier_state()
    if tiers is not None and e.tiers is not None and e.tiers.l2 is not None:
        tiers["l2"]["blocks"] = await e.tiers.l2.size()  # bounded by l2_timeout; None if unreachable
    return json_response(
        {
            "ready": True,
            "engine_id": cfg.engine_id,
            "role": cfg.role,
            "kv_host": cfg.advertised_kv_host,
            "kv_port": e.kv_port,
            "running": len(e.running),
            "waiting": len(e.waiting) + len(e.ready_kv) + len(e.probing),
            "kv_loading": len(e.remote_kv),
            "free_blocks": e.pool.num_free,
            "total_blocks": e.total_blocks,
            "kv_cache_usage": e.kv_usage(),
            "held": {rid: len(h.block_ids) for rid, h in e.held.items()},
            "prefix_caching": cfg.enable_prefix_caching,
            "cached_blocks": e.pool.num_cached,
            "tiers": tiers,
            "profile": cfg.profile,
            "time_scale": cfg.time_scale,
            "faults": state.faults.snapshot(),
            "lora": _lora_state(state),
            "kv_events": None
            if state.publisher is None
            else {
                "endpoint": state.publisher.endpoint,
                "replay_endpoint": state.publisher.replay_endpoint,
                "topic": cfg.kv_events_config.topic,
                "published": state.publisher.published,
                "dropped": state.publisher.dropped,
            },
        }
    )


def _lora_state(state: SimState) -> dict[str, Any] | None:
    """The adapters served (name -> id, path) and the engine's cache; None without --enable-lora."""
    e = state.engine
    snap = e.lora_snapshot() if e is not None else None
    if snap is None:
        return None
    snap["adapters"] = {n: {"id": lr.int_id, "path": lr.path} for n, lr in state.loras.requests.items()}
    return snap


async def sim_faults(request: Request) -> Response:
    state = _sim(request)
    if request.method == "PUT":
        try:
            state.faults.configure(orjson.loads(await request.body()))
        except orjson.JSONDecodeError as e:
            return json_response({"detail": f"body is not valid JSON: {e}"}, 400)
        except FaultSpecError as e:
            return json_response({"detail": str(e)}, 400)
    elif request.method == "DELETE":
        state.faults.clear()
    return json_response(state.faults.snapshot())


async def sim_crash(request: Request) -> Response:
    state = _sim(request)
    log.warning("POST /sim/crash: exiting now")
    return json_response({"crashing": True, "pid": os.getpid()}, background=BackgroundTask(state.exit, 1))


ROUTES = [
    Route("/sim/requests", sim_requests, methods=["GET", "DELETE"]),
    Route("/sim/state", sim_state, methods=["GET"]),
    Route("/sim/faults", sim_faults, methods=["GET", "PUT", "DELETE"]),
    Route("/sim/crash", sim_crash, methods=["POST"]),
]
