"""Waiting for room on the engines (gateway/request/capacity.py): a waiter's periodic look."""

from __future__ import annotations

import asyncio

import pytest

from gateway.fairness.fairqueue import FairQueue
from gateway.fairness.tenants import Identity, Usage
from gateway.request import capacity
from gateway.request.capacity import wait_for_room


def who(tenant: str) -> Identity:
    return Identity(tenant, 1.0, "c", 0, None, False)


@pytest.fixture(autouse=True)
def quick_looks(monkeypatch):
    monkeypatch.setattr(capacity, "QUEUE_SLICE_S", 0.01)


async def test_a_look_does_not_take_room_handed_to_a_waiter_that_has_not_run_yet() -> None:
    """Room freed and handed to the first in line: until that waiter has run (taken the room or
    gone back in line), the second one's looks do not end its wait."""
    usage = Usage()
    usage.prefill_sent("flood", 1000)
    q = FairQueue("prefill", usage, fair=True)
    flood, calm = q.join(who("flood")), q.join(who("calm"))
    assert q.wake()  # calm is served; its coroutine has not run
    waiting = asyncio.create_task(wait_for_room(q, flood, 5.0))
    await asyncio.sleep(0.2)  # twenty looks
    assert not waiting.done()
    q.remove(calm)  # calm took its room and left: flood's next look finds itself next
    assert await asyncio.wait_for(waiting, 1.0) < 5.0


async def test_a_look_ends_the_wait_of_the_first_in_line() -> None:
    q = FairQueue("decode", Usage(), fair=True)
    w = q.join(who("a"))
    assert await asyncio.wait_for(wait_for_room(q, w, 5.0), 1.0) < 5.0  # room other replicas free


async def test_the_wait_ends_at_its_limit() -> None:
    q = FairQueue("decode", Usage(), fair=True)
    q.join(who("a"))
    b = q.join(who("b"))
    assert 0.05 <= await wait_for_room(q, b, 0.05) < 1.0
