"""Take the path with the lower predicted time to first token.

    direct = (backlog(decode) + compute(decode)) * s_per_token(decode) + load(decode)
    pd     = (backlog(prefill) + compute(prefill)) * s_per_token(prefill) + load(prefill)
             + handover(uncached(decode))

With KV tiers on (``routing.tiers``), ``compute(x)`` is the prompt tokens x neither holds in its GPU
cache nor can load from a tier below it, and ``load(x)`` prices those loads: L1 tokens (the engine's
CPU RAM) at ``kv_bytes_per_token / l1_gbytes_per_s``, L2 tokens (the shared store) at
``l2_latency_s`` once plus ``kv_bytes_per_token / l2_gbytes_per_s`` each (docs/kv-tiers.md has the
sources). Without tiers, ``compute(x)`` is ``uncached(x)`` and ``load(x)`` is 0.

``handover(n)`` is the time from the prefill leg's answer to the decode engine's first token when
``n`` tokens of KV move: measured on recent P/D streams of this prefill/decode pair (or of the pool)
once there are a few (``policies/beliefs/estimates.py``), else configured as
``n * kv_bytes_per_token / bandwidth + pd_overhead_s``.

``backlog(x)`` is the uncached prompt tokens the gateway has already sent to endpoint x whose
prefill has not finished (x's queue, as far as this gateway knows); ``uncached(x)`` the prompt
tokens x does not hold in its prefix cache (the decode engine pulls only the blocks it lacks);
``s_per_token(x)`` x's prefill speed, learned online from observed prefill legs, else
``prefill_tokens_per_s``; a decode engine's is the prefill engine's times ``decode_prefill_factor``
unless it was measured. P/D must win by ``min_gain_s``, unless direct would stall the decode
engine's running streams for more than ``itl_budget_s`` per step (TTFT is not the only cost:
a long prefill there delays every running stream's next token, the interference P/D exists
to remove) and sparing them is worth what P/D costs this request: its extra wait (pd - direct)
is at most the delay direct would add up over those streams (streams x direct prefill time).
Without that bound a busy prefill pool queues requests whose stall was small (a short prompt
on a one-engine prefill pool waited seconds to spare a few streams one 60 ms step).
"""

from __future__ import annotations

from pydantic import Field

from .base import MEASURED, NOTHING_MEASURED, EndpointView, Path, PathChoice, PrefillFinder, RequestContext
from .beliefs.tiers import TIERS, TierHold, describe, hold_of, to_compute
from .params import Number, Policy, PolicyParams

# Llama-3.3-70B in bf16: 2 (K and V) * 80 layers * 8 KV heads * 128 head dim * 2 bytes.
LLAMA_70B_KV_BYTES_PER_TOKEN = 2 * 80 * 8 * 128 * 2


class CostModelParams(PolicyParams):
    kv_bytes_per_token: Number = Field(
        LLAMA_70B_KV_BYTES_PER_TOKEN, gt=0, description="KV cache bytes per prompt token (all layers, K and V)"
    )
    kv_bandwidth_gbps: Number = Field(
        400.0,
        gt=0,  # one EFA link per GPU on p5 nodes (3,200 Gbps per node)
        description="KV transfer bandwidth, Gbit/s",
    )
    prefill_tokens_per_s: Number = Field(
        10_000.0, gt=0, description="prefill speed until an endpoint's own has been observed"
    )
    decode_prefill_factor: Number = Field(
        1.0, gt=0, description="prefill on a busy decode engine may run slower (until measured)"
    )
    pd_overhead_s: Number = Field(
        0.005, ge=0, description="the extra hop, the one-token prefill answer, the NIXL handshake"
    )
    min_gain_s: Number = Field(0.0, ge=0, description="how much faster P/D must be predicted to be")
    # Direct prefill shares the decode engine's steps with its running streams: a chunk of up to
    # prefill_chunk_tokens (vLLM's max_num_batched_tokens) delays every stream's next token by
    # its prefill time. Above this delay the request goes P/D even when direct is faster to its
    # first token (0: TTFT alone decides).
    itl_budget_s: Number = Field(
        0.05, ge=0, description="longest stall of running streams direct may cause (0: TTFT alone decides)"
    )
    prefill_chunk_tokens: Number = Field(8192, gt=0, description="the engines' max_num_batched_tokens")
    # Loading a prefix from a tier below the GPU (docs/kv-tiers.md): host-to-GPU copies measured at
    # 55 GB/s per H200 with pinned memory in 256-token chunks (8 GPUs at TP8 load their shards at once).
    l1_gbytes_per_s: Number = Field(
        440.0, gt=0, description="KV load bandwidth from the engine's CPU tier (L1) to its GPUs, GB/s, all GPUs"
    )
    l2_gbytes_per_s: Number = Field(
        10.0, gt=0, description="KV load bandwidth from the shared store (L2), GB/s per engine"
    )
    l2_latency_s: Number = Field(0.005, ge=0, description="a load from the shared store's first-byte latency")


