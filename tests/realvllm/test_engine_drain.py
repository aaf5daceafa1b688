"""The chart's ``--shutdown-timeout`` on a real vLLM engine (issue 33): a pod being replaced gets
SIGTERM after its preStop sleep, and vLLM, by default, then aborts every request in flight. With
the flag the chart passes, the engine finishes what it is generating: a stream open at SIGTERM
ends with all its tokens and finish_reason "length", and the engine then exits on its own, within
the drain time. The engine is slowed (enginesite/slowsteps.py) so that the stream is still running
when the signal arrives, whatever the machine's load."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.procs import ProcGroup

from . import engines as E

pytestmark = [pytest.mark.realvllm, pytest.mark.e2e]

DRAIN_S = 120
TOKENS = 40


@pytest.fixture
def engine(tmp_path) -> Iterator[E.Engine]:
    venv, model_dir = E.venv_and_model()
    group = ProcGroup(tmp_path)
    slow_args, slow_env = E.slowable(tmp_path, "drain")
    try:
        eng = E.start_engine(
            group,
            "drain",
            venv,
            model_dir,
            tmp_path,
            E.engine_cores()[0],
            nixl=False,
            extra_args=["--shutdown-timeout", str(DRAIN_S), *slow_args],
            extra_env=slow_env,
        )
        E.wait_ready([eng])
        E.pin_engine(eng)
        yield eng
    finally:
        group.stop_all()


def test_sigterm_lets_the_stream_in_flight_finish(engine: E.Engine):
    chunks: list[dict] = []
    first = threading.Event()
    failure: list[BaseException] = []

    def stream() -> None:
        body = {
            "model": E.MODEL_NAME,
            "prompt": "Count slowly:",
            "max_tokens": TOKENS,
            "min_tokens": TOKENS,
            "temperature": 0,
            "stream": True,
        }
        try:
            with httpx.stream("POST", engine.url + "/v1/completions", json=body, timeout=DRAIN_S + 60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunks.append(json.loads(line[6:]))
                        first.set()
        except BaseException as err:  # reported by the test below
            failure.append(err)
        finally:
            first.set()

    with E.slowed(engine, 0.25):  # ~10 s of generation: SIGTERM lands mid-stream
        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        assert first.wait(120), "no first chunk"
        assert not failure, failure
        engine.proc.popen.send_signal(signal.SIGTERM)  # what the kubelet sends after the preStop sleep
        sent = time.monotonic()
        reader.join(DRAIN_S + 60)
    assert not reader.is_alive() and not failure, failure or "the stream did not end"
    text = "".join(c["choices"][0].get("text", "") for c in chunks if c.get("choices"))
    finish = [c["choices"][0].get("finish_reason") for c in chunks if c.get("choices")]
    assert finish[-1] == "length", f"the stream ended {finish[-1]!r} after {len(chunks)} chunks: {text!r}"
    # then the engine stops by itself, well before the drain time runs out
    assert engine.proc.popen.wait(timeout=DRAIN_S) is not None
    assert time.monotonic() - sent < DRAIN_S
