"""Prefer the endpoint that already holds the longest run of the prompt's leading blocks: those
tokens are not computed again. The cached counts come from the prefix index (block hashes of the
real token ids, learned from routing or from the engines' KV events)."""

from __future__ import annotations

from collections.abc import Sequence

from .base import EndpointView, RequestContext
from .params import NoParams, Policy


class PrefixAffinity(Policy[NoParams]):
    def score(self, ctx: RequestContext, candidates: Sequence[EndpointView]) -> Sequence[float]:
        n = ctx.prompt_tokens
        if not n or not ctx.cached_tokens:
            return [0.0] * len(candidates)
        return [ctx.cached(e.url) / n for e in candidates]
