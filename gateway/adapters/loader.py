"""Dynamic loading: a configured adapter that the engine routing picked does not list is loaded
there first, through vLLM's ``POST /v1/load_lora_adapter`` (the engines need
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``; ``vllm/entrypoints/serve/lora/api_router.py``).

- **Once per engine**: concurrent requests for the same adapter on the same engine wait for the
  one load in flight (single flight), each for at most ``lora.load_timeout_s``; the load itself is
  bounded by the same time and is not cancelled by a waiter that gives up.
- vLLM answers 200 with a text body on success, 400 "already been loaded" when another gateway
  loaded it first (taken as success), 404 when the path holds no adapter and 500 when the engine
  cannot take it (e.g. its rank over ``--max-lora-rank``): those fail the request with 503 and the
  engine's message (``vllm/entrypoints/openai/models/serving.py`` lines 198-213, 266-275).
- **Bounded**: with ``lora.max_adapters_per_engine``, loading one more on an engine unloads the
  least recently used adapter this gateway loaded there that has no request running and none
  routed there in the last ``lora.unload_idle_s`` (``/v1/unload_lora_adapter``). The engine's
  running list shows a request only once the engine has it, a scrape later: without that wait an
  adapter a request was on its way to could go (seen in bench/adapters.py as the engine's 404).
  vLLM's unload removes the name from the engine's list; the weights leave its LRU cache when room
  is needed (``serving.py`` lines 231-245).

What was loaded shows in ``pdgate_adapter_loads_total{result}`` and
``pdgate_adapter_unloads_total{result}``, and each request's access-log line lists its loads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass

import aiohttp
import orjson

from gateway.adapters.catalogue import Adapter
from gateway.config import LoraConfig
from gateway.engines.pools import Endpoint, Pools

log = logging.getLogger(__name__)

MAX_ANSWER_BYTES = 64 << 10  # an error message, not a stream
MESSAGE_CHARS = 300  # of the engine's message, in the client's error


class AdapterUnavailable(Exception):
    """The adapter could not be loaded on an engine routing picked."""

    def __init__(self, message: str, *, timeout: bool = False) -> None:
        super().__init__(message)
        self.timeout = timeout


@dataclass(frozen=True, slots=True)
class LoadReport:
    """One load a request waited for (its access-log line)."""

    engine: str
    result: str  # loaded, joined (another request's load), failed, timeout
    seconds: float

    def as_dict(self) -> dict[str, object]:
        return {"engine": self.engine, "result": self.result, "seconds": round(self.seconds, 4)}


class AdapterLoader:
    def __init__(self, pools: Pools, session: aiohttp.ClientSession, cfg: LoraConfig) -> None:
        self._pools = pools
        self._session = session
        self.configure(cfg)
        self._loading: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._loaded: dict[str, OrderedDict[str, None]] = {}  # url -> adapters this gateway loaded, LRU first
        # (url, adapter) -> when a request was last routed there with it: an adapter a request may
        # still be on its way to is not unloaded (the engine's running list shows it only once the
        # engine has the request, and a scrape later)
        self._routed: dict[tuple[str, str], float] = {}
        self.loads: Counter[str] = Counter()  # by result: ok, failed, timeout
        self.unloads: Counter[str] = Counter()  # by result: ok, failed

    def configure(self, cfg: LoraConfig) -> None:
        self.enabled = cfg.dynamic_loading
        self.timeout_s = cfg.load_timeout_s
        self.max_per_engine = cfg.max_adapters_per_engine
        self.unload_idle_s = cfg.unload_idle_s

    def needs(self, ep: Endpoint, adapter: Adapter) -> bool:
        """Whether ``ep`` must load ``adapter`` before serving it (and dynamic loading may)."""
        served = ep.served_models
        return self.enabled and adapter.configured and (served is None or adapter.name not in served)

    async def ensure(self, eps: list[Endpoint], adapter: Adapter) -> list[LoadReport]:
        """Every engine in ``eps`` lists ``adapter`` after this, or AdapterUnavailable is raised
        (the first failure's message); the loads waited for, as reported."""
        todo = [ep for ep in eps if self.needs(ep, adapter)]
        now = time.monotonic()
        for ep in eps:
            self._routed[(ep.url, adapter.name)] = now
            if ep not in todo and ep.url in self._loaded and adapter.name in self._loaded[ep.url]:
                self._loaded[ep.url].move_to_end(adapter.name)  # used: the last to be unloaded
        if not todo:
            return []
        results = await asyncio.gather(*(self._one(ep, adapter) for ep in todo), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return [r for r in results if isinstance(r, LoadReport)]

    async def _one(self, ep: Endpoint, adapter: Adapter) -> LoadReport:
        key = (ep.url, adapter.name)
        task = self._loading.get(key)
        joined = task is not None
        if task is None:
            task = self._loading[key] = asyncio.create_task(self._load(ep, adapter), name=f"lora-load-{adapter.name}")
            task.add_done_callback(lambda t: self._done(key, t))
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(self.timeout_s):
                await asyncio.shield(task)
        except TimeoutError:
            raise AdapterUnavailable(
                f"LoRA adapter `{adapter.name}` is still loading on {ep.url} after {self.timeout_s:g} s", timeout=True
            ) from None
        return LoadReport(ep.url, "joined" if joined else "loaded", time.perf_counter() - t0)

    def _done(self, key: tuple[str, str], task: asyncio.Task[None]) -> None:
        if self._loading.get(key) is task:
            del self._loading[key]
        if not task.cancelled():
            task.exception()  # retrieved: a failure every waiter gave up on is not an unhandled one

    async def _load(self, ep: Endpoint, adapter: Adapter) -> None:
        body = {"lora_name": adapter.name, "lora_path": adapter.path}
        try:
            status, text = await self._post(ep.url + "/v1/load_lora_adapter", body)
        except TimeoutError:
            self.loads["timeout"] += 1
            raise AdapterUnavailable(f"LoRA adapter `{adapter.name}`: {ep.url} did not load it in time") from None
        except (aiohttp.ClientError, OSError) as err:
            self.loads["failed"] += 1
            raise AdapterUnavailable(
                f"LoRA adapter `{adapter.name}`: {ep.url} could not be asked to load it ({type(err).__name__})"
            ) from None
        if status != 200 and not (status == 400 and "already been loaded" in text):
            self.loads["failed"] += 1
            log.warning("loading LoRA adapter %s on %s failed: HTTP %d %s", adapter.name, ep.url, status, text[:300])
            raise AdapterUnavailable(
                f"LoRA adapter `{adapter.name}` could not be loaded on {ep.url} (HTTP {status}): "
                f"{_message(text)[:MESSAGE_CHARS]}"
            )
        self.loads["ok"] += 1
        log.info("loaded LoRA adapter %s on %s", adapter.name, ep.url)
        self._listed(ep, adapter)
        await self._bound(ep, adapter.name)

    def _listed(self, ep: Endpoint, adapter: Adapter) -> None:
        """``ep`` lists ``adapter`` now (until its next /v1/models read says otherwise)."""
        served = (ep.served_models or frozenset()) | {adapter.name}
        self._pools.set_served(ep, served, {**ep.adapters, adapter.name: (adapter.path, adapter.base)})
        self._loaded.setdefault(ep.url, OrderedDict())[adapter.name] = None

    async def _bound(self, ep: Endpoint, just_loaded: str) -> None:
        loaded = self._loaded[ep.url]
        if not self.max_per_engine or len(loaded) <= self.max_per_engine:
            return
        active = ep.stats.lora_active if ep.stats is not None else frozenset()
        recent = time.monotonic() - self.unload_idle_s
        for name in list(loaded):
            if len(loaded) <= self.max_per_engine:
                return
            busy = name in active or self._routed.get((ep.url, name), 0.0) > recent
            if name == just_loaded or busy or (ep.url, name) in self._loading:
                continue
            await self._unload(ep, name)

    async def _unload(self, ep: Endpoint, name: str) -> None:
        try:
            status, text = await self._post(ep.url + "/v1/unload_lora_adapter", {"lora_name": name})
        except (aiohttp.ClientError, OSError, TimeoutError) as err:
            self.unloads["failed"] += 1
            log.warning("unloading LoRA adapter %s on %s failed: %s", name, ep.url, type(err).__name__)
            return
        if status not in (200, 404):  # 404: not there any more, which is what was wanted
            self.unloads["failed"] += 1
            log.warning("unloading LoRA adapter %s on %s failed: HTTP %d %s", name, ep.url, status, text[:300])
            return
        self.unloads["ok"] += 1
        log.info("unloaded LoRA adapter %s on %s (the least recently used it loaded there)", name, ep.url)
        self._loaded[ep.url].pop(name, None)
        served = (ep.served_models or frozenset()) - {name}
        self._pools.set_served(ep, served, {k: v for k, v in ep.adapters.items() if k != name})

    async def _post(self, url: str, body: dict[str, str]) -> tuple[int, str]:
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with self._session.post(url, json=body, timeout=timeout) as resp:
            raw = await resp.content.read(MAX_ANSWER_BYTES)
            return resp.status, raw.decode("utf-8", "replace")

    def forget(self, url: str) -> None:
        """``url`` left or restarted: what this gateway loaded there is gone with it."""
        self._loaded.pop(url, None)
        self._routed = {k: t for k, t in self._routed.items() if k[0] != url}

    async def close(self) -> None:
        """Bounded: loads in flight are cancelled (their waiters get AdapterUnavailable or cancel)."""
        tasks = list(self._loading.values())
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=2.0)


def _message(text: str) -> str:
    """vLLM's error message out of its JSON error body (``{"error": {"message": ...}}``, or a bare
    ``{"error": "..."}``), else the text as it is. Any body shape gives a message: an exception
    here would fail the request with 500 instead of the 503 a failed load is."""
    try:
        data = orjson.loads(text)
    except ValueError:
        return text
    err = data.get("error") if isinstance(data, dict) else None
    msg = err.get("message") if isinstance(err, dict) else err
    return msg if isinstance(msg, str) and msg else text
