"""The engine's Prometheus metrics, with vLLM 0.32's names, types, labels and buckets.

Everything lives in a registry owned by one ``SimMetrics`` (no global state). Label
values are ``model_name=<served model name>`` and ``engine="0"``, as a single-engine
``vllm serve`` reports them. Counters show up as ``<name>_total`` (prometheus_client's
convention, which vLLM shares).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from typing import Any, TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

from engine_model.config import SimConfig

# Bucket boundaries of vLLM 0.32 (vllm/v1/metrics/buckets.py and the NIXL stats module).
REQUEST_LATENCY_BUCKETS = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
]  # fmt: skip
TTFT_BUCKETS = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
]  # fmt: skip
ITL_BUCKETS = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
]  # fmt: skip
ITERATION_TOKENS_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
REQUEST_PARAMS_N_BUCKETS = [1, 2, 5, 10, 20]
REQUEST_NUM_PREEMPTIONS_BUCKETS = [1, 2, 3, 4, 5, 10, 20]
NIXL_TIME_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0]
NIXL_BYTES_BUCKETS = [2 ** (10 + i) for i in range(1, 25, 2)]
NIXL_DESCRIPTORS_BUCKETS = [
    10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000,
]  # fmt: skip

FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
CACHE_HIT_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")
KV_FETCH_STAGES = ("waiting_to_start", "in_progress", "completed_waiting")


def build_1_2_5_buckets(max_value: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    out: list[float] = []
    exp = 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exp
            if v > max_value:
                return out
            out.append(v)
        exp += 1


def cache_config_labels(cfg: SimConfig) -> dict[str, str]:
    """The label set of vllm:cache_config_info: vLLM stringifies every CacheConfig field."""
    return {
        "block_size": str(cfg.block_size),
        "user_specified_block_size": str(cfg.block_size != 16),
        "kv_cache_layout": "None",
        "prefix_match_unit": "None",
        "gpu_memory_utilization": "0.92",
        "cache_dtype": "auto",
        "is_attention_free": "False",
        "num_gpu_blocks_override": "None",
        "sliding_window": "None",
        "enable_prefix_caching": str(cfg.enable_prefix_caching),
        "prefix_caching_hash_algo": cfg.prefix_caching_hash_algo,
        "prefix_cache_retention_interval": "0",
        "kv_cache_dtype_skip_layers": "[]",
        "mamba_page_size_padded": "None",
        "skip_page_size_padded": "None",
        "mamba_block_size": "None",
        "mamba_cache_dtype": "auto",
        "mamba_ssm_cache_dtype": "float32",
        "mamba_cache_mode": "none",
        "enable_mamba_shared_prefix_checkpoint": "False",
        "replayssm_buffer_len": "16",
        "use_replayssm": "False",
        "use_kda_recoverssm": "False",
        "num_gpu_blocks": str(cfg.num_gpu_blocks),
        "num_cpu_blocks": "None",
        "effective_attention_block_size": str(cfg.block_size),
        "kv_cache_size_tokens": str(cfg.num_gpu_blocks * cfg.block_size),
        "kv_cache_max_concurrency": str(round(cfg.num_gpu_blocks * cfg.block_size / cfg.max_model_len, 2)),
        "hash_block_size": "None",
        "cache_hit_alignment_tokens": "None",
        "kv_sharing_fast_prefill": "False",
        "swa_bounded_replay": "True",
        "kv_cache_memory_bytes": str(cfg.num_gpu_blocks * cfg.block_size * cfg.kv_bytes_per_token),
        "kv_offloading_size": str(cfg.cpu_blocks * cfg.block_size * cfg.kv_bytes_per_token / 2**30)
        if cfg.cpu_blocks
        else "None",
        "kv_offloading_backend": "native",
        "_block_size_resolved": "True",
        "engine": "0",
    }


class _LazyCounter:
    """Counts in a plain int; handed to prometheus_client when scraped (keeps the hot path cheap)."""

    __slots__ = ("child", "pending")

    def __init__(self, child: Any) -> None:
        self.child = child
        self.pending: float = 0

    def inc(self, amount: float = 1) -> None:
        self.pending += amount

    def flush(self) -> None:
        if self.pending:
            self.child.inc(self.pending)
            self.pending = 0


class _LazyHistogram:
    """Counts observations per bucket in Python; added to the prometheus_client histogram
    on scrape (through its per-bucket values, which is what ``observe`` updates)."""

    __slots__ = ("bounds", "child", "counts", "total")

    def __init__(self, child: Any) -> None:
        self.child = child
        self.bounds: list[float] = list(child._upper_bounds)  # ends with +Inf
        self.counts = [0] * len(self.bounds)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def flush(self) -> None:
        if not any(self.counts):
            return
        child = self.child
        child._sum.inc(self.total)
        for i, c in enumerate(self.counts):
            if c:
                child._buckets[i].inc(c)
        self.counts = [0] * len(self.bounds)
        self.total = 0.0


_Lazy = TypeVar("_Lazy", _LazyCounter, _LazyHistogram)


class SimMetrics:
    """All of one engine's metrics, pre-bound to its label values.

    Counters and histograms the engine touches per token are lazy: values accumulate in
    Python and reach the prometheus_client objects when ``render()`` runs.
    """

    def __init__(self, cfg: SimConfig) -> None:
        self.registry = reg = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=reg)
        PlatformCollector(registry=reg)
        GCCollector(registry=reg)
        names = ["model_name", "engine"]
        lv = (cfg.model, "0")

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=reg, multiprocess_mode="mostrecent").labels(*lv)

        self._lazy: list[_LazyCounter | _LazyHistogram] = []

        def lazy(child: Any, kind: type[_Lazy]) -> _Lazy:
            obj = kind(child)
            self._lazy.append(obj)
            return obj

        def counter(name: str, doc: str) -> _LazyCounter:
            return lazy(Counter(name, doc, names, registry=reg).labels(*lv), _LazyCounter)

        def hist(name: str, doc: str, buckets: Sequence[float]) -> _LazyHistogram:
            return lazy(Histogram(name, doc, names, registry=reg, buckets=buckets).labels(*lv), _LazyHistogram)

        # Scheduler state
        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        by_reason = Gauge(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
            "scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, "
            "KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
            [*names, "reason"],
            registry=reg,
            multiprocess_mode="mostrecent",
        )
        self.waiting_capacity = by_reason.labels(*lv, "capacity")
        self.waiting_deferred = by_reason.labels(*lv, "deferred")
        by_stage = Gauge(
            "vllm:num_requests_kv_fetch_by_stage",
            "Number of waiting requests by async KV load stage. Stage labels: 'waiting_to_start' "
            "= needs an async KV load that has not started; 'in_progress' = load started and not "
            "yet reported finished; 'completed_waiting' = load finished, request not running yet.",
            [*names, "stage"],
            registry=reg,
            multiprocess_mode="mostrecent",
        )
        self.kv_fetch = {stage: by_stage.labels(*lv, stage) for stage in KV_FETCH_STAGES}
        sleep = Gauge(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is "
            "awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
            [*names, "sleep_state"],
            registry=reg,
            multiprocess_mode="mostrecent",
        )
        sleep.labels(*lv, "awake").set(1)
        sleep.labels(*lv, "weights_offloaded").set(0)
        sleep.labels(*lv, "discard_all").set(0)
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")

        # Prefix caches
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.ext_prefix_queries = counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, in "
            "terms of number of queried tokens.",
        )
        self.ext_prefix_hits = counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, in "
            "terms of number of cached tokens.",
        )
        counter("vllm:mm_cache_queries", "Multi-modal cache queries, in terms of number of queried items.")
        counter("vllm:mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items.")

        # Counters
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        by_source = Counter(
            "vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", [*names, "source"], registry=reg
        )
        self.prompt_by_source = {s: lazy(by_source.labels(*lv, s), _LazyCounter) for s in PROMPT_SOURCES}
        self.prompt_cached = counter("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).")
        cached_by_source = Counter(
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), "
            "host (offloaded to DRAM), disk, p2p (transferred from another vLLM instance) or "
            "external_unspecified. Counted at admission; sums to vllm:prefix_cache_hits + "
            "vllm:external_prefix_cache_hits.",
            [*names, "source"],
            registry=reg,
        )
        self.cached_by_source = {s: lazy(cached_by_source.labels(*lv, s), _LazyCounter) for s in CACHE_HIT_SOURCES}
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*names, "finished_reason"],
            registry=reg,
        )
        self.success = {r: lazy(success.labels(*lv, r), _LazyCounter) for r in FINISH_REASONS}
        admission = Counter(
            "vllm:admission_rejections",
            "Number of admission attempts rejected by a queue limit, by reason.",
            ["model_name", "reason"],
            registry=reg,
        )
        for reason in ("max_num_queued_reqs", "max_num_queued_tokens"):
            admission.labels(cfg.model, reason)

        # Performance estimates (always 0 here)
        for what, doc in (
            ("flops", "floating point operations"),
            ("read_bytes", "bytes read from memory"),
            ("write_bytes", "bytes written to memory"),
        ):
            Counter(
                f"vllm:estimated_{what}_per_gpu_total",
                f"Estimated number of {doc} per GPU (for Model Flops Utilization calculations).",
                names,
                registry=reg,
            ).labels(*lv)

        # Histograms of counts
        token_buckets = build_1_2_5_buckets(cfg.max_model_len)
        self.req_prompt_tokens = hist(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.req_generation_tokens = hist(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", token_buckets
        )
        self.iteration_tokens = hist(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", ITERATION_TOKENS_BUCKETS
        )
        self.req_max_gen_tokens = hist(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            token_buckets,
        )
        self.req_params_n = hist(
            "vllm:request_params_n", "Histogram of the n request parameter.", REQUEST_PARAMS_N_BUCKETS
        )
        self.req_params_max_tokens = hist(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", token_buckets
        )

        # Histograms of timing intervals
        self.ttft = hist(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.tpot = hist(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS,
        )
        self.e2e = hist(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS
        )
        self.queue_time = hist(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.inference_time = hist(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill_time = hist(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode_time = hist(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.req_preemptions = hist(
            "vllm:request_num_preemptions",
            "Histogram of the number of times a request was preempted.",
            REQUEST_NUM_PREEMPTIONS_BUCKETS,
        )
        self.prefill_kv_computed = hist(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            token_buckets,
        )

        info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            list(cache_config_labels(cfg)),
            registry=reg,
            multiprocess_mode="mostrecent",
        )
        info.labels(**cache_config_labels(cfg)).set(1)
        # vllm/v1/metrics/loggers.py:1092-1111: only with --enable-lora; its series are set to the
        # current Unix time after each step (engine_model.adapters), and never removed.
        self.lora_info: Gauge | None = None
        if cfg.enable_lora:
            self.lora_info = Gauge(
                "vllm:lora_requests_info",
                "Running stats on lora requests.",
                ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                registry=reg,
                multiprocess_mode="sum",
            )

        # NIXL connector (vllm/distributed/kv_transfer/kv_connector/v1/nixl/stats.py)
        self.nixl_xfer_time = hist(
            "vllm:nixl_xfer_time_seconds",
            "Histogram of transfer duration for NIXL KV Cache transfers.",
            NIXL_TIME_BUCKETS[1:],
        )
        self.nixl_post_time = hist(
            "vllm:nixl_post_time_seconds",
            "Histogram of transfer post time for NIXL KV Cache transfers.",
            NIXL_TIME_BUCKETS,
        )
        self.nixl_bytes = hist(
            "vllm:nixl_bytes_transferred",
            "Histogram of bytes transferred per NIXL KV Cache transfers.",
            NIXL_BYTES_BUCKETS,
        )
        self.nixl_descriptors = hist(
            "vllm:nixl_num_descriptors",
            "Histogram of number of descriptors per NIXL  KV Cache transfers.",
            NIXL_DESCRIPTORS_BUCKETS,
        )
        self.nixl_failed_transfers = counter(
            "vllm:nixl_num_failed_transfers",
            "Number of failed NIXL KV Cache transfers, including handshake and notification "
            "failures. NOTE: KV expiry is tracked separately in vllm:nixl_num_kv_expired_reqs.",
        )
        self.nixl_failed_notifications = counter(
            "vllm:nixl_num_failed_notifications",
            "Number of failed NIXL KV Cache notifications. Retained for compatibility; these "
            "failures are also included in vllm:nixl_num_failed_transfers.",
        )
        self.nixl_kv_expired = counter(
            "vllm:nixl_num_kv_expired_reqs",
            "Number of requests that had their KV expire. NOTE: This metric is tracked on the P instance.",
        )
        self.nixl_notifs_after_expiry = counter(
            "vllm:nixl_num_notifications_after_expiry",
            "Number of completion notifications for requests that were no longer tracked, usually "
            "because their KV lease expired. The KV blocks may have been reused before the "
            "transfer finished. Counted per notification (one per remote rank), not per request.",
        )

    def flush(self) -> None:
        for obj in self._lazy:
            obj.flush()

    def render(self) -> bytes:
        self.flush()
        return generate_latest(self.registry)
