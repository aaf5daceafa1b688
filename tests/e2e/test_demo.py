"""`pdgate demo` as a new user runs it: answers short prompts directly and long ones through P/D,
streaming included, and leaves no process behind when stopped."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import httpx
import openai
import pytest

from tests.procs import ProcGroup, free_port

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


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and " Z " not in Path(f"/proc/{pid}/stat").read_text()


def test_demo_routes_both_paths_and_stops_cleanly(tmp_path):
    port = free_port()
    group = ProcGroup(tmp_path)
    try:
        demo = group.start("demo", [sys.executable, "-m", "gateway", "demo", "--port", str(port)],
                           env={"PDGATE_CACHE_DIR": str(tmp_path / "cache")})
        demo.wait_http(f"http://127.0.0.1:{port}/ready", timeout=120)
        assert "curl" in demo.log_path.read_text()
        engines = children(demo.pid)
        assert len(engines) == 4

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        short = client.chat.completions.with_raw_response.create(
            model="demo", messages=[{"role": "user", "content": "Hello!"}])
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
            model="demo", messages=[{"role": "user", "content": long_text}], max_tokens=4)
        assert again.headers["x-pdgate-path"] == "direct"

        demo.popen.send_signal(signal.SIGTERM)
        assert demo.popen.wait(30) == 0
        assert "stopped all engines" in demo.log_path.read_text()
        assert not [pid for pid in engines if alive(pid)]
    finally:
        group.stop_all()
