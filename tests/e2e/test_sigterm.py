"""SIGTERM under load: the gateway exits within its grace period plus the background stop bound,
and every stream in flight either finished or ended with an error event then [DONE]; none is cut
silently, none hangs the exit. The real gateway process, with Redis shared state (whose stop used
to hang now and then) and slow simulated streams."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from tests.procs import ProcGroup

from .cluster import Cluster

pytestmark = pytest.mark.e2e
GRACE_S = 1.0


@pytest.fixture
def cluster(tokenizer_dir, tmp_path):
    group = ProcGroup(tmp_path)
    c = Cluster(group, tokenizer_dir)
    try:
        c.decode.append(c.start_sim("decode", "--decode-time-per-token", "0.05"))
        c.start_gateway(
            10_000,
            server={"shutdown_grace_s": GRACE_S},
            state={
                "backend": "redis",
                "url": "redis://127.0.0.1:6379/0",
                "key_prefix": f"sigterm{os.getpid()}",
                "sync_interval_s": 0.05,
            },
        )
        yield c
    finally:
        group.stop_all()


def test_sigterm_under_load_ends_every_stream_cleanly_and_exits_in_time(cluster):
    endings: list[str] = []
    started = threading.Barrier(9)

    def stream() -> None:
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "a long story"}],
            "max_tokens": 400,
            "stream": True,
            "ignore_eos": True,
        }
        events: list[str] = []
        try:
            with httpx.stream("POST", cluster.url + "/v1/chat/completions", json=body, timeout=60) as r:
                lines = r.iter_lines()
                for line in lines:
                    if line.startswith("data: "):
                        events.append(line[6:])
                        break
                started.wait(10)
                events += [line[6:] for line in lines if line.startswith("data: ")]
        except httpx.HTTPError as err:
            events.append(f"transport error: {type(err).__name__}")
        if events and events[-1] == "[DONE]":
            endings.append("error then done" if '"error"' in events[-2] else "done")
        else:
            endings.append(f"cut: {events[-2:]}")

    threads = [threading.Thread(target=stream) for _ in range(8)]
    for t in threads:
        t.start()
    started.wait(30)  # every stream has its first token
    t0 = time.monotonic()
    assert cluster.gateway is not None
    os.kill(cluster.gateway.pid, signal.SIGTERM)
    cluster.gateway.popen.wait(GRACE_S + 5 + 10)  # the grace, the background stop bound, a margin
    exited_after = time.monotonic() - t0
    for t in threads:
        t.join(30)
    assert cluster.gateway.popen.returncode is not None, "the gateway did not exit"
    assert exited_after < GRACE_S + 5 + 10
    assert set(endings) <= {"done", "error then done"} and len(endings) == 8, endings
    assert "error then done" in endings  # 400 tokens at 50 ms outlast a 1 s grace
