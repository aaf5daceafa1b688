"""Priorities on a real vLLM engine (issue 19): the gateway sends each key's class priority, and an
engine run with ``--scheduling-policy priority`` honours it. The engine here runs one sequence at
a time (``--max-num-seqs 1``), so requests queue inside it: a batch request sent before an
interactive one, while a long answer holds the engine, finishes after it. Without the gateway's
field (or with FCFS scheduling) it would finish first. vLLM rejects a non-zero priority on an
engine without priority scheduling: a 200 here also says the field arrived as vLLM expects it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.promtext import sample

from . import engines as E
from .conftest import Gateway, Pair, start_gateway

pytestmark = [pytest.mark.realvllm, pytest.mark.e2e]

KEYS = "sk-batch tenant=reports priority=batch\nsk-vip tenant=search priority=interactive\nsk-std tenant=chat\n"


@pytest.fixture(scope="module")
def prio_engine(vllm_pair: Pair) -> Iterator[E.Engine]:
    """An engine with priority scheduling and one sequence at a time (no KV connector), on the
    prefill engine's core."""
    venv, _ = E.venv_and_model()
    eng = E.start_engine(vllm_pair.group, "prio", venv, vllm_pair.model_dir, vllm_pair.group.log_dir,
                         vllm_pair.prefill.core, nixl=False,
                         extra_args=["--scheduling-policy", "priority", "--max-num-seqs", "1"])
    try:
        E.wait_ready([eng])
        E.pin_engine(eng)
        yield eng
    finally:
        eng.proc.stop()
        eng.http.close()


@pytest.fixture(scope="module")
def gateway(vllm_pair: Pair, prio_engine: E.Engine) -> Iterator[Gateway]:
    keys = vllm_pair.group.log_dir / "prio-keys"
    keys.write_text(KEYS)
    gw = start_gateway(
        vllm_pair, "gateway-prio",
        pools={"prefill": {"endpoints": [vllm_pair.prefill.url]}, "decode": {"endpoints": [prio_engine.url]}},
        routing={"decider": {"name": "token_threshold", "threshold": 100_000}, "prefix": {"enabled": False}},
        auth={"api_keys_file": str(keys)},
        fairness={"enabled": True, "engine_priority": True},
    )
    try:
        yield gw
    finally:
        gw.proc.stop()


def chat(gw: Gateway, key: str, max_tokens: int, out: dict[str, float] | None = None, name: str = "") -> httpx.Response:
    r = httpx.post(gw.url + "/v1/chat/completions", timeout=120, headers={"authorization": f"Bearer {key}"},
                   json={"model": E.MODEL_NAME, "messages": [{"role": "user", "content": f"Say something, {name}."}],
                         "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0})
    if out is not None:
        out[name] = time.monotonic()
    return r


def test_the_engine_accepts_each_class_priority(gateway: Gateway) -> None:
    for key in ("sk-vip", "sk-batch", "sk-std"):  # -10, 10, and the default 0 (not sent)
        r = chat(gateway, key, 4)
        assert r.status_code == 200, r.text
    # a client's own priority never reaches the engine
    r = httpx.post(gateway.url + "/v1/chat/completions", headers={"authorization": "Bearer sk-std"}, timeout=30,
                   json={"model": E.MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "priority": -50})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"


def test_the_engine_serves_the_interactive_class_first(gateway: Gateway, prio_engine: E.Engine) -> None:
    done: dict[str, float] = {}
    statuses: list[int] = []

    def send(key: str, max_tokens: int, name: str) -> threading.Thread:
        t = threading.Thread(target=lambda: statuses.append(chat(gateway, key, max_tokens, done, name).status_code),
                             daemon=True)
        t.start()
        return t

    hold = send("sk-std", 1500, "hold")  # the engine's one sequence, for a second or more

    assert E.wait_until(lambda: _gauge(prio_engine, "vllm:num_requests_running") >= 1, timeout=30)
    batch = send("sk-batch", 50, "batch")
    assert E.wait_until(lambda: _gauge(prio_engine, "vllm:num_requests_waiting") >= 1, timeout=30)
    vip = send("sk-vip", 50, "vip")
    for t in (hold, batch, vip):
        t.join(timeout=120)
    assert statuses == [200, 200, 200], statuses
    assert done["vip"] < done["batch"], done  # sent later, served first: the engine honoured the class


def _gauge(eng: E.Engine, name: str) -> float:
    return sample(eng.metrics(), name) or 0.0
