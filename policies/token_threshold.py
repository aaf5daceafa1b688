"""P/D when the prompt is long enough for a remote prefill to pay for the KV transfer."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Path, PathChoice, PoolSnapshot, RequestContext

# AWS's guidance for disaggregated prefill/decode: it pays off from about 4,000 input tokens.
DEFAULT_THRESHOLD = 4096


@dataclass(frozen=True)
class TokenThreshold:
    threshold: int = DEFAULT_THRESHOLD

    def __post_init__(self) -> None:
        if not isinstance(self.threshold, int) or isinstance(self.threshold, bool) or self.threshold < 1:
            raise ValueError("threshold must be a positive integer")

    def decide(self, ctx: RequestContext, pools: PoolSnapshot) -> PathChoice:
        n = ctx.prompt_tokens
        if n >= self.threshold:
            return PathChoice(Path.PD, "long_prompt", f"tokens={n}>={self.threshold}")
        return PathChoice(Path.DIRECT, "short_prompt", f"tokens={n}<{self.threshold}")
