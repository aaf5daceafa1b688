"""What a KV event feed says about itself: counters for the metrics, and a log that a broken or
forged feed cannot flood (one line per interval at most). Kept apart from the subscriber
(``kvevents.py``), which only applies events."""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass

log = logging.getLogger("gateway.engines.kvevents")  # the feed's own lines, under the feed's name
LOG_INTERVAL_S = 10.0  # a feed's troubles: one log line per interval at most


class FeedLog:
    """One feed's troubles in the log, at most one line per ``interval_s``: the first at once, the
    ones after it counted by kind and told in one line when the interval is over (with the latest
    message). A broken or forged feed could otherwise write thousands of lines a second."""

    def __init__(self, name: str, interval_s: float = LOG_INTERVAL_S) -> None:
        self._name = name
        self.interval_s = interval_s
        self._last_line = float("-inf")
        self._held: Counter[str] = Counter()
        self._level = logging.INFO
        self._latest: tuple[str, tuple[object, ...]] = ("", ())

    def __call__(self, kind: str, level: int, msg: str, *args: object, exc_info: bool = False) -> None:
        now = time.monotonic()
        if not self._held and now - self._last_line >= self.interval_s:
            self._last_line = now
            log.log(level, "kv events %s: " + msg, self._name, *args, exc_info=exc_info)
            return
        self._held[kind] += 1
        self._level = max(self._level, level)
        self._latest = (msg, args)
        self.flush(now)

    def flush(self, now: float | None = None, *, force: bool = False) -> None:
        """Tell what was held back, once the interval since the last line is over (or now: ``force``)."""
        now = time.monotonic() if now is None else now
        if not self._held or (now - self._last_line < self.interval_s and not force):
            return
        counts = ", ".join(f"{n} {kind}" for kind, n in self._held.most_common())
        msg, args = self._latest
        log.log(
            self._level,
            "kv events %s: %s in the last %.0f s (latest: " + msg + ")",
            self._name,
            counts,
            now - self._last_line,
            *args,
        )
        self._held.clear()
        self._level = logging.INFO
        self._last_line = now


@dataclass
class KVEventCounters:
    """For metrics. Times are wall-clock seconds (``time.time``); None until it happened."""

    batches_applied: int = 0
    events_applied: int = 0
    gaps: int = 0  # sequence gaps seen on the live feed
    replays: int = 0  # replay requests sent
    replay_failures: int = 0  # replays that timed out or could not cover what was missing
    resyncs: int = 0  # times the engine's precise entries were dropped and rebuilt
    connects: int = 0
    reconnects: int = 0  # connects after the first
    disconnects: int = 0  # also: ZMQ dropping a peer whose message was over max_message_bytes
    restarts: int = 0  # sequence went back: a new engine process
    cleared_events: int = 0  # AllBlocksCleared received
    duplicates: int = 0  # batches already applied (replay overlap)
    decode_errors: int = 0  # messages refused: not a KV event batch, or over the bounds
    untranslatable: int = 0  # BlockStored events that could not be mapped (translation mode)
    ignored: int = 0  # events of another KV cache group, or of a tier below the GPU with tiers off
    tier_events: int = 0  # events of a tier below the GPU, taken by the tier beliefs
    last_seq: int | None = None
    last_event_time: float | None = None  # when the last batch was applied
    last_batch_ts: float | None = None  # the engine's own timestamp of that batch
    connected: bool = False
