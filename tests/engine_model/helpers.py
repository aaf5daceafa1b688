"""What the engine tests share: an engine served in-process (its side channel on loopback TCP),
requests submitted straight to it, and readers for its metrics."""

from __future__ import annotations

import asyncio
import contextlib

from engine_model.config import SimConfig
from engine_model.seq import Collector, Seq
from sim.state import SimState


@contextlib.asynccontextmanager
async def running(**kw):
    state = SimState(SimConfig(**kw))
    await state.start()
    try:
        yield state
    finally:
        await state.stop()


def make_seq(rid: str, prompt: list[int], max_tokens: int, **kw) -> Seq:
    return Seq(rid, prompt, max_tokens, collector=Collector(1), **kw)


async def run(state: SimState, seq: Seq, timeout: float = 5.0) -> Seq:
    state.engine.submit(seq)
    await asyncio.wait_for(seq.collector.done, timeout)
    return seq


def hist_count(lazy_hist) -> float:
    return sum(b.get() for b in lazy_hist.child._buckets)


def text_of(seq: Seq) -> str:
    return "".join(seq.pieces)
