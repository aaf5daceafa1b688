"""The engines' preflight (helm/pdgate/files/preflight.py), run for real.

Its verdicts are plain functions, tested here with the dev venv's Python (the script imports only
the standard library until it needs NIXL). Its commands run as processes with the cached vLLM CPU
venv, which has NIXL (the real-vLLM suite's venv, found the same way: a user's run skips when it
cannot be built, CI fails): serve + pull between two processes over UCX on loopback, a pull with no
server, and the checks on this machine, which has no EFA, no libfabric and no GPU.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

from tests.procs import Proc, ProcGroup, free_port
from tests.realvllm import engines as E

SCRIPT = Path(__file__).resolve().parents[2] / "helm" / "pdgate" / "files" / "preflight.py"
VERDICT = re.compile(r"^preflight (ok|FAILED): .+$")
RUN_TIMEOUT_S = 120.0  # bound on one preflight process (NIXL's import and agent take a few seconds)


def load_preflight() -> ModuleType:
    spec = importlib.util.spec_from_file_location("preflight", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pf = load_preflight()


# -- verdicts without NIXL -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tls", "ok"),
    [
        (None, True),
        ("", True),
        ("all", True),
        ("sm,cuda_ipc,cuda_copy,tcp", True),  # llm-d's setting
        ("rc,cuda", True),  # `cuda` is UCX's alias that includes cuda_copy
        ("^cuda_ipc", True),  # excludes only what it names
        ("tcp,self,sm", False),  # deploy/values-small.yaml's old setting
        ("tcp,cuda_ipc", False),  # cuda_ipc alone: UCX detects GPU memory through cuda_copy
        ("^cuda_copy", False),
    ],
)
def test_ucx_tls_verdict(tls: str | None, ok: bool) -> None:
    problem = pf.ucx_tls_problem(tls)
    assert (problem is None) == ok, problem
    if not ok:
        assert "cuda_copy" in problem


def test_buffer_pattern_is_checked_byte_for_byte() -> None:
    buf = pf.Buffer(1 << 20, "cpu")
    assert not buf.matches()  # zeroed, as a puller's buffer before its READ
    buf.fill()
    assert buf.matches()
    buf.mm[12345] ^= 0xFF
    assert not buf.matches()


def test_frames_are_bounded_in_size_and_time() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack("!I", pf.MAX_FRAME + 1))
        with pytest.raises(pf.Fail, match="limit"):
            pf.recv_frame(b, time.monotonic() + 5, "header")
        start = time.monotonic()
        with pytest.raises(pf.Fail, match="timed out waiting for header"):
            pf.recv_frame(b, time.monotonic() + 0.3, "header")  # the peer sends nothing more
        assert time.monotonic() - start < 2


# -- commands, with NIXL ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def python() -> Path:
    venv, _model = E.venv_and_model()  # skips (a user's run) or fails (CI) when it cannot be built
    return venv / "bin" / "python"


@pytest.fixture
def group(tmp_path: Path) -> Iterator[ProcGroup]:
    procs = ProcGroup(tmp_path)
    try:
        yield procs
    finally:
        procs.stop_all()


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UCX_", "FI_", "NIXL_"))}
    return {**env, **extra}


def run(python: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, str, float]:
    """Run preflight.py to its end: (exit status, its one stdout line, seconds taken)."""
    start = time.monotonic()
    done = subprocess.run(
        [str(python), str(SCRIPT), *args], capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env or clean_env()
    )
    lines = done.stdout.splitlines()
    assert len(lines) == 1 and VERDICT.match(lines[0]), f"stdout: {done.stdout!r}\nstderr: {done.stderr[-3000:]}"
    return done.returncode, lines[0], time.monotonic() - start


def verdict_in_log(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if VERDICT.match(line)]
    assert len(lines) == 1, path.read_text(errors="replace")[-3000:]
    return lines[0]


def start_serve(group: ProcGroup, python: Path, port: int, *args: str) -> Proc:
    argv = [
        str(python),
        str(SCRIPT),
        "serve",
        "--backend",
        "UCX",
        "--device",
        "cpu",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--timeout",
        "90",
        *args,
    ]
    return group.start(f"serve-{port}", argv, env=clean_env())


@pytest.mark.realvllm
@pytest.mark.e2e
def test_serve_and_pull_move_the_buffer_over_ucx(python: Path, group: ProcGroup) -> None:
    port = free_port()
    serve = start_serve(group, python, port)
    code, line, _ = run(
        python, "pull", "--backend", "UCX", "--device", "cpu", "--peer", f"127.0.0.1:{port}", "--timeout", "90"
    )
    assert code == 0, line
    assert re.fullmatch(
        rf"preflight ok: pulled 64 MiB from 127\.0\.0\.1:{port} over UCX in [\d.]+ ms "
        r"\([\d.]+ GB/s\)",
        line,
    ), line
    assert serve.popen.wait(timeout=30) == 0, serve.log_tail()
    assert verdict_in_log(serve.log_path).startswith("preflight ok: served 64 MiB over UCX to 1 peer(s): 127.0.0.1 in ")


@pytest.mark.realvllm
@pytest.mark.e2e
def test_a_failed_pull_fails_both_sides_with_the_cause(python: Path, group: ProcGroup) -> None:
    port = free_port()
    serve = start_serve(group, python, port, "--size-mib", "4")
    code, line, _ = run(
        python,
        "pull",
        "--backend",
        "UCX",
        "--device",
        "cpu",
        "--peer",
        f"127.0.0.1:{port}",
        "--size-mib",
        "8",
        "--timeout",
        "90",
    )
    assert code == 1
    assert "serves 4 MiB over UCX" in line and "wants 8 MiB" in line and "--size-mib" in line, line
    assert serve.popen.wait(timeout=30) == 1, serve.log_tail()
    assert verdict_in_log(serve.log_path).startswith("preflight FAILED: 127.0.0.1 could not pull: ")


@pytest.mark.realvllm
@pytest.mark.e2e
def test_a_pull_with_no_server_fails_within_its_timeout(python: Path) -> None:
    port = free_port()  # nothing listens there
    code, line, took = run(
        python, "pull", "--backend", "UCX", "--device", "cpu", "--peer", f"127.0.0.1:{port}", "--timeout", "3"
    )
    assert code == 1
    assert line.startswith(f"preflight FAILED: could not connect to 127.0.0.1:{port} within 3 s "), line
    assert "preflight.py serve" in line
    assert took < 3 + 30, took  # its own bound, plus NIXL's start-up on a busy 2-core machine


@pytest.mark.realvllm
@pytest.mark.e2e
def test_libfabric_check_names_what_is_missing_here(python: Path) -> None:
    code, line, _ = run(python, "check", "--backend", "LIBFABRIC")
    assert code == 1
    # no EFA user-space libraries on this machine; where libfabric is installed, no EFA device
    assert re.match(
        r"preflight FAILED: (fi_info not found: .*deploy/engine-image"
        r"|0 EFA devices visible .*vpc\.amazonaws\.com/efa)",
        line,
    ), line


@pytest.mark.realvllm
@pytest.mark.e2e
def test_the_libfabric_plugin_failure_names_the_library(python: Path) -> None:
    """Past fi_info, NIXL's own LIBFABRIC plugin: it cannot load here (no libfabric, no NVIDIA driver),
    and the verdict says which library the loader could not find."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import preflight\n"
        "try:\n    preflight.make_agent('LIBFABRIC', 'test')\nexcept preflight.Fail as err:\n    print(err)\n"
    )
    done = subprocess.run(
        [str(python), "-c", code, str(SCRIPT.parent)],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        env=clean_env(),
    )
    assert done.stdout.startswith("NIXL cannot load its LIBFABRIC plugin: "), done.stdout + done.stderr[-2000:]
    assert re.search(r"lib(fabric\.so\.1|cuda\.so\.1|hwloc\.so\.15)", done.stdout), done.stdout


