"""Requests waiting for one pool's capacity, served best first.

Fair: by priority (lower first), then by the tenant's weighted use of that pool (``Usage.of(phase,
tenant) / weight``: prefill tokens for the prefill pool, decode occupancy for the decode pool,
requests for the gateway's own slots), then in arrival order. A tenant that floods the pool has
the largest use, so its waiters go after everyone else's: it waits behind its own work. Unfair
(``fairness.enabled: false``): one FIFO line.

Bounded: at most ``max_queued`` waiters, and (fair) ``max_per_tenant`` of one tenant's; a waiter
holds a future and its identity (the request's body waits with its coroutine, bounded by
``server.max_body_bytes``). Choosing the next waiter scans the tenants waiting, not the waiters.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
from dataclasses import dataclass, field

from gateway.config import FairnessConfig
from gateway.fairness.tenants import Identity, Usage

_NOBODY = Identity("default", 1.0, "", 0, None, False)


class QueueFull(Exception):
    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


@dataclass(eq=False, slots=True)
class Waiter:
    who: Identity
    key: str  # the tenant as usage tracks it
    seq: int
    tokens: int  # its own cost in this pool (uncached prompt tokens), for the estimate of the wait
    fut: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    @property
    def group(self) -> tuple[int, str]:
        return self.who.priority, self.key


class FairQueue:
    def __init__(
        self, phase: str, usage: Usage, *, fair: bool = False, max_queued: int = 0, max_per_tenant: int = 0
    ) -> None:
        self.phase = phase
        self._usage = usage
        self.fair, self.max_queued, self.max_per_tenant = fair, max_queued, max_per_tenant
        self._groups: dict[tuple[int, str], collections.deque[Waiter]] = {}
        self._count = 0
        self._seq = itertools.count()
        self._woken: set[Waiter] = set()  # served, not yet gone or back in line: still first
        self._passed: set[Waiter] = set()  # passed the room freed last on (it could not use it)

    def configure(self, fair: bool, max_queued: int, max_per_tenant: int) -> None:
        self.fair, self.max_queued, self.max_per_tenant = fair, max_queued, max_per_tenant

    def __len__(self) -> int:
        return self._count

    def join(self, who: Identity | None = None, tokens: int = 0) -> Waiter:
        """Raises QueueFull when the queue, or (fair) this tenant's part of it, is full."""
        who = who or _NOBODY
        if self.max_queued and self._count >= self.max_queued:
            raise QueueFull("queue_full")
        w = Waiter(who, self._usage.key(who.tenant) if self.fair else "", next(self._seq), tokens)
        group = self._groups.setdefault(w.group, collections.deque())
        if (
            self.fair
            and self.max_per_tenant
            and sum(len(g) for (_, k), g in self._groups.items() if k == w.key) >= self.max_per_tenant
        ):
            if not group:
                del self._groups[w.group]
            raise QueueFull("tenant_queue_full")
        group.append(w)
        self._count += 1
        return w

    def requeue(self, w: Waiter) -> None:
        """A waiter that was served but found no room after all: first in its group again."""
        self._woken.discard(w)
        w.fut = asyncio.get_running_loop().create_future()
        self._groups.setdefault(w.group, collections.deque()).appendleft(w)
        self._count += 1

    def remove(self, w: Waiter) -> None:
        self._woken.discard(w)
        self._passed.discard(w)
        group = self._groups.get(w.group)
        if group is not None and w in group:
            group.remove(w)
            self._count -= 1
            if not group:
                del self._groups[w.group]

    def _rank(self, group: tuple[int, str], head: Waiter) -> tuple[float, ...]:
        if not self.fair:
            return (head.seq,)
        return group[0], self._usage.of(self.phase, group[1]) / head.who.weight, head.seq

    def best(self) -> Waiter | None:
        """The waiter to be served next, left in the queue."""
        if not self._groups:
            return None
        group = min(self._groups, key=lambda g: self._rank(g, self._groups[g][0]))
        return self._groups[group][0]

    def next_is(self, w: Waiter) -> bool:
        """Whether ``w`` is next to take room that frees: first in line, and no waiter already
        served (woken, not yet on the event loop) is about to take it. A periodic look that asked
        only ``best()`` would let the second in line take the room just handed to the first."""
        return not self._woken and self.best() is w

    def before(self, who: Identity | None) -> bool:
        """Whether a waiter would be served before a newcomer ``who`` (FIFO: anyone waiting, or
        served and about to take its room)."""
        firsts = [w for w in (self.best(), *self._woken) if w is not None]
        if not firsts or not self.fair:
            return bool(firsts)
        who = who or _NOBODY
        key = self._usage.key(who.tenant)
        mine = (who.priority, self._usage.of(self.phase, key) / who.weight, float("inf"))
        return any(self._rank(w.group, w) < mine for w in firsts)

    def pop_best(self) -> Waiter | None:
        """The next waiter to serve, out of the queue (waiters whose wait ended are dropped)."""
        while self._groups:
            group = min(self._groups, key=lambda g: self._rank(g, self._groups[g][0]))
            line = self._groups[group]
            w = line.popleft()
            self._count -= 1
            if not line:
                del self._groups[group]
            if not w.fut.done():
                return w
        return None

    def wake(self) -> bool:
        """Room freed: tell the best waiter (it takes the room, or requeues). False: nobody waits."""
        self._passed.clear()  # new room: every waiter may look at it
        return self._serve(self.pop_best())

    def pass_on(self, w: Waiter) -> bool:
        """``w`` (back in line) was served but cannot use the room (it must avoid the engine that
        has it): the best waiter that has not passed this room on yet is told instead. Without
        that memory, two such waiters would hand the room back and forth without end."""
        self._passed.add(w)
        heads = [
            (group, head)
            for group, line in self._groups.items()
            if (head := next((x for x in line if x not in self._passed and not x.fut.done()), None)) is not None
        ]
        if not heads:
            return False
        _, head = min(heads, key=lambda gh: self._rank(*gh))
        self.remove(head)
        return self._serve(head)

    def _serve(self, w: Waiter | None) -> bool:
        """``w`` is told to look for its room; it counts as first until it has run."""
        if w is None:
            return False
        w.fut.set_result(None)
        self._woken.add(w)
        return True

    async def wait(self, w: Waiter, timeout: float) -> bool:
        """True once woken, False after ``timeout`` (still queued)."""
        try:
            async with asyncio.timeout(timeout):
                await asyncio.shield(w.fut)
            return True
        except TimeoutError:
            return w.fut.done()

    def ahead(self, w: Waiter) -> tuple[int, int]:
        """Waiters served before ``w`` as things stand, and their tokens."""
        mine = self._rank(w.group, w)
        n = tokens = 0
        for group, line in self._groups.items():
            for other in line:
                if other is not w and self._rank(group, other) < mine:
                    n += 1
                    tokens += other.tokens
        return n, tokens


