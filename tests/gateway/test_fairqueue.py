"""The fair queue: who is served first, by priority, weighted per-phase use, then arrival; bounds."""

from __future__ import annotations

import asyncio
import math

import pytest

from gateway.fairness.fairqueue import FairQueue, QueueFull
from gateway.fairness.tenants import Identity, Usage


def who(tenant: str, priority: int = 0, weight: float = 1.0) -> Identity:
    return Identity(tenant, weight, "c", priority, None, False)


def order(q: FairQueue) -> list[str]:
    out = []
    while (w := q.pop_best()) is not None:
        out.append(w.who.tenant)
    return out


async def test_unfair_is_fifo() -> None:
    usage = Usage()
    usage.decode_started("a", 10_000)
    q = FairQueue("decode", usage)
    for t in ["a", "b", "a", "c"]:
        q.join(who(t))
    assert order(q) == ["a", "b", "a", "c"]


async def test_priority_first_then_the_tenant_that_uses_the_pool_least() -> None:
    usage = Usage()
    usage.decode_started("flood", 5000)
    usage.decode_started("steady", 300)
    q = FairQueue("decode", usage, fair=True)
    for t in ["flood", "flood", "steady", "flood", "steady"]:
        q.join(who(t))
    q.join(who("batch", priority=10))
    q.join(who("urgent", priority=-10))
    # urgent by class; then steady's waiters before any of flood's; batch last whatever its use
    assert order(q) == ["urgent", "steady", "steady", "flood", "flood", "flood", "batch"]


async def test_use_is_per_phase() -> None:
    """A tenant heavy on prefill is not held back in the decode queue, and the reverse."""
    usage = Usage()
    usage.prefill_sent("long", 100_000)
    usage.decode_started("chatty", 4000)
    prefill, decode = FairQueue("prefill", usage, fair=True), FairQueue("decode", usage, fair=True)
    for q in (prefill, decode):
        q.join(who("long"))
        q.join(who("chatty"))
    assert order(prefill) == ["chatty", "long"]
    assert order(decode) == ["long", "chatty"]


async def test_weights_scale_use() -> None:
    usage = Usage()
    usage.decode_started("big", 3000)  # weight 4: 750 per unit of share
    usage.decode_started("small", 1000)  # weight 1: 1000
    q = FairQueue("decode", usage, fair=True)
    q.join(who("small"))
    q.join(who("big", weight=4))
    assert order(q) == ["big", "small"]


async def test_a_tenant_whose_leg_just_ended_still_waits_behind_one_that_had_none() -> None:
    usage = Usage()
    k = usage.decode_started("flood", 50)
    q = FairQueue("decode", usage, fair=True)
    q.join(who("flood"))
    q.join(who("calm"))
    usage.decode_ended(k, 50)  # its slot frees: the next is chosen
    assert order(q) == ["calm", "flood"]


async def test_the_order_follows_use_as_it_changes() -> None:
    usage = Usage()
    q = FairQueue("decode", usage, fair=True)
    for t in ["a", "a", "b", "b"]:
        q.join(who(t))
    served = []
    for _ in range(4):  # each served request occupies the decode pool
        w = q.pop_best()
        assert w is not None
        served.append(w.who.tenant)
        usage.decode_started(w.who.tenant, 100)
    assert served == ["a", "b", "a", "b"]  # round robin between equals


async def test_prefill_use_fades() -> None:
    now = [0.0]
    usage = Usage(half_life_s=10, clock=lambda: now[0])
    usage.prefill_sent("a", 8000)
    now[0] = 30.0
    assert usage.of("prefill", "a") == pytest.approx(1000)
    now[0] = 1000.0
    assert usage.snapshot()["prefill"] == {}  # faded out: forgotten


async def test_decode_occupancy_ends_with_the_leg_its_use_fades() -> None:
    now = [0.0]
    usage = Usage(half_life_s=10, clock=lambda: now[0])
    k1 = usage.decode_started("a", 100)
    k2 = usage.decode_started("a", 50)
    usage.decode_ended(k1, 100)
    assert usage.of("occupancy", "a") == 50
    usage.decode_ended(k2, 50)
    assert usage.snapshot()["occupancy"] == {}
    # what it took is remembered: a tenant that just had the pool waits behind one that did not
    assert usage.of("decode", "a") == 150
    now[0] = 10.0
    assert usage.of("decode", "a") == pytest.approx(75)


async def test_decode_use_is_settled_to_the_tokens_produced() -> None:
    """Charged up front at the expected output, a request's decode use is corrected at its end: a
    tenant that sent no max_tokens (charged the default) and got a long answer now waits behind one
    whose max_tokens was large but whose answer was short."""
    usage = Usage(half_life_s=10, clock=lambda: 0.0)
    greedy = usage.decode_started("greedy", 256)  # no max_tokens: the default
    modest = usage.decode_started("modest", 4000)  # asked many, stopped early
    assert order_of(usage, "greedy", "modest") == ["greedy", "modest"]
    usage.decode_settled(greedy, 256, 3000, since=0.0)
    usage.decode_settled(modest, 4000, 20, since=0.0)
    assert (usage.of("decode", "greedy"), usage.of("decode", "modest")) == (3000, 20)
    assert order_of(usage, "greedy", "modest") == ["modest", "greedy"]
    usage.decode_settled(modest, 5000, 0, since=0.0)  # never below nothing
    assert usage.of("decode", "modest") == 0
    usage.decode_settled("unknown", 10, 99, since=0.0)  # a tenant no longer tracked: nothing to settle
    assert "unknown" not in usage.snapshot()["decode"]


