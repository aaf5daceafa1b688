"""Engine load from each engine's own /metrics, scraped on an interval.

vLLM renamed some of these over time; both names are accepted so that an engine upgrade does not
silently zero a routing signal:

- running / waiting requests: ``vllm:num_requests_running`` / ``vllm:num_requests_waiting``;
- KV cache usage (0..1): ``vllm:kv_cache_usage_perc`` (V1), ``vllm:gpu_cache_usage_perc`` (older),
  ``vllm:cpu_cache_usage_perc`` (older CPU builds);
- block size and whether prefix caching is on: the ``block_size`` and ``enable_prefix_caching``
  labels of ``vllm:cache_config_info``; the KV blocks its GPU cache (and vLLM's own CPU tier) can
  hold: its ``num_gpu_blocks`` (``num_cpu_blocks``) label, which bounds what routing may believe
  the engine holds;
- which run of the engine this is: ``process_start_time_seconds`` (the API server's, from
  prometheus_client's process collector; absent when vLLM runs several API servers in
  Prometheus multiprocess mode) and ``vllm:request_success_total``, a counter only a restart
  takes back. ``Pools.report`` compares them with the previous report;
- the prompt tokens it served from each cache tier, ``vllm:prompt_tokens_cached_by_source`` by its
  ``source`` label (``device``, ``host``, ``disk``, ``p2p``, ``external_unspecified``; vLLM 0.32):
  what the tier beliefs are checked against (``policies/beliefs/tier_audit.py``);
- LoRA: ``vllm:lora_requests_info``, whose value is the time it was written and whose labels say
  ``max_lora`` (--max-loras) and ``running_lora_adapters`` (comma-separated names; vLLM 0.32 puts
  every adapter with a request in flight in both its running and waiting labels,
  ``vllm/v1/metrics/stats.py`` lines 694-700). Old label sets are never removed: the newest
  series is the engine's state. vLLM declares the gauge (its ``# TYPE`` line) only with LoRA on,
  and writes its first sample after its first step: the declaration says LoRA is on.

Series with several label sets (one per engine core or model) are summed (requests) or maxed (usage).
Parsing is a line scan for these names only: a vLLM metrics page is ~1,000 lines of histograms the
gateway does not need.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time

import aiohttp

from gateway.background import cancel_checkpoint, stop_task
from gateway.config import SignalsConfig
from gateway.engines.pools import Endpoint, EngineStats, Pools

log = logging.getLogger(__name__)

RUNNING = ("vllm:num_requests_running",)
WAITING = ("vllm:num_requests_waiting",)
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "vllm:cpu_cache_usage_perc")
CACHE_INFO = "vllm:cache_config_info"
START_TIME = "process_start_time_seconds"
SERVED = "vllm:request_success_total"
LORA_INFO = "vllm:lora_requests_info"
LORA_DECLARED = "# TYPE " + LORA_INFO  # vLLM declares the gauge only with LoRA on
CACHED_BY_SOURCE = ("vllm:prompt_tokens_cached_by_source_total", "vllm:prompt_tokens_cached_by_source")
MAX_PAGE_BYTES = 8 << 20

# Integer labels are at most 18 digits: a longer one does not match (is not read) rather than
# outgrowing int64 or raising past int()'s 4300-digit limit.
_BLOCK_SIZE = re.compile(r'[{,]block_size="(\d{1,18})"')
_PREFIX_CACHING = re.compile(r'enable_prefix_caching="(\w+)"')
_GPU_BLOCKS = re.compile(r'[{,]num_gpu_blocks="(\d{1,18})"')
_CPU_BLOCKS = re.compile(r'[{,]num_cpu_blocks="(\d{1,18})"')
_SOURCE = re.compile(r'[{,]source="(\w+)"')
_MAX_LORA = re.compile(r'[{,]max_lora="(\d{1,18})"')
_RUNNING_LORAS = re.compile(r'[{,]running_lora_adapters="([^"]*)"')


def _value(line: str) -> float | None:
    """A sample's value; None (the sample is not read) when it is not a finite number: NaN and
    +-Inf are legal in the text format, but no count, usage or time."""
    try:
        v = float(line.rsplit(" ", 1)[1])
    except (IndexError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _count(total: float) -> int:
    """A summed request count; finite samples can still sum past a float's range, read as absent."""
    return int(total) if math.isfinite(total) else 0


def parse_stats(text: str, at: float) -> EngineStats | None:
    """The signals in a Prometheus text page, or None when it has none of them (not a vLLM engine)."""
    page = _Page()
    for line in text.splitlines():
        if line.startswith(START_TIME):
            page.started = _value(line)
        elif line.startswith(LORA_DECLARED):  # LoRA on, before the gauge's first sample
            page.lora = True
        elif line.startswith("vllm:"):
            page.read(line.split("{", 1)[0].split(" ", 1)[0], line)
    if not page.seen:
        return None
    return EngineStats(
        _count(page.running),
        _count(page.waiting),
        page.kv,
        page.block_size,
        at,
        page.caching,
        page.started,
        page.served,
        page.gpu_blocks,
        page.cpu_blocks,
        page.by_source,
        page.lora_slots,
        page.lora_active,
        page.lora,
    )


