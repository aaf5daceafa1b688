"""Watch the config file and apply valid edits while serving.

Both ways a file changes are covered: an in-place edit, and the Kubernetes ConfigMap way, where the
mounted file is a symlink through ``..data`` and an update swaps that symlink to a new directory
(the file's inode never changes; only the directory sees events). So the watcher watches the
file's directory and, on any event there or every ``poll_s`` at the latest, compares the file's
bytes with the running version's.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

from watchfiles import awatch

from .config import ConfigError, GatewayConfig, load_config

log = logging.getLogger(__name__)


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
    ) -> None:
        self.path = Path(path)
        self.version = version  # of the content running now
        self._apply = apply
        self._on_result = on_result  # (result "ok" | "rejected", message)
        self._poll_s = poll_s
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._rejected: str | None = None  # version last rejected: not re-logged on every poll
        self.last_error: str | None = None

    async def check(self) -> None:
        try:
            raw = self.path.read_bytes()
        except OSError as err:  # mid-swap, or removed: keep running on the current config
            log.debug("config %s unreadable: %s", self.path, err)
            return
        version = version_of(raw)
        if version == self.version:  # unchanged, or an invalid edit was reverted
            self._rejected = self.last_error = None
            return
        if version == self._rejected:
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
            except Exception:  # a bug in one check must not end watching
                log.exception("config reload check failed")

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="config-watcher")

    async def stop(self) -> None:
        self._stop.set()
        if self._task:
            await asyncio.gather(self._task, return_exceptions=True)
