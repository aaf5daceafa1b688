"""LoRA adapters as vLLM 0.32 serves them (``--enable-lora``): the request's adapter, the
``--lora-modules`` items, an adapter folder's checks, and the engine side (:class:`LoRAScheduling`,
mixed into :class:`engine_model.engine.Engine`).

What is mirrored (``vllm/`` = vLLM 0.32's package):

* :class:`LoRARequest`: ``vllm/lora/request.py``. The engine tells adapters apart by their int id
  (``lora_int_id``, given by the API server's counter in load order, from 1); block hashes and KV
  events use the *name and the path* (``("lora", name, path)`` on every block,
  ``vllm/v1/core/kv_cache_utils.py:578-595``; computed by :mod:`policies.beliefs.blockhash`).
* ``--lora-modules`` items (``vllm/entrypoints/launchers/cli_args.py:38-69``): ``name=path`` when
  the item has ``=`` and no ``,``, else JSON ``{"name", "path", "base_model_name",
  "is_3d_lora_weight"}``.
* Loading (``vllm/lora/worker_manager.py:106-173``, ``vllm/lora/peft_helper.py:188-202``): a path
  that is not a folder is ``LoRAAdapterNotFoundError`` (HTTP 404); an ``adapter_config.json`` whose
  rank (``r``, or a larger one in ``rank_pattern``) exceeds ``--max-lora-rank`` fails the engine's
  ``add_lora`` call (HTTP 500). Deviation: a folder without ``adapter_config.json`` is accepted
  (vLLM needs the file and the weights; the simulator has no weights).
* The worker's adapter cache (``LRUCacheWorkerLoRAManager.add_adapter``,
  ``vllm/lora/worker_manager.py:288-322``): at most ``--max-cpu-loras`` adapters loaded; every step
  loads the adapters its batch uses that are not loaded (or whose request says ``load_inplace``),
  evicting the least recently used one, and touches the others. Loading takes
  ``--lora-load-time`` (a simulator knob, x ``--time-scale``) inside that step, so it delays every
  request of the step, as the worker's synchronous load does. ``POST /v1/load_lora_adapter`` and
  the ``--lora-modules`` loaded at start-up go through the same cache (vLLM's ``add_lora`` utility
  call, run by the engine between steps).
* The scheduler's cap (``vllm/v1/core/sched/scheduler.py:889-951,1360-1361``): at most
  ``--max-loras`` distinct adapters among the requests scheduled in one step; a waiting request for
  another adapter is skipped (it keeps its place, and counts as a deferred waiting request), not
  rejected. A request whose KV is being loaded (P/D pull, offload tier) holds no adapter slot.
* ``vllm:lora_requests_info`` (``vllm/v1/metrics/loggers.py:1092-1111,1224-1236``,
  ``vllm/v1/metrics/stats.py:644-700``): after each step, the series labelled with the adapters
  that have a request in flight, comma-joined in the order they got one, in both
  ``running_lora_adapters`` and ``waiting_lora_adapters``, is set to the current Unix time. The API
  server learns of a request with its first output (token), and forgets it when it finishes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine_model.config import SimConfig
    from engine_model.metrics import SimMetrics
    from engine_model.seq import Seq

log = logging.getLogger("engine_model.engine")

MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm/config/lora.py:26 (MaxLoRARanks)


@dataclass(frozen=True)
class LoRAModule:
    """One ``--lora-modules`` item (vLLM's ``LoRAModulePath``)."""

    name: str
    path: str
    base_model_name: str | None = None
    is_3d_lora_weight: bool = False


def parse_lora_module(item: str) -> LoRAModule:
    """One ``--lora-modules`` item, as vLLM's ``LoRAParserAction`` reads it (ValueError: its message)."""
    if "=" in item and "," not in item:
        name, path = item.split("=", 1)
        return LoRAModule(name, path)
    try:
        obj = json.loads(item)
    except json.JSONDecodeError:
        raise ValueError(f"Invalid JSON format for --lora-modules: {item}") from None
    try:
        if not isinstance(obj, dict):
            raise TypeError("expected a JSON object")
        return LoRAModule(**obj)
    except TypeError as e:
        raise ValueError(f"Invalid fields for --lora-modules: {item} - {e}") from None


@dataclass(eq=False)
class LoRARequest:
    """An adapter as requests carry it (vLLM's ``LoRARequest``): compared by identity."""

    name: str
    int_id: int
    path: str
    base_model_name: str | None = None
    load_inplace: bool = False

    @cached_property
    def hash_extra(self) -> tuple[tuple[str, str, str], ...]:
        """The extra key on every block hash of its requests (vLLM's ``_gen_lora_extra_hash_keys``)."""
        return (("lora", self.name, self.path),)

    @cached_property
    def weights(self) -> bytes:
        """What its KV and output depend on: the weights, i.e. the folder (a name is only a label)."""
        return b"lora:" + self.path.encode()


class AdapterLoadError(Exception):
    """A load the engine refused, with the HTTP answer vLLM gives for it."""

    def __init__(self, message: str, status: int, err_type: str) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.err_type = err_type


def sanitize_message(message: str) -> str:
    """vLLM's ``sanitize_message`` (``vllm/entrypoints/serve/exception_handling/utils.py:7-15``): file
    paths in error bodies become ``<path>``."""
    message = re.sub(r" at 0x[0-9a-fA-F]+>", ">", message)
    message = re.sub(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+", "<path>", message)
    message = re.sub(r"(?:/[\w\-]+)+/[\w\-]+\.\w+", "<path>", message)
    return message.strip()


def _worker_failed(error: str) -> AdapterLoadError:
    # vllm/v1/engine/core.py:1751 wrapping vllm/v1/executor/multiproc_executor.py:444-447
    return AdapterLoadError(
        f"Call to add_lora method failed: Worker failed with error '{error}', please check the stack "
        "trace above for the root cause",
        500,
        "InternalServerError",
    )


def check_adapter(name: str, path: str, max_rank: int) -> None:
    """What the worker checks before loading an adapter (:class:`AdapterLoadError` if it refuses):
    the folder exists, and its ``adapter_config.json`` (if any) has no rank above ``max_rank``."""
    if not os.path.isdir(os.path.expanduser(path)):
        raise AdapterLoadError(f"Loading lora {name} failed: No adapter found for {path}", 404, "NotFoundError")
    config = os.path.join(os.path.expanduser(path), "adapter_config.json")
    if not os.path.exists(config):
        return  # deviation: vLLM needs the file (and weights); the simulator accepts a bare folder
    try:
        with open(config, encoding="utf-8") as f:
            peft = json.load(f)
        ranks = [peft["r"], *(peft.get("rank_pattern") or {}).values()]
        rank = max(int(r) for r in ranks)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise _worker_failed(f"{config}: not a usable adapter_config.json ({e})") from None
    if rank > max_rank:
        raise _worker_failed(f"LoRA rank {rank} is greater than max_lora_rank {max_rank}.")


class AdapterCache:
    """The worker's loaded adapters (``LRUCacheWorkerLoRAManager``): at most ``capacity``, by int id,
    least recently used evicted first."""

    def __init__(self, capacity: int, load_time: float) -> None:
        self.capacity = capacity
        self.load_time = load_time
        self.loaded: OrderedDict[int, LoRARequest] = OrderedDict()
        self.loads = 0
        self.evictions = 0

    def add(self, lora: LoRARequest) -> float:
        """Load ``lora`` unless loaded (then touch it); the seconds that took (unscaled)."""
        if lora.int_id in self.loaded and not lora.load_inplace:
            self.loaded.move_to_end(lora.int_id)
            return 0.0
        self.loaded.pop(lora.int_id, None)  # load_inplace: the old weights go
        if len(self.loaded) + 1 > self.capacity:
            old_id, old = self.loaded.popitem(last=False)
            self.evictions += 1
            log.debug("evicting LoRA adapter %s (id %d) from the cache", old.name, old_id)
        self.loaded[lora.int_id] = lora
        self.loads += 1
        return self.load_time

    def snapshot(self) -> list[dict[str, Any]]:
        return [{"id": i, "name": lr.name, "path": lr.path} for i, lr in self.loaded.items()]


class LoRAStates:
    """The API server's view (``LoRARequestStates``): adapter name -> ids of its requests in flight,
    in the order the adapters got one; the label of ``vllm:lora_requests_info``."""

    def __init__(self) -> None:
        self.requests: dict[str, set[str]] = {}

    def started(self, name: str, req_id: str) -> None:
        self.requests.setdefault(name, set()).add(req_id)

    def finished(self, name: str, req_id: str) -> None:
        ids = self.requests.get(name)
        if ids is not None:
            ids.discard(req_id)
            if not ids:
                del self.requests[name]

    def label(self) -> str:
        return ",".join(self.requests)


@dataclass
class LoRASlots:
    """One step's adapters: the int ids scheduled so far (the ``--max-loras`` cap)."""

    max_loras: int
    ids: set[int] = field(default_factory=set)

    def fits(self, lora: LoRARequest | None) -> bool:
        return lora is None or lora.int_id in self.ids or len(self.ids) < self.max_loras

    def add(self, lora: LoRARequest | None) -> None:
        if lora is not None:
            self.ids.add(lora.int_id)


class LoRAScheduling:
    """The engine's adapter side: its cache, the ``--max-loras`` cap, ``add_lora`` calls between
    steps, and ``vllm:lora_requests_info``. :class:`engine_model.engine.Engine` sets ``cfg``, ``m``,
    ``waiting``, ``ready_kv`` and ``_wake`` and calls :meth:`_init_loras` in its constructor."""

    cfg: SimConfig
    m: SimMetrics
    waiting: deque[Seq]
    ready_kv: deque[Seq]
    _wake: asyncio.Event

    def _init_loras(self) -> None:
        cfg = self.cfg
        self.lora_cache: AdapterCache | None = None
        self.lora_states = LoRAStates()
        self.lora_deferred: set[Seq] = set()  # waiting requests skipped for the --max-loras cap
        self._lora_calls: list[tuple[LoRARequest, asyncio.Future[None]]] = []
        self._lora_label: str | None = None
        self._lora_series: Any = None
        if cfg.enable_lora:
            self.lora_cache = AdapterCache(cfg.max_cpu_loras or cfg.max_loras, cfg.lora_load_time)

    def lora_slots(self) -> LoRASlots | None:
        return LoRASlots(self.cfg.max_loras) if self.lora_cache is not None else None

    # ------------------------------------------------------------------ add_lora (the API's loads)
    async def add_lora(self, lora: LoRARequest) -> None:
        """vLLM's engine-core ``add_lora`` utility: runs between two steps, holding the engine for
        the load. The folder checks (:func:`check_adapter`) come first, on the caller's side."""
        if self.lora_cache is None:
            raise _worker_failed("LoRA is not enabled. Use --enable-lora to enable LoRA.")
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._lora_calls.append((lora, done))
        self._wake.set()
        await done

    def preload_lora(self, lora: LoRARequest) -> None:
        """Put an adapter in the cache at once (no load time): for callers without an engine loop."""
        if self.lora_cache is not None:
            self.lora_cache.add(lora)

    async def _run_lora_calls(self) -> None:
        calls, self._lora_calls = self._lora_calls, []
        assert self.lora_cache is not None
        wait = sum(self.lora_cache.add(lora) for lora, _ in calls) * self.cfg.time_scale
        if wait:
            await asyncio.sleep(wait)
        for _, done in calls:
            if not done.done():
                done.set_result(None)

    # ------------------------------------------------------------------ steps
    def _apply_adapters(self, batch: list[tuple[Seq, int]]) -> float:
        """The worker's ``_apply_adapters`` at the start of a step: seconds spent loading."""
        cache = self.lora_cache
        if cache is None:
            return 0.0
        used: dict[int, LoRARequest] = {}
        for seq, _ in batch:
            if seq.lora is not None:
                used[seq.lora.int_id] = seq.lora
        return sum(cache.add(lora) for lora in used.values()) * self.cfg.time_scale

    def _lora_output(self, seq: Seq) -> None:
        """A LoRA request's first output reached the API server (its QUEUED and SCHEDULED events)."""
        if seq.lora is not None and self.lora_cache is not None:
            self.lora_states.started(seq.lora.name, seq.req_id)

    def _lora_done(self, seq: Seq) -> None:
        self.lora_deferred.discard(seq)
        if seq.lora is not None:
            self.lora_states.finished(seq.lora.name, seq.req_id)

    def _record_lora_info(self) -> None:
        """``vllm:lora_requests_info``, after each step (the value: the current Unix time)."""
        gauge = self.m.lora_info
        if gauge is None:
            return
        label = self.lora_states.label()
        if label != self._lora_label:
            self._lora_label = label
            self._lora_series = gauge.labels(
                max_lora=str(self.cfg.max_loras), waiting_lora_adapters=label, running_lora_adapters=label
            )
        self._lora_series.set(time.time())

    def lora_snapshot(self) -> dict[str, Any] | None:
        """For ``GET /sim/state``: the loaded adapters (least recently used first) and the counts."""
        cache = self.lora_cache
        if cache is None:
            return None
        return {
            "max_loras": self.cfg.max_loras,
            "max_cpu_loras": cache.capacity,
            "loaded": cache.snapshot(),
            "loads": cache.loads,
            "evictions": cache.evictions,
            "in_flight": {name: len(ids) for name, ids in self.lora_states.requests.items()},
            "deferred": len(self.lora_deferred),
        }
