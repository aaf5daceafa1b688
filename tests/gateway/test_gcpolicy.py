"""The collector policy: what startup leaves alive is frozen out of full collections, cycles that
become garbage among frozen objects are collected at the next settle, reloads settle later."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator

import pytest

from gateway.ops.gcpolicy import Collector


@pytest.fixture(autouse=True)
def _restore_gc() -> Iterator[None]:
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


class Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the cyclic collector frees it


def test_settle_freezes_what_is_alive() -> None:
    keep = [Node() for _ in range(1000)]
    c = Collector()
    c.settle()
    assert c.frozen == gc.get_freeze_count() >= 1000
    assert not any(gc.is_tracked(n) and n in gc.get_objects(generation=2) for n in keep[:3])
    gc.collect()  # a full collection no longer walks them
    assert gc.get_freeze_count() == c.frozen


def test_frozen_cycles_are_collected_at_the_next_settle() -> None:
    node = Node()
    ref = weakref.ref(node)
    c = Collector()
    c.settle()
    del node
    gc.collect()
    assert ref() is not None  # frozen: full collections leave it
    c.settle()
    assert ref() is None


def test_tune_sets_the_young_threshold_only() -> None:
    _, older, oldest = gc.get_threshold()
    Collector(young=5000).tune()
    assert gc.get_threshold() == (5000, older, oldest)


async def test_a_reload_settles_later_once() -> None:
    c = Collector(settle_after_s=0.05)
    c.settle_later()
    c.settle_later()  # a second reload restarts the wait
    assert c.frozen == 0
    await asyncio.sleep(0.2)
    assert c.frozen > 0
    c.close()


async def test_close_cancels_a_pending_settle() -> None:
    c = Collector(settle_after_s=0.05)
    c.settle_later()
    c.close()
    await asyncio.sleep(0.15)
    assert c.frozen == 0
