"""Watch the config file, and the files it names, and apply valid edits while serving.

A config's meaning is its file plus the files it names (``GatewayConfig.named_files``: the API
keys, the admin token, chat templates): a key removed from the keys file is a config change like
any other. So each check reads them all; a config version is the hash of the lot; a new version is
validated whole and applied whole, its files pinned (``GatewayConfig.pin``): what runs is what
was validated, whatever happens to the files after. A restarted worker starts from the version
its siblings applied, pinned files and all (gateway/cluster/workers.py).

Both ways a file changes are covered: an in-place edit, and the Kubernetes ConfigMap (or Secret)
way, where the mounted file is a symlink through ``..data`` and an update swaps that symlink to a
new directory (the file's inode never changes; only the directory sees events). So the watcher
watches the directories of the config and of each file it names and, on any event there or every
``poll_s`` at the latest, compares their bytes with the running version's.

Files caught in the middle of a write must never be applied: a writer that pauses after a valid
YAML prefix (without, say, the ``auth`` section) would otherwise switch authentication off for the
pause. So a new content is applied only once every file has held still (same bytes, size, inode
and mtime) for ``settle_s``, and parses and validates whole. Editors and ConfigMaps write
atomically (a new file renamed over the old): do the same (docs/operations.md, "Hot reload").
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from watchfiles import awatch

from gateway.background import cancel_checkpoint, stop_task
from gateway.config import ConfigError, GatewayConfig, PinnedFiles, load_config

log = logging.getLogger(__name__)


SETTLE_S = 1.0  # how long new config files must hold still before they are applied
_NAMES = ("..data", "..data_tmp")  # a ConfigMap or Secret volume's swap, next to the files it holds


def version_of(text: bytes, files: PinnedFiles | None = None) -> str:
    """A config version: its file's bytes and, when it names any, those files' (``PinnedFiles``)."""
    digest = hashlib.sha256(text)
    if files is not None and files.files:
        digest.update(files.digest_input())
    return digest.hexdigest()[:12]


Stamp = tuple[str, int, int, int] | tuple[str, None, None, None]  # path, size, inode, mtime (None: unreadable)


def _stamp(path: Path) -> Stamp:
    try:
        st = path.stat()
    except OSError:
        return (str(path), None, None, None)
    return (str(path), st.st_size, st.st_ino, st.st_mtime_ns)


@dataclass(frozen=True)
class Snapshot:
    """The config file and the files it names, read at one moment: what a version is made of."""

    raw: bytes  # the config file's bytes
    files: PinnedFiles  # the files it names (none when it does not parse)
    stamps: tuple[Stamp, ...]  # each file's size, inode and mtime: unchanged over the settle time
    version: str

    @property
    def text(self) -> str:
        return self.raw.decode("utf-8", "replace")

    def load(self, path: str | Path) -> GatewayConfig:
        """Parse and validate the config (ConfigError), its named files pinned as read here."""
        return load_config(path, text=self.text).pin(self.files)


def read_snapshot(path: str | Path) -> Snapshot:
    """Read ``path`` and every file its config names (a config that does not parse names none).
    Raises OSError when the config file itself cannot be read."""
    path = Path(path)
    stamp = _stamp(path)
    raw = path.read_bytes()
    return _snapshot(stamp, raw, _parse(path, raw))


def _parse(path: Path, raw: bytes) -> GatewayConfig | None:
    try:
        return load_config(path, text=raw.decode("utf-8", "replace"))
    except ConfigError:
        return None


def _snapshot(stamp: Stamp, raw: bytes, parsed: GatewayConfig | None) -> Snapshot:
    """The snapshot of a config file read as ``raw`` (``parsed`` from it): its named files read now."""
    named = sorted(parsed.named_files()) if parsed is not None else []
    stamps = (stamp, *(_stamp(Path(p)) for p in named))
    files = PinnedFiles.read(named)
    return Snapshot(raw, files, stamps, version_of(raw, files))


class ConfigWatcher:
    """Calls ``apply(cfg, version)`` for each new valid content of ``path`` and the files it names
    (``cfg`` has them pinned); ``apply`` raises ValueError to reject a config that parses but
    cannot be used (e.g. an unknown policy, or API keys switched off unsaid)."""

    def __init__(
        self,
        path: str | Path,
        version: str,
        apply: Callable[[GatewayConfig, str], Awaitable[None]],
        on_result: Callable[[str, str], None],
        poll_s: float = 2.0,
        settle_s: float = SETTLE_S,
        speaks: bool = True,
    ) -> None:
        """``speaks``: logs a rejection at ERROR (else DEBUG). Every worker of one gateway watches
        the same file and rejects the same edit; one of them says so, not each."""
        self.path = Path(path)
        self._speaks = speaks
        self.version = version  # of the content running now
        self._apply = apply
        self._on_result = on_result  # (result "ok" | "rejected", message)
        self._poll_s = poll_s
        self._settle_s = settle_s
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._rejected: str | None = None  # version last rejected: not re-logged on every poll
        self._parsed: tuple[bytes, GatewayConfig | None] | None = None  # the last config bytes parsed, and how
        self.watched: frozenset[Path] = frozenset({self.path})  # the config and the files it names, last seen
        self.last_error: str | None = None
        self.rounds = 0  # checks done by the watch loop

    def _read(self) -> Snapshot | None:
        """The files as they are now; the config's parse is reused while its bytes are the same (a
        poll costs a few reads, not a validation: only a new version is validated afresh)."""
        stamp = _stamp(self.path)
        try:
            raw = self.path.read_bytes()
        except OSError as err:  # mid-swap, or removed: keep running on the current config
            log.debug("config %s unreadable: %s", self.path, err)
            return None
        if self._parsed is None or self._parsed[0] != raw:
            self._parsed = (raw, _parse(self.path, raw))
        seen = _snapshot(stamp, raw, self._parsed[1])
        self.watched = frozenset({self.path, *(Path(p) for p in seen.files.files)})
        return seen

    async def check(self) -> None:
        seen = self._read()
        if seen is None:
            return
        if seen.version == self.version:  # unchanged, or an invalid edit was reverted
            self._rejected = self.last_error = None
            return
        if seen.version == self._rejected:
            return
        await asyncio.sleep(self._settle_s)  # a write still going on changes a file meanwhile
        again = self._read()
        if again is None or again.stamps != seen.stamps or again.version != seen.version:
            log.debug("config %s or a file it names still changing; the next event or poll takes it up", self.path)
            return
        try:
            cfg = again.load(self.path)  # validated afresh, whole
            await self._apply(cfg, again.version)
        except (ConfigError, ValueError) as err:
            self._rejected = again.version
            self.last_error = str(err)
            log.log(
                logging.ERROR if self._speaks else logging.DEBUG,
                "config reload rejected, still running version %s:\n%s",
                self.version,
                err,
            )
            self._on_result("rejected", str(err))
            return
        self.version, self._rejected, self.last_error = again.version, None, None
        log.info("config reloaded: version %s", again.version)
        self._on_result("ok", again.version)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stop.is_set():
            watched = self.watched
            dirs = sorted({p.parent for p in watched if p.parent.is_dir()})
            # Only the watched files and a ConfigMap's or Secret's ``..data`` swap next to them
            # wake a check at once. The poll does not wait for a quiet directory: one where a log
            # is written under load never is (every write an event), and an event lost to a full
            # inotify queue would otherwise never be made up for.
            names = {p.name for p in watched} | set(_NAMES)
            last = loop.time()
            try:
                async with contextlib.aclosing(
                    awatch(
                        *dirs,
                        stop_event=self._stop,
                        rust_timeout=int(self._poll_s * 1000),
                        yield_on_timeout=True,
                        debounce=200,
                        recursive=False,
                        watch_filter=None,
                    )
                ) as changes:
                    async for batch in changes:  # (empty: the poll's timeout)
                        relevant = any(os.path.basename(p) in names for _, p in batch)
                        if batch and not relevant and loop.time() - last < self._poll_s:
                            continue
                        last = loop.time()
                        await self._round()
                        if self.watched != watched:  # the config names other files now: watch those
                            break
            except (OSError, RuntimeError) as err:  # a watched directory gone: poll until the next round
                log.debug("config watch: %s; polling", err)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self._poll_s)
                await self._round()

    async def _round(self) -> None:
        try:
            await self.check()
        except Exception:  # a bug in one check must not end watching (not BaseException: stop must work)
            log.exception("config reload check failed")
        self.rounds += 1  # (tests wait on it instead of sleeping)
        cancel_checkpoint()  # a cancel a library swallowed ends the loop here (gateway/background.py)

    def start(self) -> None:
        self._read()  # which files the config names: watched from the start
        self._task = asyncio.create_task(self._run(), name="config-watcher")

    async def stop(self) -> None:
        """The stop event ends the file watch at its next poll; cancelling also ends a check that
        hangs (e.g. an apply stuck on a dead engine), within a bound (gateway/background.py)."""
        self._stop.set()
        task, self._task = self._task, None
        await stop_task(task)
