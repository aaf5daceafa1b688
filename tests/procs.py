"""Start and stop real processes for end-to-end tests.

Every process runs in its own session (process group) so that stopping it by PID also stops
whatever it spawned (vLLM forks engine cores). ``stop`` is safe to call twice and always waits.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from gateway import ports
from tests.waiting import wait_for  # noqa: F401 - the suite's one polling helper, re-exported

free_port = ports.free_port  # below the ephemeral range (gateway/ports.py)


class Proc:
    """One child process (and its process group) with its output in a log file."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_dir: Path,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
    ) -> None:
        self.name = name
        self.log_path = Path(log_dir) / f"{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            list(argv),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            cwd=cwd,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log_tail(self, n: int = 60) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def wait_http(self, url: str, timeout: float = 30.0, ok=lambda r: r.status_code == 200) -> None:
        """Poll ``url`` until it answers ``ok``; fail with the log tail if the process dies."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode}:\n{self.log_tail()}")
            try:
                if ok(httpx.get(url, timeout=2.0)):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{self.name} not ready at {url} after {timeout}s:\n{self.log_tail()}")

    def stop(self, grace: float = 10.0) -> int | None:
        """SIGTERM the group, wait, then SIGKILL whatever is left."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(grace)
        with contextlib.suppress(ProcessLookupError, PermissionError):  # children may outlive the leader
            os.killpg(self.popen.pid, signal.SIGKILL)
        if self.popen.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):  # unkillable (D state): nothing more to do
                self.popen.wait(5)
        self._log.close()
        return self.popen.returncode


class ProcGroup:
    """Processes started by one fixture; ``stop_all`` stops them in reverse order."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = Path(log_dir)
        self.procs: list[Proc] = []

    def start(self, name: str, argv: Sequence[str], **kw) -> Proc:
        proc = Proc(name, argv, self.log_dir, **kw)
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        """Every process is stopped even when stopping one fails; the first failure is raised after."""
        errors: list[BaseException] = []
        for proc in reversed(self.procs):
            try:
                proc.stop()
            except BaseException as err:  # also KeyboardInterrupt: the rest still stop
                errors.append(err)
        self.procs.clear()
        if errors:
            raise errors[0]


PYTHON = sys.executable


def memory_mb(pid: int) -> dict[str, int]:
    """A process's resident memory now (VmRSS) and at its peak (VmHWM), in MB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) // 1024
    return out


def reset_peak(pid: int) -> None:
    """Start a process's VmHWM over from its current RSS (Linux: 5 > clear_refs); without it the
    startup peak stays the baseline, which only makes a bound on growth looser."""
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/clear_refs").write_text("5")