class CostModel(Policy[CostModelParams]):
    """Parameters, defaults and bounds: ``CostModelParams``. The measured hand-over comes from the
    request's data (``MEASURED``, published by the gateway)."""

    # The SLO check (gateway/request/slo.py) reads these two by name.
    @property
    def prefill_tokens_per_s(self) -> float:
        return self.params.prefill_tokens_per_s

    @property
    def decode_prefill_factor(self) -> float:
        return self.params.decode_prefill_factor

    def _spt(self, e: EndpointView, fallback: float | None = None) -> float:
        if e.prefill_s_per_token is not None:
            return e.prefill_s_per_token
        return fallback if fallback is not None else 1.0 / self.params.prefill_tokens_per_s

    def transfer_s(self, tokens: int) -> float:
        p = self.params
        return tokens * p.kv_bytes_per_token * 8 / (p.kv_bandwidth_gbps * 1e9)

    def handover(self, ctx: RequestContext, decode: EndpointView, prefill: EndpointView) -> tuple[float, str]:
        """Seconds from the prefill answer to the decode engine's first token, and their source."""
        tokens = ctx.uncached(decode.url)
        measured = ctx.data.get(MEASURED, NOTHING_MEASURED).handover(
            prefill.url, decode.url, tokens, self.transfer_s(1)
        )
        if measured is not None:
            return measured.seconds, f"measured on the {measured.source}, n={measured.samples}"
        return self.transfer_s(tokens) + self.params.pd_overhead_s, "configured"

    def _decode_spt(self, decode: EndpointView, prefill: EndpointView) -> float:
        # A decode engine has the same model and usually the same hardware: before its own speed is
        # known, the prefill engine's learned speed (slowed by the factor) is the better guess.
        if decode.prefill_s_per_token is not None:
            return decode.prefill_s_per_token
        return self._spt(prefill) * self.params.decode_prefill_factor

    def stall_s(self, ctx: RequestContext, decode: EndpointView, prefill: EndpointView) -> float:
        """How long one step of this prompt's direct prefill would hold up the decode engine's streams."""
        return min(to_compute(ctx, decode.url), self.params.prefill_chunk_tokens) * self._decode_spt(decode, prefill)

    def predict(self, ctx: RequestContext, decode: EndpointView, prefill: EndpointView) -> tuple[float, float]:
        """(direct, pd) predicted seconds to first token."""
        return self._predict(ctx, decode, prefill)[:2]

    def load_s(self, hold: TierHold) -> float:
        """Seconds to load what an engine holds below its GPU (0 without tiers)."""
        p = self.params
        seconds = hold.l1 * p.kv_bytes_per_token / (p.l1_gbytes_per_s * 1e9)
        if hold.l2:
            seconds += p.l2_latency_s + hold.l2 * p.kv_bytes_per_token / (p.l2_gbytes_per_s * 1e9)
        return seconds

    def _predict(
        self, ctx: RequestContext, decode: EndpointView, prefill: EndpointView
    ) -> tuple[float, float, float, str]:
        decode_spt = self._decode_spt(decode, prefill)
        on_decode, on_prefill = hold_of(ctx, decode.url), hold_of(ctx, prefill.url)
        compute_decode = ctx.prompt_tokens - on_decode.held
        direct = (decode.backlog_tokens + compute_decode) * decode_spt + self.load_s(on_decode)
        handover, source = self.handover(ctx, decode, prefill)
        compute_prefill = ctx.prompt_tokens - on_prefill.held
        pd = (prefill.backlog_tokens + compute_prefill) * self._spt(prefill) + self.load_s(on_prefill) + handover
        return direct, pd, handover, source

    def decide(self, ctx: RequestContext, decode: EndpointView, prefill: PrefillFinder) -> PathChoice:
        p = prefill()
        if p is None:  # the pipeline answers direct and says why P/D was not possible
            return PathChoice(Path.PD, "pd_unavailable", "no prefill endpoint for this request")
        direct, pd, handover, source = self._predict(ctx, decode, p)
        detail = f"ttft direct={direct * 1000:.1f}ms pd={pd * 1000:.1f}ms (hand-over {handover * 1000:.1f}ms, {source})"
        if ctx.data.get(TIERS) is not None:  # where each path's prompt would come from
            detail += f"; decode {describe(hold_of(ctx, decode.url))}, prefill {describe(hold_of(ctx, p.url))}"
        predicted = (("direct", direct), ("pd", pd))
        if pd + self.params.min_gain_s < direct:
            return PathChoice(Path.PD, "pd_faster", detail, predicted)
        streams = decode.running if decode.running is not None else decode.in_flight
        budget = self.params.itl_budget_s
        if budget and streams and (stall := self.stall_s(ctx, decode, p)) > budget:
            stalls = f"direct would stall {streams} stream(s) {stall * 1000:.0f}ms > {budget * 1000:.0f}ms"
            # Every chunk of a direct prefill delays every running stream by its prefill time.
            spared = streams * to_compute(ctx, decode.url) * self._decode_spt(decode, p)
            if pd - direct <= spared:
                return PathChoice(Path.PD, "protect_itl", f"{detail}; {stalls}", predicted)
            return PathChoice(
                Path.DIRECT,
                "prefill_backlog",
                f"{detail}; {stalls}, but P/D would add {(pd - direct) * 1000:.0f}ms > {spared * 1000:.0f}ms spared",
                predicted,
            )
        return PathChoice(Path.DIRECT, "direct_faster", detail, predicted)
