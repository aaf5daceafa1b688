"""P/D when the prompt's tokens not already cached on the chosen decode endpoint are enough for a
remote prefill to pay for the KV transfer. A long prompt whose prefix the decode engine holds goes
direct: the engine only computes the new tail. With KV tiers on (``routing.tiers``), what the decode
engine can load from its CPU tier or the shared store counts as held: a load, not a recompute."""

from __future__ import annotations

from pydantic import Field, StrictInt

from .base import EndpointView, Path, PathChoice, PrefillFinder, RequestContext
from .beliefs.tiers import describe, hold_of
from .params import Policy, PolicyParams

# AWS's guidance for disaggregated prefill/decode: it pays off from about 4,000 input tokens.
DEFAULT_THRESHOLD = 4096


class TokenThresholdParams(PolicyParams):
    threshold: StrictInt = Field(DEFAULT_THRESHOLD, gt=0, description="uncached prompt tokens from which P/D is taken")


class TokenThreshold(Policy[TokenThresholdParams]):
    def decide(self, ctx: RequestContext, decode: EndpointView, prefill: PrefillFinder) -> PathChoice:
        n = ctx.prompt_tokens
        threshold = self.params.threshold
        hold = hold_of(ctx, decode.url)
        uncached = n - hold.held
        if uncached >= threshold:
            return PathChoice(Path.PD, "long_uncached", f"uncached={uncached}>={threshold}")
        if n >= threshold:
            if hold.loaded:  # held below the GPU: the decode engine loads it, as cheap as a hit
                where = f"prompt {n}, on decode: {describe(hold)}"
                return PathChoice(Path.DIRECT, "prefix_in_tier", f"uncached={uncached}<{threshold} ({where})")
            return PathChoice(
                Path.DIRECT, "prefix_cached", f"uncached={uncached}<{threshold} (prompt {n}, cached on decode)"
            )
        return PathChoice(Path.DIRECT, "short_prompt", f"uncached={uncached}<{threshold}")
