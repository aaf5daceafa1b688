"""Settings of one simulated vLLM engine (what ``pdgate sim ...`` parses into)."""

from __future__ import annotations

import importlib.util
import uuid
from dataclasses import dataclass, field
from typing import Any

from engine_model.adapters import MAX_LORA_RANKS, LoRAModule
from engine_model.faults import FaultSpecError, parse_spec
from engine_model.kv_events import KVEventsConfig

ROLES = ("prefill", "decode", "both")
HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")  # vLLM 0.32's PrefixCachingHashAlgo
KV_LOAD_FAILURE_POLICIES = ("fail", "recompute")  # vLLM 0.32's KVTransferConfig.kv_load_failure_policy


@dataclass
class SimConfig:
    """Everything one simulated engine needs; the defaults match ``sim.cli``'s.

    Times are seconds. All latency knobs at 0 make the engine "instant": every request
    still goes through the scheduler, the KV accounting and (for P/D) the side channel.
    """

    role: str = "both"
    host: str = "127.0.0.1"
    port: int = 8000
    model: str = "sim"
    tokenizer: str | None = None
    max_model_len: int = 8192
    block_size: int = 16
    num_gpu_blocks: int = 8192
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    prefill_time_per_token: float = 0.0
    decode_time_per_token: float = 0.0
    kv_transfer_time_per_token: float = 0.0
    # The step-time model (engine_model.engine): base + prefill tokens + decode seqs + context read.
    step_base_time: float = 0.0  # fixed cost of any step (weights read once per step)
    decode_time_per_seq: float = 0.0  # each decoding seq in the step
    context_time_per_token: float = 0.0  # each KV token the step's decoding seqs attend to
    # A prefill chunk's attention: per (chunk token x token it attends to); a chunk of c tokens
    # after p computed ones attends to ~c * (p + c / 2) pairs, so later chunks of a long prompt
    # cost more than the first.
    prefill_attention_time: float = 0.0
    kv_bandwidth_gbps: float = 0.0  # KV pull link (0: no bandwidth term); with kv_bytes_per_token
    kv_transfer_latency: float = 0.0  # fixed cost of one hand-over (handshake, notify, scheduling)
    kv_transfer_time_per_block: float = 0.0  # each pulled KV block (descriptors per block: block size matters)
    time_scale: float = 1.0  # every simulated duration is multiplied by this (0.1: 10x faster than real)
    profile: str | None = None  # the profile the timings came from (engine_model/profiles), for /sim/state
    kv_host: str | None = None
    kv_port: int = 0
    kv_expiry: float = 30.0  # vLLM 0.32: kv_lease_duration, renewed by queued decode legs
    kv_handshake_timeout: float = 5.0
    kv_bytes_per_token: int = 512
    default_max_tokens: int = 16
    engine_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    enable_request_id_headers: bool = False
    enable_prefix_caching: bool = True  # vLLM 0.32's default for generative models
    prefix_caching_hash_algo: str = "sha256"
    kv_events_config: KVEventsConfig = field(default_factory=KVEventsConfig)
    enable_prompt_tokens_details: bool = False
    server_dev_mode: bool = False  # VLLM_SERVER_DEV_MODE=1: dev routes such as /reset_prefix_cache
    kv_load_failure_policy: str = "fail"  # what a decode leg does when its KV pull fails
    # KV offload tiers (engine_model.tiers): an L1 of cpu_blocks blocks in host memory (vLLM's
    # native CPU offloading connector; 0: off) and an L2 shared by engines through Redis.
    cpu_blocks: int = 0
    l1_load_time_per_token: float = 0.0  # host -> GPU copy of one token's KV (an L1 hit loaded)
    l2_url: str | None = None  # redis://host:port/db (needs cpu_blocks: L2 goes through L1, as in vLLM)
    l2_key_prefix: str = "pdgate:l2"  # the Redis keys of this L2 (one prefix per shared store)
    l2_blocks: int = 100_000  # the L2's capacity (LRU)
    l2_latency: float = 0.0  # fixed cost of one L2 load (a round trip to the store)
    l2_bandwidth_gbps: float = 0.0  # L2 link in Gbit/s, with kv_bytes_per_token (0: no bandwidth term)
    l2_timeout: float = 0.5  # seconds one Redis call may take before the engine carries on without it
    self_describing_kv_events: bool = False  # vLLM's kv_connector_extra_config.self_describing_kv_events
    # LoRA adapters (engine_model.adapters), vLLM's flags: --enable-lora, --max-loras (distinct
    # adapters in one batch), --max-cpu-loras (adapters kept loaded, LRU; None: max_loras),
    # --max-lora-rank, --lora-modules; lora_load_time: the sim's cost of loading one adapter.
    enable_lora: bool = False
    max_loras: int = 1
    max_cpu_loras: int | None = None
    max_lora_rank: int = 16
    lora_modules: list[LoRAModule] = field(default_factory=list)
    lora_load_time: float = 0.05
    allow_runtime_lora_updating: bool = False  # VLLM_ALLOW_RUNTIME_LORA_UPDATING: the load/unload routes
    faults: dict[str, Any] | None = None  # start-up fault spec (engine_model.faults), also set at runtime
    log_level: str = "warning"

    def __post_init__(self) -> None:
        self._check_choices()
        self._check_sizes()
        self._check_times()
        self._check_lora()

    def _check_lora(self) -> None:
        """vLLM's LoRAConfig bounds (vllm/config/lora.py:26-47,118-126); --lora-modules needs
        --enable-lora (vLLM fails at start-up: "LoRA is not enabled")."""
        if self.max_loras < 1:
            raise ValueError("max_loras must be at least 1")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        elif self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}).")
        if self.max_lora_rank not in MAX_LORA_RANKS:
            raise ValueError(f"max_lora_rank must be one of {', '.join(map(str, MAX_LORA_RANKS))}")
        if self.lora_load_time < 0:
            raise ValueError("lora_load_time must not be negative")
        if self.lora_modules and not self.enable_lora:
            raise ValueError(
                "--lora-modules needs --enable-lora (LoRA is not enabled. Use --enable-lora to enable LoRA.)"
            )

    def _check_sizes(self) -> None:
        """Counts and sizes, as vLLM bounds them (one full-length request must fit the KV cache)."""
        for name in ("max_model_len", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.num_gpu_blocks < 2:
            raise ValueError("num_gpu_blocks must be at least 2 (block 0 is vLLM's null block)")
        if (self.num_gpu_blocks - 1) * self.block_size < self.max_model_len:
            # vLLM refuses to start in this case too: one full-length request must fit.
            raise ValueError(
                f"max_model_len {self.max_model_len} is larger than the KV cache "
                f"({(self.num_gpu_blocks - 1) * self.block_size} tokens in {self.num_gpu_blocks - 1} blocks)"
            )
        if self.default_max_tokens < 1:
            raise ValueError("default_max_tokens must be at least 1")
        if not 0 <= self.kv_port <= 65535:
            raise ValueError("kv_port must be in 0..65535")
        if self.cpu_blocks < 0:
            raise ValueError("cpu_blocks must not be negative (0: no L1)")
        if self.l2_blocks < 1:
            raise ValueError("l2_blocks must be at least 1")
        self._check_tiers()

    def _check_tiers(self) -> None:
        """The tiers are keyed by block hashes, and an L2 goes through the L1 (vLLM's tiering
        manager promotes secondary-tier hits into its CPU tier, vllm/v1/kv_offload/tiering/base.py:135-137)."""
        if self.cpu_blocks and not self.enable_prefix_caching:
            raise ValueError("cpu_blocks needs prefix caching (the tiers are keyed by block hashes)")
        if self.l2_url is None:
            return
        if not self.cpu_blocks:
            raise ValueError("l2_url needs cpu_blocks > 0: an L2 hit is loaded through the L1, as in vLLM")
        if not self.l2_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"l2_url must be a redis:// URL, got {self.l2_url!r}")

    def _check_times(self) -> None:
        """Durations and rates: none negative; the time scale and the KV hold's expiry positive."""
        for name in (
            "prefill_time_per_token",
            "decode_time_per_token",
            "kv_transfer_time_per_token",
            "kv_handshake_timeout",
            "step_base_time",
            "decode_time_per_seq",
            "context_time_per_token",
            "prefill_attention_time",
            "kv_bandwidth_gbps",
            "kv_transfer_latency",
            "kv_transfer_time_per_block",
            "l1_load_time_per_token",
            "l2_latency",
            "l2_bandwidth_gbps",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative")
        if self.time_scale <= 0:
            raise ValueError("time_scale must be positive")
        if self.kv_expiry <= 0:
            raise ValueError("kv_expiry must be positive")
        if self.l2_timeout <= 0:
            raise ValueError("l2_timeout must be positive")

    def _check_choices(self) -> None:
        """Named choices (role, hash algorithm, load-failure policy) and the fault spec."""
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.prefix_caching_hash_algo not in HASH_ALGOS:
            raise ValueError(
                f"prefix_caching_hash_algo must be one of {', '.join(HASH_ALGOS)}, "
                f"got {self.prefix_caching_hash_algo!r}"
            )
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(
                f"kv_load_failure_policy must be one of {', '.join(KV_LOAD_FAILURE_POLICIES)}, "
                f"got {self.kv_load_failure_policy!r}"
            )
        try:
            parse_spec(self.faults)
        except FaultSpecError as e:
            raise ValueError(f"faults: {e}") from e
        if self.prefix_caching_hash_algo.startswith("xxhash") and importlib.util.find_spec("xxhash") is None:
            raise ValueError(f"prefix_caching_hash_algo {self.prefix_caching_hash_algo} needs the 'xxhash' package")

    @property
    def advertised_kv_host(self) -> str:
        """The host a decode engine is told to dial (``remote_host``)."""
        return self.kv_host or self.host

    @property
    def instant(self) -> bool:
        return not any(
            (
                self.prefill_time_per_token,
                self.decode_time_per_token,
                self.kv_transfer_time_per_token,
                self.step_base_time,
                self.decode_time_per_seq,
                self.context_time_per_token,
                self.prefill_attention_time,
                self.kv_bandwidth_gbps,
                self.kv_transfer_latency,
                self.kv_transfer_time_per_block,
                self.l1_load_time_per_token,
                self.l2_latency,
                self.l2_bandwidth_gbps,
                self.enable_lora and self.lora_load_time,
            )
        )

    def step_time(
        self, prefill_tokens: int, decode_seqs: int, context_tokens: int, prefill_pairs: float = 0.0
    ) -> float:
        """Wall seconds of one engine step (already time-scaled). A step carries the running
        decodes and the prefill chunks together, so a long chunk lengthens every stream's
        next token: the interference disaggregation removes. ``prefill_pairs``: the chunks'
        attention work, ``sum(chunk * (prefix + chunk / 2))`` (:func:`attention_pairs`)."""
        t = prefill_tokens * self.prefill_time_per_token + prefill_pairs * self.prefill_attention_time
        if decode_seqs:
            t += (
                self.decode_time_per_token
                + decode_seqs * self.decode_time_per_seq
                + context_tokens * self.context_time_per_token
            )
        if prefill_tokens or decode_seqs:
            t += self.step_base_time
        return t * self.time_scale

    def kv_transfer_time(self, tokens: int) -> float:
        """Wall seconds to pull ``tokens`` tokens' KV (already time-scaled)."""
        if tokens <= 0:
            return 0.0
        t = tokens * self.kv_transfer_time_per_token + self.kv_transfer_latency
        t += -(-tokens // self.block_size) * self.kv_transfer_time_per_block
        if self.kv_bandwidth_gbps:
            t += tokens * self.kv_bytes_per_token * 8 / (self.kv_bandwidth_gbps * 1e9)
        return t * self.time_scale

    def l1_load_time(self, tokens: int) -> float:
        """Wall seconds to copy ``tokens`` tokens' KV from the L1 (host memory) to the GPU."""
        return tokens * self.l1_load_time_per_token * self.time_scale if tokens > 0 else 0.0

    def l2_load_time(self, tokens: int) -> float:
        """Wall seconds to move ``tokens`` tokens' KV between the L2 store and the L1 (one
        round trip plus the bytes over the link); the same for an upload."""
        if tokens <= 0:
            return 0.0
        t = self.l2_latency
        if self.l2_bandwidth_gbps:
            t += tokens * self.kv_bytes_per_token * 8 / (self.l2_bandwidth_gbps * 1e9)
        return t * self.time_scale

    def prefill_time(self, prompt_tokens: int, cached_tokens: int = 0) -> float:
        """Wall seconds to prefill one prompt alone (no decodes in its steps), chunked by
        ``max_num_batched_tokens`` as the engine does it: what the calibration checks."""
        chunks = self.prefill_chunks(prompt_tokens, cached_tokens)
        return sum(self.step_time(c, 0, 0, attention_pairs(c, p)) for c, p in chunks)

    def prefill_chunks(self, prompt_tokens: int, cached_tokens: int = 0) -> list[tuple[int, int]]:
        """(chunk, tokens computed before it) of each step that prefills one prompt alone."""
        out, done = [], cached_tokens
        while done < prompt_tokens:
            chunk = min(self.max_num_batched_tokens, prompt_tokens - done)
            out.append((chunk, done))
            done += chunk
        return out

    def accepts_prefill_legs(self) -> bool:
        return self.role in ("prefill", "both")

    def accepts_decode_legs(self) -> bool:
        return self.role in ("decode", "both")


def attention_pairs(chunk: int, prefix: int) -> float:
    """Causal attention work of a ``chunk``-token prefill after ``prefix`` computed tokens:
    each chunk token attends to the prefix and to the chunk tokens before it."""
    return chunk * (prefix + (chunk + 1) / 2)
