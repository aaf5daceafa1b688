"""Engine speeds measured on real requests: what the cost model predicts with, learned through the
lifecycle hooks instead of configured.

- **prefill speed** per engine (seconds per computed prompt token), from prefill legs: the leg's
  time over the prompt work the engine had to do before answering (the tokens the gateway had
  queued there ahead of it, plus this prompt's uncached tokens; the engine's own cache-hit count
  replaces the gateway's belief when it reports one);
- **P/D hand-over** per prefill/decode pair, and across the pool: from the prefill leg's answer to
  the decode engine's first token (KV pull, the decode engine's queue and first step), as
  ``a + b * tokens`` fitted by exponentially weighted least squares over recent P/D streams.

Everything here is forgotten for an engine that restarts (``forget``).
"""

from __future__ import annotations

from dataclasses import dataclass

from policies.base import HandoverEstimate, LegOutcome, LegReport, Path, RequestContext

SPEED_ALPHA = 0.2  # weight of a new prefill-speed sample
MIN_LEARN_TOKENS = 32  # less prompt work than this times HTTP, not the engine
HANDOVER_ALPHA = 0.1  # weight of a new hand-over sample (a memory of ~10-20 P/D streams)
MIN_HANDOVER_SAMPLES = 3


@dataclass(slots=True)
class LinearFit:
    """``seconds ~ a + b * tokens``, exponentially weighted; the slope only once the token counts
    spread enough to tell it from noise, else ``b`` is the caller's prior."""

    n: int = 0
    sx: float = 0.0  # weighted means of x, y, x*x, x*y
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def add(self, x: float, y: float, alpha: float = HANDOVER_ALPHA) -> None:
        w = 1.0 if self.n == 0 else max(alpha, 1.0 / (self.n + 1))  # plain mean until 1/alpha samples
        self.n += 1
        self.sx += w * (x - self.sx)
        self.sy += w * (y - self.sy)
        self.sxx += w * (x * x - self.sxx)
        self.sxy += w * (x * y - self.sxy)

    def predict(self, x: float, prior_slope: float) -> float:
        var = self.sxx - self.sx * self.sx
        spread = var > 0 and var > (0.25 * self.sx) ** 2  # token counts spread by a quarter of their mean
        b = max(0.0, (self.sxy - self.sx * self.sy) / var) if spread else prior_slope
        a = max(0.0, self.sy - b * self.sx)
        return a + b * x


class EngineEstimates:
    """A ``Lifecycle`` subscriber (``on_leg_done``) and the ``Measured`` the cost model reads."""

    def __init__(self) -> None:
        self._speed: dict[str, float] = {}
        self._pairs: dict[tuple[str, str], LinearFit] = {}
        self._pool = LinearFit()

    # -- what policies read ------------------------------------------------------------------------

    def prefill_s_per_token(self, url: str) -> float | None:
        return self._speed.get(url)

    def handover(self, prefill: str, decode: str, tokens: int, prior_s_per_token: float) -> HandoverEstimate | None:
        fit = self._pairs.get((prefill, decode))
        if fit is not None and fit.n >= MIN_HANDOVER_SAMPLES:
            return HandoverEstimate(fit.predict(tokens, prior_s_per_token), "pair", fit.n)
        if self._pool.n >= MIN_HANDOVER_SAMPLES:
            return HandoverEstimate(self._pool.predict(tokens, prior_s_per_token), "pool", self._pool.n)
        return None

    def handover_stats(self) -> dict[str, dict[str, float]]:
        """Per pair: samples and mean seconds (for /debug/route and metrics)."""
        return {
            f"{p} -> {d}": {"samples": f.n, "mean_s": round(f.sy, 6), "mean_tokens": round(f.sx, 1)}
            for (p, d), f in self._pairs.items()
        }

    # -- hooks ---------------------------------------------------------------------------------------

    def on_leg_done(self, ctx: RequestContext, leg: LegReport) -> None:
        if leg.outcome is not LegOutcome.OK and leg.outcome is not LegOutcome.CUT:
            return
        if leg.leg == "prefill":
            self._learn_speed(ctx, leg)
        elif leg.path is Path.PD and leg.prefill_url is not None and leg.first_token_s is not None:
            fit = self._pairs.get((leg.prefill_url, leg.url))
            if fit is None:
                fit = self._pairs[(leg.prefill_url, leg.url)] = LinearFit()
            fit.add(leg.uncached_tokens, leg.first_token_s)
            self._pool.add(leg.uncached_tokens, leg.first_token_s)

    def _learn_speed(self, ctx: RequestContext, leg: LegReport) -> None:
        computed = leg.uncached_tokens
        if leg.cached_tokens is not None:
            computed = max(ctx.prompt_tokens - leg.cached_tokens, 0)
        if computed < MIN_LEARN_TOKENS:
            return
        sample = leg.seconds / (leg.queued_tokens + computed)
        old = self._speed.get(leg.url)
        self._speed[leg.url] = sample if old is None else old + SPEED_ALPHA * (sample - old)

    def forget(self, url: str) -> None:
        self._speed.pop(url, None)
        for pair in [p for p in self._pairs if url in p]:
            del self._pairs[pair]
