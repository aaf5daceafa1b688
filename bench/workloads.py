"""Workloads for the goodput benchmark: request shapes, arrival processes and SLOs.

Every length is in model tokens and every time in *simulated* seconds (the engines' time scale
converts to wall time). Prompts are token-id lists sent to ``/v1/completions``, so every router
and engine sees exactly the intended length, with no tokenizer in the way.

| workload | input tokens | output tokens | SLO (TTFT, p90 ITL; tail SLO adds p99 ITL <= 100 ms) |
| --- | --- | --- | --- |
| ``long`` | 4,096-16,384 | 256-1,024 | 3 s, 50 ms |
| ``chat`` | 100-1,500 | 50-400 | 1 s, 50 ms |
| ``mix`` | 30% long, 70% chat | as each | as each request's class |
| ``multiturn`` | shared 1,024-token system prompt + the conversation so far + 200-800 new | 100-400 | 2 s, 50 ms |

``long`` is where AWS reports disaggregation paying off (4k+ input tokens); ``chat`` is where it
should not (the prefill is short, the extra hop and KV transfer are pure cost). The ITL
percentiles of an SLO are taken over each request's own inter-token gaps; the *tail SLO* also
bounds their p99, i.e. how often a stream freezes while a long prompt is prefilled next to it. Multi-turn
conversations (4-8 turns, one every ~8 s simulated) share their prefix with every earlier turn and
all share the system prompt, which is where prefix-aware routing matters.

Arrivals: ``poisson`` (exponential gaps) or ``bursty`` (gamma gaps with a coefficient of variation
of 3: the same mean rate in clumps). Uniform draws everywhere, from one seeded PRNG per run, so a
configuration compared with another sees exactly the same requests.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

VOCAB_LOW, VOCAB_HIGH = 10, 2000  # ids the benchmark tokenizer has (sim checks the vocabulary)
WORKLOADS = ("long", "chat", "mix", "multiturn")
ARRIVALS = ("poisson", "bursty")
BURSTY_CV = 3.0


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    itl_p90_s: float
    itl_p99_s: float = 0.100  # the tail SLO: no more than 1% of a stream's gaps above 100 ms


SLOS = {
    "long": SLO(3.0, 0.050),
    "chat": SLO(1.0, 0.050),
    "turn": SLO(2.0, 0.050),
}


@dataclass
class Request:
    idx: int
    arrival_s: float  # simulated seconds after the start of the run
    prompt: list[int]
    max_tokens: int
    klass: str  # "long" | "chat" | "turn": picks the SLO
    session: int | None = None

    @property
    def slo(self) -> SLO:
        return SLOS[self.klass]


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]


def _gaps(rng: random.Random, rate: float, arrivals: str):
    if arrivals == "poisson":
        while True:
            yield rng.expovariate(rate)
    shape = 1 / BURSTY_CV**2  # gamma with mean 1/rate and CV 3
    while True:
        yield rng.gammavariate(shape, 1 / (rate * shape))


def _arrival_times(rng: random.Random, rate: float, duration_s: float, arrivals: str) -> list[float]:
    out: list[float] = []
    t = 0.0
    for gap in _gaps(rng, rate, arrivals):
        t += gap
        if t >= duration_s:
            return out
        out.append(t)
    return out  # pragma: no cover - the generator is endless


def generate(
    workload: str,
    rate: float,
    duration_s: float,
    arrivals: str = "poisson",
    seed: int = 0,
    scale_output: float = 1.0,
) -> list[Request]:
    """The requests of one run: ``rate`` requests per simulated second for ``duration_s``.
    ``scale_output`` shrinks the output lengths (``--quick``); prompts keep their lengths, which
    decide the path."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; one of {', '.join(WORKLOADS)}")
    if arrivals not in ARRIVALS:
        raise ValueError(f"unknown arrival process {arrivals!r}; one of {', '.join(ARRIVALS)}")
    rng = random.Random(f"{workload}/{arrivals}/{rate}/{seed}")

    def n(lo: int, hi: int) -> int:
        return rng.randint(lo, hi)

    def out(lo: int, hi: int) -> int:
        return max(2, round(rng.randint(lo, hi) * scale_output))

    def one(klass: str) -> tuple[list[int], int]:
        if klass == "long":
            return _ids(rng, n(4096, 16384)), out(256, 1024)
        return _ids(rng, n(100, 1500)), out(50, 400)

    times = _arrival_times(rng, rate, duration_s, arrivals)
    if workload != "multiturn":
        reqs = []
        for i, t in enumerate(times):
            klass = workload if workload != "mix" else ("long" if rng.random() < 0.3 else "chat")
            prompt, n_out = one(klass)
            reqs.append(Request(i, t, prompt, n_out, klass))
        return reqs

    # Multi-turn: the arrival process starts conversations (one per ~5 turns of the rate);
    # each turn resends the whole conversation so far plus a new user message.
    system = _ids(rng, n(1024, 1024))
    reqs = []
    starts = _arrival_times(rng, rate / 5, duration_s, arrivals)
    for s, t0 in enumerate(starts):
        history = list(system)
        t = t0
        for _turn in range(rng.randint(4, 8)):
            if t >= duration_s:
                break
            history += _ids(rng, n(200, 800))
            n_out = out(100, 400)
            reqs.append(Request(0, t, list(history), n_out, "turn", session=s))
            history += _ids(rng, n_out)  # the assistant's answer, as the client would resend it
            t += rng.uniform(6.0, 10.0)
    reqs.sort(key=lambda r: r.arrival_s)
    for i, r in enumerate(reqs):
        r.idx = i
    return reqs