class PoolQueues:
    """The engine pools' queues: one per pool and model (room on one model's engines says nothing
    about another's), all in one order (``configure``)."""

    def __init__(self, usage: Usage, cfg: FairnessConfig | None = None) -> None:
        self._usage = usage
        self._cfg = cfg or FairnessConfig()
        self._queues: dict[tuple[str, str], FairQueue] = {}

    def get(self, pool: str, model: str) -> FairQueue:
        q = self._queues.get((pool, model))
        if q is None:
            f = self._cfg
            q = self._queues[(pool, model)] = FairQueue(
                pool, self._usage, fair=f.enabled, max_queued=f.max_queued, max_per_tenant=f.max_queued_per_tenant
            )
        return q

    def released(self, pool: str) -> None:
        """A slot in ``pool`` is free: the best waiter of each model's queue looks."""
        for (p, _), q in self._queues.items():
            if p == pool and q:
                q.wake()

    def configure(self, cfg: FairnessConfig) -> None:
        """A reload: every queue takes the new order and bounds, and its first waiters look again
        (a raised limit frees room nobody signals)."""
        self._cfg = cfg
        for q in self._queues.values():
            q.configure(cfg.enabled, cfg.max_queued, cfg.max_queued_per_tenant)
            if q:
                q.wake()

    def queued(self) -> list[tuple[str, int]]:
        return [(pool, len(q)) for (pool, _), q in list(self._queues.items())]
