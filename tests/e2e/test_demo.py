"""`pdgate demo` as a new user runs it: answers short prompts directly and long ones through P/D,
streaming included, and leaves no process (and, unless --keep-logs, no folder) behind when stopped;
a busy port is one line; the access log goes to a file unless --access-log; the banner names the
tokenizer folder load tools need; responses say why they took their path, and the admin token the
banner prints opens /admin/config and /debug/route."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from tests.procs import ProcGroup, free_port, wait_for

pytestmark = pytest.mark.e2e


def children(pid: int) -> set[int]:
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.add(int(stat.parent.name))
    return out


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and " Z " not in Path(f"/proc/{pid}/stat").read_text()


def demo_env(tmp_path: Path) -> dict[str, str]:
    """The demo's tokenizer cache and its temporary folder (TMPDIR) inside the test's folder."""
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return {"PDGATE_CACHE_DIR": str(tmp_path / "cache"), "TMPDIR": str(tmp_path / "tmp")}


def demo_folders(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "tmp").glob("pdgate-demo-*"))


def test_demo_routes_both_paths_and_stops_cleanly(tmp_path):
    port = free_port()
    group = ProcGroup(tmp_path)
    try:
        demo = group.start(
            "demo", [sys.executable, "-m", "gateway", "demo", "--port", str(port)], env=demo_env(tmp_path)
        )
        demo.wait_http(f"http://127.0.0.1:{port}/ready", timeout=120)
        banner = demo.log_path.read_text()
        assert "curl" in banner
        # Load tools need a local tokenizer ("demo" is no hub name): the banner says where it is.
        assert f"tokenizer: {tmp_path / 'cache' / 'demo-tokenizer'}" in banner
        assert (tmp_path / "cache" / "demo-tokenizer" / "tokenizer.json").exists()
        [folder] = demo_folders(tmp_path)
        assert str(folder) in banner
        processes = children(demo.pid)
        engines = {p for p in processes if b"sim" in cmdline(p)}
        assert len(engines) == 4
        workers = {p for p in processes if b"multiprocessing.spawn" in cmdline(p)}
        expected = min(2, len(os.sched_getaffinity(0)))  # the gateway as deployed: worker processes
        assert len(workers) == (expected if expected > 1 else 0)
        if expected > 1:
            assert f"gateway: {expected} worker processes" in banner

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        short = client.chat.completions.with_raw_response.create(
            model="demo", messages=[{"role": "user", "content": "Hello!"}]
        )
        assert short.headers["x-pdgate-path"] == "direct" and short.parse().choices[0].message.content
        long_text = "Summarize this. " + "The quick brown fox jumps over the lazy dog. " * 600
        with client.chat.completions.with_streaming_response.create(
            model="demo", messages=[{"role": "user", "content": long_text}], stream=True
        ) as resp:
            assert resp.headers["x-pdgate-path"] == "pd"
            text = "".join(c.choices[0].delta.content or "" for c in resp.parse() if c.choices)
        assert text
        # The engines' KV events reach the gateway: the same document comes back direct, to the
        # decode engine that now holds it.
        feeds = httpx.get(f"http://127.0.0.1:{port}/ready").json()["kv_event_feeds"]
        assert feeds == {"connected": 4, "total": 4}
        again = client.chat.completions.with_raw_response.create(
            model="demo", messages=[{"role": "user", "content": long_text}], max_tokens=4
        )
        assert again.headers["x-pdgate-path"] == "direct"
        # ... and says why: the demo turns the decision header on.
        assert again.headers["x-pdgate-route"].startswith("prefix_cached; uncached=")
        # The admin token the banner prints opens the admin and debug endpoints (off without one).
        [token] = re.findall(r"Admin token for this run: (\S+)", banner)
        admin = {"authorization": f"Bearer {token}"}
        shown = httpx.get(f"http://127.0.0.1:{port}/admin/config", headers=admin)
        assert shown.status_code == 200 and shown.json()["config"]["routing"]["debug_headers"] is True
        assert httpx.get(f"http://127.0.0.1:{port}/admin/config").status_code == 401
        plan = httpx.post(
            f"http://127.0.0.1:{port}/debug/route",
            headers=admin,
            timeout=30,
            json={"model": "demo", "messages": [{"role": "user", "content": "Hello!"}]},
        )
        assert plan.status_code == 200 and plan.json()["reason"] == "short_prompt"
        # The access log goes to a file in the demo's folder, not to the terminal.
        rid = again.headers["x-request-id"]
        access = folder / "access.log"
        assert wait_for(lambda: access.exists() and rid in access.read_text(), timeout=10)
        assert short.headers["x-request-id"] in access.read_text()
        assert rid not in demo.log_path.read_text()

        demo.popen.send_signal(signal.SIGTERM)
        assert demo.popen.wait(30) == 0
        assert "stopped all engines" in demo.log_path.read_text()
        # every engine and worker, and multiprocessing's resource tracker (it ends as it sees its
        # parent go), within a bound
        assert wait_for(lambda: not [pid for pid in processes if alive(pid)], timeout=5), [
            cmdline(pid) for pid in processes if alive(pid)
        ]
        assert not folder.exists()  # engine logs, config and access log removed
    finally:
        group.stop_all()


def test_demo_keep_logs_and_access_log_on_the_terminal(tmp_path):
    port = free_port()
    group = ProcGroup(tmp_path)
    try:
        demo = group.start(
            "demo",
            [
                sys.executable,
                "-m",
                "gateway",
                "demo",
                "--port",
                str(port),
                "--prefill",
                "1",
                "--decode",
                "1",
                "--keep-logs",
                "--access-log",
            ],
            env=demo_env(tmp_path),
        )
        demo.wait_http(f"http://127.0.0.1:{port}/ready", timeout=120)
        [folder] = demo_folders(tmp_path)
        assert str(folder) in demo.log_path.read_text()
        resp = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            timeout=30,
            json={"model": "demo", "messages": [{"role": "user", "content": "Hello!"}]},
        )
        assert resp.status_code == 200
        rid = resp.headers["x-request-id"]
        assert wait_for(lambda: rid in demo.log_path.read_text(), timeout=10)
        assert not (folder / "access.log").exists()

        demo.popen.send_signal(signal.SIGTERM)
        assert demo.popen.wait(30) == 0
        assert f"logs kept in {folder}" in demo.log_path.read_text()
        assert {"prefill-0.log", "decode-0.log", "gateway.yaml"} <= {p.name for p in folder.iterdir()}
    finally:
        group.stop_all()


def test_demo_on_a_busy_port_says_so_and_starts_nothing(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "gateway", "demo", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, **demo_env(tmp_path)},
        )
    assert done.returncode == 1
    assert done.stdout == ""  # no banner, no curl commands
    [line] = done.stderr.splitlines()
    assert f"port {port} is already in use" in line and "--port" in line
    assert demo_folders(tmp_path) == []  # no engine started: none had a log folder
    assert not (tmp_path / "cache").exists()  # nor was the tokenizer built