class _Page:
    """What ``parse_stats`` has read so far of one page."""

    def __init__(self) -> None:
        self.running = self.waiting = 0.0
        self.kv: float | None = None
        self.block_size: int | None = None
        self.caching: bool | None = None
        self.gpu_blocks: int | None = None
        self.cpu_blocks: int | None = None
        self.started: float | None = None
        self.served: float | None = None
        self.by_source: dict[str, float] | None = None
        self.seen = False  # any engine load signal at all
        self.lora = False  # the engine runs with LoRA on
        self.lora_slots: int | None = None
        self.lora_active: frozenset[str] = frozenset()
        self._lora_at = -1.0  # the newest lora_requests_info series' value (when it was written)

    def read(self, name: str, line: str) -> None:
        if name == CACHE_INFO:
            self._cache_info(line)
            return
        v = _value(line)
        if v is None:
            return
        if name in RUNNING or name in WAITING:
            self.seen = True
            if name in RUNNING:
                self.running += v
            else:
                self.waiting += v
        elif name in KV_USAGE:
            self.seen = True
            self.kv = v if self.kv is None else max(self.kv, v)
        elif name == SERVED:
            self.served = (self.served or 0.0) + v
        elif name == LORA_INFO and v > self._lora_at and (m := _MAX_LORA.search(line)):
            self._lora_at, self.lora_slots, self.lora = v, int(m.group(1)), True
            running = _RUNNING_LORAS.search(line)
            self.lora_active = frozenset(n for n in (running.group(1) if running else "").split(",") if n)
        elif name in CACHED_BY_SOURCE and (m := _SOURCE.search(line)):
            by_source = self.by_source = self.by_source if self.by_source is not None else {}
            by_source[m.group(1)] = by_source.get(m.group(1), 0.0) + v

    def _cache_info(self, line: str) -> None:
        if self.block_size is not None:
            return
        if m := _BLOCK_SIZE.search(line):
            self.block_size = int(m.group(1))
        if m := _PREFIX_CACHING.search(line):
            self.caching = m.group(1).lower() == "true"
        self.gpu_blocks, self.cpu_blocks = _label_int(_GPU_BLOCKS, line), _label_int(_CPU_BLOCKS, line)


def _label_int(pattern: re.Pattern[str], line: str) -> int | None:
    """An integer label's value (vLLM writes "None" for one not set: None)."""
    m = pattern.search(line)
    return int(m.group(1)) if m else None


class StatsScraper:
    """Keeps every endpoint's ``stats`` fresh; a failed scrape leaves the old value to age out."""

    def __init__(self, pools: Pools, session: aiohttp.ClientSession, cfg: SignalsConfig) -> None:
        self._pools = pools
        self._session = session
        self.configure(cfg)
        self._task: asyncio.Task[None] | None = None
        self.failures = 0

    def configure(self, cfg: SignalsConfig) -> None:
        self._cfg = cfg
        self._timeout = aiohttp.ClientTimeout(total=cfg.scrape_timeout_s)

    async def scrape(self, ep: Endpoint) -> bool:
        """One scrape of ``ep``; False when it failed or the page had no engine signals."""
        try:
            async with self._session.get(ep.url + "/metrics", timeout=self._timeout) as resp:
                if resp.status != 200:
                    raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
                raw = await resp.content.read(MAX_PAGE_BYTES)
        except (aiohttp.ClientError, TimeoutError, OSError) as err:
            self.failures += 1
            log.debug("metrics scrape of %s failed: %s", ep.url, type(err).__name__)
            return False
        stats = parse_stats(raw.decode("utf-8", "replace"), time.monotonic())
        if stats is None:
            return False
        self._pools.report(ep, stats)
        return True

    async def recovered(self, ep: Endpoint) -> None:
        """``ep`` answers its health check again after being down: is it the same run of the
        engine? Without a report that can tell, it is taken as a new one (what the gateway had
        learned about its cache would otherwise send prompts there as cached when they are not)."""
        before = ep.stats
        if not await self.scrape(ep):
            self._pools.restarted(ep, "it was down and its /metrics did not answer")
        elif before is None or (before.started_at is None and before.served is None):
            self._pools.restarted(ep, "it was down and its /metrics cannot tell a restart")
        # else: ``report`` compared this run with the last one

    async def scrape_all(self) -> None:
        await asyncio.gather(*(self.scrape(ep) for ep in self._pools.all()))

    async def _run(self) -> None:
        while True:
            try:
                await self.scrape_all()
            except Exception:  # one bad round must not end scraping for good (not BaseException)
                log.exception("metrics scrape round failed")
            cancel_checkpoint()  # a cancel a library swallowed ends the loop here (gateway/background.py)
            await asyncio.sleep(self._cfg.scrape_interval_s)

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="engine-stats")

    async def stop(self) -> None:
        """Bounded (gateway/background.py): a stuck scrape or a swallowed cancel cannot hang shutdown."""
        task, self._task = self._task, None
        await stop_task(task)