@pytest.mark.realvllm
@pytest.mark.e2e
def test_ucx_check_on_dram_passes(python: Path) -> None:
    code, line, _ = run(python, "check", "--backend", "UCX", "--device", "cpu")
    assert code == 0, line
    assert line.startswith("preflight ok: NIXL UCX agent registered 1 MiB of DRAM"), line


@pytest.mark.realvllm
@pytest.mark.e2e
def test_ucx_check_for_gpus_refuses_a_ucx_tls_without_cuda_copy(python: Path) -> None:
    code, line, _ = run(python, "check", "--backend", "UCX", "--device", "cuda", env=clean_env(UCX_TLS="tcp,self,sm"))
    assert code == 1
    assert line.startswith("preflight FAILED: UCX_TLS=tcp,self,sm has no cuda_copy"), line
    # a good setting gets past that verdict, to the next thing missing: a GPU (the venv's torch is CPU-only)
    code, line, _ = run(
        python, "check", "--backend", "UCX", "--device", "cuda", env=clean_env(UCX_TLS="sm,cuda_ipc,cuda_copy,tcp")
    )
    assert code == 1
    assert "torch sees no CUDA GPU" in line and "UCX_TLS" not in line, line


# -- the LMCache L2 store (`l2`: helm test, inside every engine that loads LMCache) -----------------


