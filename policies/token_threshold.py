"""P/D when the prompt's tokens not already cached on the chosen decode endpoint are enough for a
remote prefill to pay for the KV transfer. A long prompt whose prefix the decode engine holds goes
direct: the engine only computes the new tail."""

from __future__ import annotations

from pydantic import Field, StrictInt

from .base import EndpointView, Path, PathChoice, PrefillFinder, RequestContext
from .params import Policy, PolicyParams

# AWS's guidance for disaggregated prefill/decode: it pays off from about 4,000 input tokens.
DEFAULT_THRESHOLD = 4096


class TokenThresholdParams(PolicyParams):
    threshold: StrictInt = Field(DEFAULT_THRESHOLD, gt=0, description="uncached prompt tokens from which P/D is taken")


class TokenThreshold(Policy[TokenThresholdParams]):
    def decide(self, ctx: RequestContext, decode: EndpointView, prefill: PrefillFinder) -> PathChoice:
        n = ctx.prompt_tokens
        threshold = self.params.threshold
        uncached = ctx.uncached(decode.url)
        if uncached >= threshold:
            return PathChoice(Path.PD, "long_uncached", f"uncached={uncached}>={threshold}")
        if n >= threshold:
            return PathChoice(
                Path.DIRECT, "prefix_cached", f"uncached={uncached}<{threshold} (prompt {n}, cached on decode)"
            )
        return PathChoice(Path.DIRECT, "short_prompt", f"uncached={uncached}<{threshold}")
