"""The engines' own cache-hit counters against what routing believed they would serve, per tier.

Each answer's ``cached_tokens`` corrects the tier beliefs request by request (``TierBeliefs``), but
only when the engine reports it (vLLM's ``--enable-prompt-tokens-details``). Every vLLM 0.32 engine
also counts, on its /metrics, the prompt tokens it served from each cache tier:
``vllm:prompt_tokens_cached_by_source{source}`` (``vllm/v1/metrics/loggers.py`` lines 781-797,
sources in ``vllm/v1/metrics/cache_hit_source.py``): ``device`` is its GPU prefix cache; ``host``
and ``disk`` its offload tiers; ``external_unspecified`` what a connector such as LMCache loaded
(the base connector's default, ``kv_connector/v1/base.py`` line 185); ``p2p`` KV pulled from
another engine (NIXL's hand-over, ``nixl/connector.py`` line 81), which is not a tier and is left
out. MultiConnector reports the source of the sub-connector that served the request.

``TierCounterCheck`` adds up, per engine, the tokens routing believed the engine would serve from
its GPU and from the tiers below on the legs where the engine computed the prompt, and at each
scrape the counters' increase. The counters count every client's requests, a superset of the
gateway's: an engine that reports *fewer* below-GPU hits than the gateway believed over a window
cannot have held what it was believed to hold. Below ``distrust_below`` of the belief the engine's
tiers are distrusted (``TierIndex.distrust``): its L1 beliefs go and neither L1 nor L2 counts for
it until its counters show it loading from a tier again (``min_tokens`` of them). That catches a
gateway configured with tiers in front of engines that have none, or whose store is unreachable,
when the answers do not carry ``cached_tokens``. The GPU's ratio is measured, not acted on (the
KV events and the answers correct the GPU beliefs).

A window closes at the first scrape after ``min_tokens`` were believed; a leg admitted before a
scrape and done after it counts its hits in one window and its belief in the next, an error of at
most the legs in flight at the boundary, small against ``min_tokens``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from policies.base import LegReport, Path, RequestContext
from policies.beliefs.tiers import TIERS, TierIndex

GPU_SOURCES = frozenset({"device"})
BELOW_SOURCES = frozenset({"host", "disk", "external_unspecified"})  # not p2p: a hand-over, not a tier
CHECKED = ("gpu", "below")

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Engine:
    last: dict[str, float] | None = None  # the counters at the last scrape
    believed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CHECKED, 0))
    reported: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CHECKED, 0.0))
    ratio: dict[str, float] = field(default_factory=dict)  # the last closed window's, per checked tier


@dataclass(frozen=True, slots=True)
class CounterCheckState:
    """One engine's standing (metrics, ``/debug/route``)."""

    ratio: Mapping[str, float]  # engine-reported over believed, the last closed window
    distrusted: bool


class TierCounterCheck:
    """A lifecycle subscriber (``on_leg_done``) fed the engines' counters at each scrape
    (``on_counters``). Runs on the event loop."""

    def __init__(
        self, tiers: TierIndex, *, min_tokens: int = 16384, distrust_below: float = 0.5, enabled: bool = True
    ) -> None:
        self.tiers = tiers
        self.enabled = enabled
        self.min_tokens = min_tokens
        self.distrust_below = distrust_below
        self._engines: dict[str, _Engine] = {}
        self.distrusts = 0  # times an engine's tiers were distrusted

    def configure(self, *, enabled: bool, min_tokens: int, distrust_below: float) -> None:
        """Off: nothing is judged, and every engine distrusted so far is trusted again."""
        self.enabled, self.min_tokens, self.distrust_below = enabled, min_tokens, distrust_below
        if not enabled:
            for url in list(self._engines):
                self.tiers.trust(url)
                self._engines[url] = _Engine()

    def on_leg_done(self, ctx: RequestContext, leg: LegReport) -> None:
        if not self.enabled or not leg.prefilled or (leg.leg == "decode" and leg.path is Path.PD):
            return  # a P/D decode leg's prompt came over NIXL (p2p), not from its caches
        engine = self._engines.get(leg.url)
        holds = ctx.data.get(TIERS)
        if engine is None or engine.last is None or holds is None or (hold := holds.get(leg.url)) is None:
            return  # no counters from this engine (yet), or no tier breakdown for the request
        engine.believed["gpu"] += hold.gpu
        engine.believed["below"] += hold.loaded

    def on_counters(self, url: str, by_source: Mapping[str, float] | None, *, restarted: bool = False) -> None:
        """A scrape of ``url`` with its ``prompt_tokens_cached_by_source`` counters (None: it has none)."""
        engine = self._engines.setdefault(url, _Engine())
        if by_source is None or not self.enabled:
            self._engines[url] = _Engine()
            return
        last, engine.last = engine.last, dict(by_source)
        if last is None or restarted or any(v < last.get(k, 0.0) for k, v in by_source.items()):
            engine.believed, engine.reported = dict.fromkeys(CHECKED, 0), dict.fromkeys(CHECKED, 0.0)
            return  # a first scrape, or a new run of the engine: counting starts over
        for source, value in by_source.items():
            delta = value - last.get(source, 0.0)
            if source in GPU_SOURCES:
                engine.reported["gpu"] += delta
            elif source in BELOW_SOURCES:
                engine.reported["below"] += delta
        self._judge(url, engine)

    def _judge(self, url: str, engine: _Engine) -> None:
        if self.tiers.distrusted(url):
            if engine.reported["below"] >= self.min_tokens:  # it loads from a tier again
                self.tiers.trust(url)
                log.info("tiers: %s loads from its tiers again (its counters): its tier beliefs count again", url)
                engine.believed["below"], engine.reported["below"] = 0, 0.0
            else:
                engine.believed["below"] = 0
        for tier in CHECKED:
            believed = engine.believed[tier]
            if believed < self.min_tokens:
                continue
            engine.ratio[tier] = engine.reported[tier] / believed
            engine.believed[tier], engine.reported[tier] = 0, 0.0
            if tier == "below" and engine.ratio[tier] < self.distrust_below and not self.tiers.distrusted(url):
                self.tiers.distrust(url)
                self.distrusts += 1
                log.warning(
                    "tiers: %s's counters show %.0f%% of the tokens believed below its GPU loaded from a tier: "
                    "its L1 and L2 beliefs no longer count (is LMCache configured on it, and its store reachable?)",
                    url,
                    100 * engine.ratio[tier],
                )

    def forget(self, url: str) -> None:
        """``url`` left the configuration."""
        self._engines.pop(url, None)
        self.tiers.trust(url)

    def state(self) -> dict[str, CounterCheckState]:
        return {
            url: CounterCheckState(dict(e.ratio), self.tiers.distrusted(url))
            for url, e in self._engines.items()
            if e.last is not None
        }
