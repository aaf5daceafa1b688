"""Stopping the gateway's own background tasks within a bound, so shutdown (SIGTERM) never hangs.

``task.cancel()`` only asks. A library can swallow the CancelledError: on Python 3.11,
``asyncio.wait_for`` returns the inner result when the inner awaitable finishes in the same loop
step as the cancel, and redis-py sends every command under it, so a Redis sync loop cancelled at
the wrong moment just carries on. A task can also sit in cleanup that waits on a dead peer. A
shutdown that awaits such a task never returns, and a replica that never exits blocks a rolling
update. So:

- ``stop_task``/``stop_tasks`` cancel, wait a short while, cancel again while a task still runs
  (the first request may have been swallowed), and after ``bound_s`` give up with a WARNING naming
  the task: shutdown goes on either way;
- loops call ``cancel_checkpoint()`` once per round, so a stop whose cancellation was swallowed
  inside the round ends the loop there rather than at the next re-cancel.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Iterable

log = logging.getLogger(__name__)

STOP_BOUND_S = 5.0  # longest a stop waits for its tasks, all re-cancels included
RECANCEL_AFTER_S = 0.1  # first wait before cancelling again; doubles up to _RECANCEL_MAX_S
_RECANCEL_MAX_S = 1.0


_stopping: weakref.WeakSet[asyncio.Task[object]] = weakref.WeakSet()  # tasks a stop has asked to end


def cancel_checkpoint() -> None:
    """Raise CancelledError if ``stop_task``/``stop_tasks`` asked this task to end and the
    cancellation got lost on the way (a library swallowed it).

    A set of its own rather than ``Task.cancelling()``: a library that forgets to ``uncancel()``
    after its own timeout would leave that count up and end a loop nobody asked to stop.
    """
    task = asyncio.current_task()
    if task is not None and task in _stopping:
        raise asyncio.CancelledError


async def stop_task(task: asyncio.Task[object] | None, *, bound_s: float = STOP_BOUND_S, grace_s: float = 0.0) -> bool:
    """Cancel ``task`` and wait at most ``bound_s`` for it to end; True when it did (or was done)."""
    return await stop_tasks([task], bound_s=bound_s, grace_s=grace_s)


async def stop_tasks(
    tasks: Iterable[asyncio.Task[object] | None], *, bound_s: float = STOP_BOUND_S, grace_s: float = 0.0
) -> bool:
    """Cancel ``tasks`` and wait, all together, at most ``bound_s`` for them to end, cancelling
    again those still running after a short wait (their first cancel may have been swallowed).

    ``grace_s`` (within ``bound_s``): first let the tasks end on their own for that long, for work
    worth finishing (a last round trip) whose library may not honour a timeout's own cancel.
    Never raises for the tasks' own outcome (an error they ended with is logged) and never waits
    longer than ``bound_s``: a task that will not end is named in a WARNING and left behind.
    Returns True when every task ended. A cancellation of the caller itself propagates.
    """
    pending = {t for t in tasks if t is not None and t is not asyncio.current_task()}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound_s
    if pending and grace_s > 0:
        done, pending = await asyncio.wait(pending, timeout=min(grace_s, bound_s))
        for t in done:
            _collect(t)
    _stopping.update(pending)
    wait = RECANCEL_AFTER_S
    while pending:
        for t in pending:
            t.cancel()
        left = deadline - loop.time()
        if left <= 0:
            break
        done, pending = await asyncio.wait(pending, timeout=min(wait, left))
        for t in done:
            _collect(t)
        wait = min(wait * 2, _RECANCEL_MAX_S)
    for t in pending:
        log.warning(
            "background task %r did not end within %.1f s of being cancelled; shutdown goes on without it",
            t.get_name(),
            bound_s,
        )
    return not pending


def _collect(task: asyncio.Task[object]) -> None:
    """Retrieve a finished task's outcome (else asyncio logs "exception never retrieved" later)."""
    if task.cancelled():
        return
    err = task.exception()
    if err is not None:
        log.warning("background task %r ended with an error", task.get_name(), exc_info=err)