async def test_a_long_answers_decode_use_is_settled_as_if_taken_as_it_came() -> None:
    """Charged 256 at the start, 1,000 tokens produced over one half-life: what remains is what
    1,000 tokens taken evenly over that time leave (1000 x (1 - 1/2) / ln 2), not 1,000 - 256."""
    now = [0.0]
    usage = Usage(half_life_s=10, clock=lambda: now[0])
    k = usage.decode_started("a", 256)
    now[0] = 10.0
    assert usage.of("decode", "a") == pytest.approx(128)
    usage.decode_settled(k, 256, 1000, since=0.0)
    assert usage.of("decode", "a") == pytest.approx(1000 * 0.5 / math.log(2))


def order_of(usage: Usage, *tenants: str) -> list[str]:
    q = FairQueue("decode", usage, fair=True)
    for t in tenants:
        q.join(who(t))
    return order(q)


async def test_bounds() -> None:
    q = FairQueue("decode", Usage(), fair=True, max_queued=4, max_per_tenant=2)
    q.join(who("a"))
    q.join(who("a"))
    with pytest.raises(QueueFull) as full:
        q.join(who("a"))
    assert full.value.why == "tenant_queue_full"
    q.join(who("b"))
    q.join(who("c"))
    with pytest.raises(QueueFull) as full:
        q.join(who("d"))
    assert full.value.why == "queue_full"
    assert len(q) == 4


async def test_tenants_tracked_are_bounded_and_faded_ones_make_room() -> None:
    now = [0.0]
    usage = Usage(half_life_s=1, max_tenants=2, clock=lambda: now[0])
    usage.decode_started("a", 1)
    kb = usage.decode_started("b", 1)
    assert usage.decode_started("c", 1) == "other"
    assert usage.key("a") == "a"
    assert usage.of("occupancy", "other") == 1
    usage.decode_ended(kb, 1)  # b's leg ended, and its use fades out
    now[0] = 60.0
    assert usage.key("d") == "d"  # the full table was swept: room for a new tenant
    assert usage.key("e") == "other"


async def test_others_replicas_use_counts() -> None:
    usage = Usage()
    usage.decode_started("a", 100)
    usage.others["decode"] = {"b": 500}
    q = FairQueue("decode", usage, fair=True)
    q.join(who("b"))
    q.join(who("a"))
    assert order(q) == ["a", "b"]


async def test_wait_wake_requeue_and_before() -> None:
    usage = Usage()
    usage.decode_started("flood", 1000)
    q = FairQueue("decode", usage, fair=True)
    f = q.join(who("flood"))
    assert q.before(who("flood")) is True  # equal use, earlier arrival
    assert q.before(who("new")) is False  # a tenant using nothing would go first
    waiting = asyncio.create_task(q.wait(f, 5))
    await asyncio.sleep(0)
    assert q.wake() is True
    assert await waiting is True
    assert len(q) == 0 and q.wake() is False
    q.requeue(f)  # served but no room after all: first in line again
    g = q.join(who("flood"))
    assert q.best() is f
    assert q.ahead(g) == (1, 0)
    assert await q.wait(g, 0.01) is False
    q.remove(f)
    q.remove(g)
    assert len(q) == 0 and q.best() is None


async def test_a_served_waiter_keeps_its_turn_until_it_takes_its_room() -> None:
    """Between its wake-up and its turn on the event loop, a newcomer must not take its room."""
    fifo = FairQueue("decode", Usage())
    w = fifo.join(who("a"))
    assert fifo.wake() and len(fifo) == 0
    assert fifo.before(who("b")) is True
    fifo.remove(w)
    assert fifo.before(who("b")) is False
    usage = Usage()
    usage.decode_started("flood", 100)
    fair = FairQueue("decode", usage, fair=True)
    f = fair.join(who("flood"))
    assert fair.wake()
    assert fair.before(who("calm")) is False  # a newcomer that used nothing still goes first
    assert fair.before(who("flood")) is True
    fair.requeue(f)
    assert fair.best() is f


async def test_the_second_in_line_does_not_look_past_a_served_first() -> None:
    """Room freed and handed to the first in line: until that waiter has run, the next one's
    periodic look does not find itself next (it would take the room handed to the first)."""
    usage = Usage()
    usage.prefill_sent("flood", 1000)
    q = FairQueue("prefill", usage, fair=True)
    flood, calm = q.join(who("flood")), q.join(who("calm"))
    assert q.next_is(calm) and not q.next_is(flood)
    assert q.wake()  # calm is served; flood is now first in the line, but not next
    assert q.best() is flood and not q.next_is(flood)
    q.remove(calm)  # calm took its room and left
    assert q.next_is(flood)


async def test_room_no_one_can_use_is_passed_on_once_around_the_line() -> None:
    """Waiters that must avoid the engine with room (migrations' continuations) pass it on; one
    that passed it is not told again until new room frees, so two of them cannot hand it back
    and forth without end."""
    q = FairQueue("decode", Usage(), fair=True)
    a, b = q.join(who("a")), q.join(who("b"))
    assert q.wake() and a.fut.done()  # a is told; it cannot use the room
    q.requeue(a)
    assert q.pass_on(a) and b.fut.done()  # b is told instead; it cannot use it either
    q.requeue(b)
    assert q.pass_on(b) is False  # a passed this room already: nobody is told
    assert not a.fut.done() and not b.fut.done()
    assert q.wake() and a.fut.done()  # new room: a looks again
