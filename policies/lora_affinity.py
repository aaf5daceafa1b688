"""Prefer the engines that already hold the request's LoRA adapter, and among those the ones that
can run it in their next batch without waiting for an adapter slot.

vLLM runs at most ``--max-loras`` distinct adapters in one batch; a request for another adapter
waits, skipped by the scheduler, until one of them has no request left
(``vllm/v1/core/sched/scheduler.py``, the ``max_loras`` check). An engine that does not list the
adapter in its /v1/models must load it first (dynamic loading) and holds none of its KV blocks.

    1.0  holds it, and it is running there already (its requests share the slot)
    0.8  holds it, and a slot is free (or the engine's slots are not known)
    0.4  holds it, but every slot runs another adapter: the request waits for one
    0.0  does not hold it (a load, then a cold cache)

Base-model requests score 0 everywhere: the scorer has no opinion on them. How much an adapter's
hot engine may take is bounded by the load scorer and the ``bounded_load`` filter alongside it.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from .base import EndpointView, RequestContext
from .params import Number, Policy, PolicyParams


class LoraAffinityParams(PolicyParams):
    free_slot: Number = Field(0.8, ge=0, le=1, description="score of a holder with a free adapter slot")
    full_slots: Number = Field(0.4, ge=0, le=1, description="score of a holder whose slots run other adapters")


class LoraAffinity(Policy[LoraAffinityParams]):
    def score(self, ctx: RequestContext, candidates: Sequence[EndpointView]) -> Sequence[float]:
        adapter = ctx.adapter
        if adapter is None:
            return [0.0] * len(candidates)
        return [self._one(adapter, e) for e in candidates]

    def _one(self, adapter: str, e: EndpointView) -> float:
        if e.models is None or adapter not in e.models:
            return 0.0
        if adapter in e.lora_active:
            return 1.0
        if e.lora_slots is None or len(e.lora_active) < e.lora_slots:
            return float(self.params.free_slot)
        return float(self.params.full_slots)
