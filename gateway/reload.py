"""Watch the config file and apply valid edits while serving.

Both ways a file changes are covered: an in-place edit, and the Kubernetes ConfigMap way, where the
mounted file is a symlink through ``..data`` and an update swaps that symlink to a new directory
(the file's inode never changes; only the directory sees events). So the watcher watches the
file's directory and, on any event there or every ``poll_s`` at the latest, compares the file's
bytes with the running version's.

A file caught in the middle of a write must never be applied: a writer that pauses after a valid
YAML prefix (without, say, the ``auth`` section) would otherwise switch authentication off for the
pause. So a new content is applied only once the file has held still (same bytes, size and mtime)
for ``settle_s``, and parses and validates whole. Editors and ConfigMaps write atomically (a new
file renamed over the old): do the same (docs/operations.md, "Hot reload").
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

from watchfiles import awatch

from .config import ConfigError, GatewayConfig, load_config
from .tasks import cancel_checkpoint, stop_task

log = logging.getLogger(__name__)


SETTLE_S = 1.0  # how long a new config file must hold still before it is applied


def version_of(text: bytes) -> str:
    return hashlib.sha256(text).hexdigest()[:12]


class ConfigWatcher:
    """Calls ``apply(cfg, version)`` for each new valid content of ``path``; ``apply`` raises
    ValueError to reject a config that parses but cannot be used (e.g. an unknown policy)."""

    def __init__(
        self,
        path: str | Path,
        version: str,
        apply: Callable[[GatewayConfig, str], Awaitable[None]],
        on_result: Callable[[str, str], None],
        poll_s: float = 2.0,
        settle_s: float = SETTLE_S,
    ) -> None:
        self.path = Path(path)
        self.version = version  # of the content running now
        self._apply = apply
        self._on_result = on_result  # (result "ok" | "rejected", message)
        self._poll_s = poll_s
        self._settle_s = settle_s
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._rejected: str | None = None  # version last rejected: not re-logged on every poll
        self.last_error: str | None = None
        self.rounds = 0  # checks done by the watch loop

    def _read(self) -> tuple[bytes, tuple[int, int]] | None:
        try:
            st = self.path.stat()
            return self.path.read_bytes(), (st.st_size, st.st_mtime_ns)
        except OSError as err:  # mid-swap, or removed: keep running on the current config
            log.debug("config %s unreadable: %s", self.path, err)
            return None

    async def check(self) -> None:
        seen = self._read()
        if seen is None:
            return
        raw, stamp = seen
        version = version_of(raw)
        if version == self.version:  # unchanged, or an invalid edit was reverted
            self._rejected = self.last_error = None
            return
        if version == self._rejected:
            return
        await asyncio.sleep(self._settle_s)  # a write still going on changes the file meanwhile
        again = self._read()
        if again is None or again[1] != stamp or version_of(again[0]) != version:
            log.debug("config %s still changing; the next event or poll takes it up", self.path)
            return
        try:
            cfg = load_config(self.path, text=raw.decode("utf-8", "replace"))
            await self._apply(cfg, version)
        except (ConfigError, ValueError) as err:
            self._rejected = version
            self.last_error = str(err)
            log.error("config reload rejected, still running version %s:\n%s", self.version, err)
            self._on_result("rejected", str(err))
            return
        self.version, self._rejected, self.last_error = version, None, None
        log.info("config reloaded: version %s", version)
        self._on_result("ok", version)

    async def _run(self) -> None:
        # Only the file itself and the ConfigMap's ``..data`` swap matter; other files in the same
        # directory (logs, say) must not wake the watcher.
        names = {self.path.name, "..data", "..data_tmp"}
        async for _ in awatch(self.path.parent, stop_event=self._stop, rust_timeout=int(self._poll_s * 1000),
                              yield_on_timeout=True, debounce=200, recursive=False,
                              watch_filter=lambda _change, p: Path(p).name in names):
            try:
                await self.check()
            except Exception:  # a bug in one check must not end watching (not BaseException: stop must work)
                log.exception("config reload check failed")
            self.rounds += 1  # (tests wait on it instead of sleeping)
            cancel_checkpoint()  # a cancel a library swallowed ends the loop here (gateway/tasks.py)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="config-watcher")

    async def stop(self) -> None:
        """The stop event ends the file watch at its next poll; cancelling also ends a check that
        hangs (e.g. an apply stuck on a dead engine), within a bound (gateway/tasks.py)."""
        self._stop.set()
        task, self._task = self._task, None
        await stop_task(task)
