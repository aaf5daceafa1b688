"""Conversations routed turn after turn get exactly the decisions a prefix index without reuse of
earlier learn calls gives (every block walked), also while KV events, liveness changes, evictions
and time change the index between turns."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from gateway.config import RoutingConfig
from gateway.engines.pools import Pools
from gateway.request.router import Router
from policies.beliefs.blockhash import BlockHash, block_hashes
from policies.beliefs.prefix_index import PrefixIndex

DECODE = ["http://d0", "http://d1", "http://d2"]
PREFILL = ["http://p0", "http://p1"]


class FullWalk(PrefixIndex):
    def _known(self, url: str, hashes: Sequence[BlockHash], now: float) -> int:
        return 0


def make(index: PrefixIndex) -> Router:
    pools = Pools(PREFILL, DECODE)
    for ep in pools.all():
        ep.healthy = True
    cfg = RoutingConfig.model_validate({"decider": {"name": "token_threshold", "threshold": 200}})
    return Router(cfg, pools, index)


async def test_turns_decide_as_with_the_full_walk() -> None:
    rng = random.Random(3)
    now = [1000.0]
    kwargs: dict[str, Any] = {"max_approx_entries": 400, "approx_ttl_s": 60.0, "young_s": 5.0, "clock": lambda: now[0]}
    reusing, full = PrefixIndex(**kwargs), FullWalk(**kwargs)
    routers = [(make(reusing), reusing), (make(full), full)]
    spec = routers[0][0].hash_spec()
    assert spec is not None
    chats = [[rng.randrange(5000) for _ in range(rng.randint(20, 300))] for _ in range(8)]
    direct = 0
    for step in range(300):
        k = rng.randrange(len(chats))
        chats[k] = chats[k] + [rng.randrange(5000) for _ in range(rng.randint(5, 120))]
        seen = []
        for router, index in routers:
            prep = await router.prepare("m", f"r{step}", chats[k], None, {})
            route = router.route(prep)
            d = route.decision  # what the lifecycle hooks confirm once both legs succeed
            for url in [d.decode.url] + ([d.prefill.url] if d.prefill else []):
                index.learn(url, prep.hashes)
            d = route.decision
            seen.append((dict(prep.ctx.cached_tokens), d.path, d.decode.url, d.prefill and d.prefill.url, d.reason))
        assert seen[0] == seen[1], step
        direct += seen[0][4] == "prefix_cached"
        # The same change to both indexes before the next turn.
        op, url = rng.random(), rng.choice(DECODE + PREFILL)
        hashes = block_hashes(rng.choice(chats), spec)
        cut = rng.randrange(len(hashes) + 1)
        for _, index in routers:
            if op < 0.2:
                index.stored(url, hashes[:cut])
            elif op < 0.3:
                index.removed(url, hashes[cut:])
            elif op < 0.35:
                index.set_precise(url, not index.is_precise(url))
            elif op < 0.38:
                index.cleared(url)
        now[0] += rng.choice([0.0, 0.5, 3.0, 7.0, 30.0, 70.0])
    assert direct > 20  # conversations did come back to the engines holding them
    assert reusing.stats() == full.stats()