class OneLineServer:
    """A TCP server on loopback that answers every connection with `reply` (b"": says nothing)."""

    def __init__(self, reply: bytes) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.reply = reply
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.sock.accept()
                with conn:
                    conn.settimeout(2)
                    with contextlib.suppress(OSError):
                        conn.recv(64)
                        conn.sendall(self.reply)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def serve_reply() -> Iterator[Callable[[bytes], int]]:
    servers: list[OneLineServer] = []

    def start(reply: bytes) -> int:
        servers.append(OneLineServer(reply))
        return servers[-1].port

    yield start
    for server in servers:
        server.close()


def l2(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = pf.main(["l2", *args])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and VERDICT.match(lines[0]), lines
    return code, lines[0]


def test_l2_url_is_the_one_lmcache_uses_in_the_pod(tmp_path: Path) -> None:
    cfg = tmp_path / "decode.yaml"
    cfg.write_text(
        "chunk_size: 256\nlocal_cpu: true\nremote_serde: naive\nremote_url: redis://pdgate-lmcache-l2:6379\n"
    )
    assert pf.l2_url_from_pod({"LMCACHE_CONFIG_FILE": str(cfg)}) == ("redis://pdgate-lmcache-l2:6379", str(cfg))
    # LMCACHE_REMOTE_URL (the chart's urlSecret) is applied over the file
    env = {"LMCACHE_CONFIG_FILE": str(cfg), "LMCACHE_REMOTE_URL": "redis://:pw@r:6379"}
    assert pf.l2_url_from_pod(env) == ("redis://:pw@r:6379", "LMCACHE_REMOTE_URL")
    with pytest.raises(pf.Fail, match="this pod has no LMCache config"):
        pf.l2_url_from_pod({})
    cfg.write_text("chunk_size: 256\nremote_url: null\n")
    with pytest.raises(pf.Fail, match="has no remote_url"):
        pf.l2_url_from_pod({"LMCACHE_CONFIG_FILE": str(cfg)})
    with pytest.raises(pf.Fail, match="cannot read LMCache's config"):
        pf.l2_url_from_pod({"LMCACHE_CONFIG_FILE": str(tmp_path / "missing.yaml")})


@pytest.mark.parametrize(
    ("url", "endpoints"),
    [
        ("redis://pdgate-lmcache-l2:6379", [("pdgate-lmcache-l2", 6379)]),
        ("redis://:secret@r.example:6380/0", [("r.example", 6380)]),
        ("rediss://r.example", [("r.example", 6379)]),
        ("lm://pdgate-lmcache-l2:65432", [("pdgate-lmcache-l2", 65432)]),
        ("redis-sentinel://s1:26379,s2:26380", [("s1", 26379), ("s2", 26380)]),
        ("redis://[fd00::1]:6379", [("fd00::1", 6379)]),
        ("mooncakestore://m:50051/", [("m", 50051)]),
    ],
)
def test_l2_endpoints(url: str, endpoints: list[tuple[str, int]]) -> None:
    assert pf.l2_endpoints(url)[1] == endpoints


@pytest.mark.parametrize("url", ["pdgate-lmcache-l2:6379", "mooncakestore://m/", "redis://r:port", "redis://:6379"])
def test_l2_malformed_urls_are_named(url: str) -> None:
    with pytest.raises(pf.Fail, match="remote_url"):
        pf.l2_endpoints(url)


def test_l2_redis_answers_pong(capsys: pytest.CaptureFixture[str], serve_reply: Callable[[bytes], int]) -> None:
    port = serve_reply(b"+PONG\r\n")
    code, line = l2(capsys, "--url", f"redis://:hunter2@127.0.0.1:{port}", "--timeout", "5")
    assert code == 0, line
    assert line.startswith(f"preflight ok: LMCache L2 store redis://***@127.0.0.1:{port} (from --url) answers ")
    assert "PING: PONG" in line and "hunter2" not in line
    # a Redis that wants a password is reachable: LMCache's URL carries the password
    port = serve_reply(b"-NOAUTH Authentication required.\r\n")
    code, line = l2(capsys, "--url", f"redis://127.0.0.1:{port}", "--timeout", "5")
    assert code == 0 and "asks for a password" in line


def test_l2_something_else_on_the_port_is_not_a_redis(
    capsys: pytest.CaptureFixture[str], serve_reply: Callable[[bytes], int]
) -> None:
    port = serve_reply(b"HTTP/1.1 400 Bad Request\r\n\r\n")
    code, line = l2(capsys, "--url", f"redis://127.0.0.1:{port}", "--timeout", "5")
    assert code == 1 and "not a Redis; check the port in remote_url" in line


def test_l2_lmcache_server_is_a_tcp_connection(
    capsys: pytest.CaptureFixture[str], serve_reply: Callable[[bytes], int]
) -> None:
    port = serve_reply(b"")
    code, line = l2(capsys, "--url", f"lm://127.0.0.1:{port}", "--timeout", "5")
    assert code == 0 and f"127.0.0.1:{port} connected in" in line and "PING" not in line


def test_l2_unreachable_store_fails_within_its_timeout_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()  # nothing listens
    start = time.monotonic()
    code, line = l2(capsys, "--url", f"redis://127.0.0.1:{port}", "--timeout", "1.5")
    assert code == 1 and time.monotonic() - start < 5
    assert line.startswith(f"preflight FAILED: LMCache L2 store redis://127.0.0.1:{port} (from --url) within 1.5 s")
    assert f"cannot reach 127.0.0.1:{port}" in line and "app.kubernetes.io/component=lmcache-l2" in line
    code, line = l2(capsys, "--url", "redis://no-such-store.invalid:6379", "--timeout", "1")
    assert code == 1 and "cannot resolve no-such-store.invalid:6379" in line


def test_l2_sentinels_need_one_answer_and_s3_is_not_checked(
    capsys: pytest.CaptureFixture[str], serve_reply: Callable[[bytes], int]
) -> None:
    port = serve_reply(b"")
    code, line = l2(capsys, "--url", f"redis-sentinel://127.0.0.1:{free_port()},127.0.0.1:{port}", "--timeout", "1")
    assert code == 0, line
    code, line = l2(capsys, "--url", "s3://bucket/prefix")
    assert code == 0 and "not a host:port store: not checked" in line
