"""Prefer the endpoint that already holds the longest run of the prompt's leading blocks: those
tokens are not computed again. The cached counts come from the prefix index (block hashes of the
real token ids, learned from routing or from the engines' KV events).

With KV tiers on (``routing.tiers``), what an endpoint can load from its CPU tier counts too, a
little less than a GPU hit (a load, ~2% of recomputing it: docs/kv-tiers.md), and what it can load
from the shared store less again (every engine reaches that store: it seldom tells them apart)."""

from __future__ import annotations

from collections.abc import Sequence

from .base import EndpointView, RequestContext
from .beliefs.tiers import TIERS, hold_of
from .params import NoParams, Policy

L1_WEIGHT = 0.9  # a token loaded from the endpoint's own CPU tier, against one in its GPU cache
L2_WEIGHT = 0.5  # one loaded from the shared store


class PrefixAffinity(Policy[NoParams]):
    def score(self, ctx: RequestContext, candidates: Sequence[EndpointView]) -> Sequence[float]:
        n = ctx.prompt_tokens
        tiers = ctx.data.get(TIERS)
        if not n or (not ctx.cached_tokens and not tiers):
            return [0.0] * len(candidates)
        if not tiers:
            return [ctx.cached(e.url) / n for e in candidates]
        scores = []
        for e in candidates:
            hold = hold_of(ctx, e.url)
            scores.append((hold.gpu + L1_WEIGHT * hold.l1 + L2_WEIGHT * hold.l2) / n)
        return scores
