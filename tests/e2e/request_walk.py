"""Run ``pdgate serve`` in this process and record, for one request, the modules of the project
it passes through, in order (``test_request_walk.py`` reads it).

``python -m tests.e2e.request_walk OUT PORT -- SERVE_FLAGS...``: a profiler hook on every thread
notes each call into a module other than the last one noted, while the request is in flight (the
gateway's background tasks show up too: the test looks for the drawn order as a subsequence); a
client thread waits for the gateway, sends one streamed completion, writes the walk to OUT, then
stops the gateway (SIGTERM).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import Any

import httpx

PACKAGES = ("gateway.", "policies.", "engine_model.")
MAX_STEPS = 200_000  # a bound on the walk's length
walk: list[str] = []  # modules entered, consecutive repeats left out
recording = threading.Event()


def _profile(frame: FrameType, event: str, arg: Any) -> None:
    if event == "call" and recording.is_set():
        name = frame.f_globals.get("__name__", "")
        if name.startswith(PACKAGES) and (not walk or walk[-1] != name) and len(walk) < MAX_STEPS:
            walk.append(name)


def _client(out: str, port: int, prompt: str) -> None:
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            body = httpx.get(url + "/ready", timeout=2).json()
            if body["pools"]["prefill"]["healthy"] and body["pools"]["decode"]["healthy"]:
                break
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(0.2)
    request = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "stream": True}
    recording.set()
    try:
        with httpx.stream("POST", url + "/v1/completions", json=request, timeout=30) as r:
            chunks = [line for line in r.iter_lines() if line]
            path = r.headers.get("x-pdgate-path")
        time.sleep(0.5)  # the request's way out (records, hooks) runs after the last chunk
    finally:
        recording.clear()
    with open(out, "w") as f:
        json.dump({"status": r.status_code, "path": path, "chunks": len(chunks), "modules": walk}, f)
    os.kill(os.getpid(), signal.SIGTERM)


def main() -> int:
    out, port, flags = sys.argv[1], int(sys.argv[2]), sys.argv[4:]
    prompt = "pdgate moves the KV cache between engines. " * 60
    threading.setprofile(_profile)
    sys.setprofile(_profile)
    threading.Thread(target=_client, args=(out, port, prompt), daemon=True).start()
    from gateway.cli import main as pdgate

    try:
        return pdgate(["serve", "--port", str(port), *flags])
    except SystemExit as stop:
        return int(stop.code or 0)


if __name__ == "__main__":
    sys.exit(main())
