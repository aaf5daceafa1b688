"""The engine's request types: :class:`Seq` (one engine request), the :class:`Collector` that wakes
its HTTP side, and :class:`Held` (a prefill leg's blocks kept for a decode engine to pull).

They are plain state, shared by the scheduler (:mod:`engine_model.engine`), the P/D side
(:mod:`engine_model.kv_transfer`), the fleet in virtual time (:mod:`engine_model.fleet`) and the
simulator's HTTP side (``sim``), so they live apart from the code that moves them: a request's
kind (plain, prefill leg, decode leg), its state (waiting, loading remote KV, running, finished),
what it has computed and generated, and the bookkeeping its response needs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine_model.adapters import LoRARequest
from engine_model.tokens import OutputContext

PLAIN, PREFILL, DECODE = "plain", "prefill", "decode"
WAITING, REMOTE_KV, RUNNING, FINISHED = "waiting", "remote_kv", "running", "finished"

_now = time.monotonic


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Collector:
    """Wakes the HTTP side of one request when any of its seqs produced or finished."""

    __slots__ = ("done", "event", "pending")

    def __init__(self, n: int) -> None:
        self.event = asyncio.Event()
        self.pending = n
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()


class Seq:
    """One engine request (one prompt, one choice)."""

    __slots__ = (
        "arrival",
        "blocks",
        "cached_tokens",
        "collector",
        "context",
        "counted_prompt",
        "created_cache_tokens",
        "digests",
        "error",
        "external_tokens",
        "final_sent",
        "finish_reason",
        "finished_t",
        "first_token_t",
        "ignore_eos",
        "in_prefill",
        "kind",
        "kv_in",
        "kv_out",
        "kv_pulled",
        "l2_present",
        "last_token_t",
        "local_hit",
        "lora",
        "max_tokens",
        "min_tokens",
        "n_param",
        "num_cached_blocks",
        "num_computed",
        "num_preemptions",
        "output_ids",
        "pieces",
        "prompt_ids",
        "prompt_len",
        "pull_task",
        "remote_released",
        "req_id",
        "scheduled_t",
        "state",
        "stop_reason",
        "stop_strs",
        "stop_token_ids",
        "text_len_sent",
        "tokens_sent",
    )

    def __init__(
        self,
        req_id: str,
        prompt_ids: list[int],
        max_tokens: int,
        *,
        kind: str = PLAIN,
        min_tokens: int = 0,
        choice: int = 0,
        stop: Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        kv_in: dict[str, Any] | None = None,
        n_param: int = 1,
        collector: Collector | None = None,
        lora: LoRARequest | None = None,
    ) -> None:
        """``lora``: the adapter it runs with (None: the base model). Its weights change the KV
        (:meth:`kv_salt`) and the output, and its name and path the block hashes."""
        self.req_id = req_id
        self.lora = lora
        self.prompt_ids = prompt_ids
        self.prompt_len = len(prompt_ids)
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self.kind = kind
        self.stop_strs = tuple(stop)
        self.stop_token_ids = frozenset(stop_token_ids)
        self.ignore_eos = ignore_eos
        self.kv_in = kv_in
        self.n_param = n_param
        self.collector = collector
        self.context = OutputContext(prompt_ids, salt=self.kv_salt + (choice.to_bytes(4, "little") if choice else b""))
        self.state = WAITING
        self.arrival = _now()
        self.scheduled_t: float | None = None
        self.first_token_t: float | None = None
        self.last_token_t: float | None = None
        self.finished_t: float | None = None
        self.output_ids: list[int] = []
        self.pieces: list[str] = []
        self.num_computed = 0
        self.blocks: list[int] = []
        self.digests: list[bytes] = []  # chained block hashes of its full blocks, grown lazily
        self.num_cached_blocks = 0  # leading blocks registered in the prefix cache
        self.local_hit = 0  # prompt tokens found in the local prefix cache at first admission
        self.cached_tokens = 0  # usage.prompt_tokens_details.cached_tokens
        self.created_cache_tokens = 0  # ... .created_cache_tokens (chat)
        self.in_prefill = True
        self.counted_prompt = False
        self.external_tokens = 0  # prompt tokens loaded from outside the GPU (a peer, an offload tier)
        self.l2_present: list[bool] | None = None  # the shared L2's answer per block, asked on arrival
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.kv_out: dict[str, Any] | None = None
        self.kv_pulled = False
        self.remote_released = False
        self.pull_task: asyncio.Task[None] | None = None
        self.error: str | None = None
        self.tokens_sent = 0  # streaming bookkeeping (sim.streaming)
        self.text_len_sent = 0
        self.final_sent = False

    @property
    def kv_salt(self) -> bytes:
        """What, besides the tokens, its KV depends on: the adapter's weights (b"" for the base model)."""
        return self.lora.weights if self.lora is not None else b""

    @property
    def hash_extra(self) -> tuple[tuple[str, str, str], ...] | None:
        """The extra key of every one of its block hashes (vLLM's LoRA key), or None."""
        return self.lora.hash_extra if self.lora is not None else None

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.state == FINISHED

    def text(self) -> str:
        text = "".join(self.pieces)
        if self.finish_reason == "stop" and isinstance(self.stop_reason, str):
            cut = text.find(self.stop_reason)
            if cut >= 0:
                text = text[:cut]
        return text


@dataclass
class Held:
    """A prefill leg's blocks kept for a decode engine to pull."""

    request_id: str
    block_ids: list[int]
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)
