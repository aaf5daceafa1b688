"""Priorities on a real vLLM engine (issue 19): the gateway sends each key's class priority, and an
engine run with ``--scheduling-policy priority`` honours it. The engine here runs one sequence at
a time (``--max-num-seqs 1``), so requests queue inside it: a batch request sent before an
interactive one, while a long answer holds the engine, finishes after it. Without the gateway's
field (or with FCFS scheduling) it would finish first. vLLM rejects a non-zero priority on an
engine without priority scheduling: a 200 here also says the field arrived as vLLM expects it.

The scenario is paced by what the engine reports (its running and waiting gauges), not by the test
process's clock: on these shared two-core machines a sleeping process may wake seconds late while
an engine computes, so the engine is slowed (enginesite/slowsteps.py) until the queue is built."""

from __future__ import annotations

import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import yaml

from tests.otlp import Collector, attrs
from tests.procs import ProcGroup, free_port
from tests.promtext import sample

from . import engines as E
from .conftest import Gateway

pytestmark = [pytest.mark.realvllm, pytest.mark.e2e]

KEYS = "sk-batch tenant=reports priority=batch\nsk-vip tenant=search priority=interactive\nsk-std tenant=chat\n"


@dataclass
class Setup:
    engine: E.Engine
    gateway: Gateway
    collector: Collector


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    """An engine with priority scheduling and one sequence at a time (no KV connector), and a
    gateway sending it each key's class. Its own engine, before the package's NIXL pair starts
    (modules run in file order): their busy-spinning progress threads would starve it."""
    venv, model_dir = E.venv_and_model()
    work = tmp_path_factory.mktemp("priority")
    group = ProcGroup(work)
    collector = Collector()
    slow_args, slow_env = E.slowable(work, "prio")
    try:
        eng = E.start_engine(
            group,
            "prio",
            venv,
            model_dir,
            work,
            E.engine_cores()[0],
            nixl=False,
            extra_args=[
                "--scheduling-policy",
                "priority",
                "--max-num-seqs",
                "1",
                # its spans say when it received and finished each request
                "--otlp-traces-endpoint",
                collector.url,
                *slow_args,
            ],
            extra_env={
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
                "OTEL_BSP_SCHEDULE_DELAY": "200",
                "NO_PROXY": "127.0.0.1,localhost",
                **slow_env,
            },
        )
        E.wait_ready([eng])
        E.pin_engine(eng)
        (work / "keys").write_text(KEYS)
        port = free_port()
        cfg = {
            "server": {"host": "127.0.0.1", "port": port, "workers": 1},
            "models": [{"name": E.MODEL_NAME, "tokenizer": str(model_dir), "max_model_len": E.MAX_MODEL_LEN}],
            "pools": {"prefill": {"endpoints": []}, "decode": {"endpoints": [eng.url]}},
            "routing": {"decider": {"name": "token_threshold", "threshold": 100_000}},
            "admission": {"max_loop_lag_ms": 0},
            "auth": {"api_keys_file": str(work / "keys")},
            "fairness": {"enabled": True, "engine_priority": True},
        }
        path = work / "gateway.yaml"
        path.write_text(yaml.safe_dump(cfg))
        proc = group.start(
            "gateway", [sys.executable, "-m", "gateway", "serve", "--config", str(path)], cwd=str(E.REPO)
        )
        gw = Gateway(proc, port, path)
        proc.wait_http(gw.url + "/ready", timeout=90)
        yield Setup(eng, gw, collector)
    finally:
        group.stop_all()
        collector.stop()


def chat(gw: Gateway, key: str, max_tokens: int, rid: str = "") -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} | ({"x-request-id": rid} if rid else {})
    return httpx.post(
        gw.url + "/v1/chat/completions",
        timeout=300,
        headers=headers,
        json={
            "model": E.MODEL_NAME,
            "messages": [{"role": "user", "content": f"Say something, {rid}."}],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0,
        },
    )


def span_of(collector: Collector, rid: str) -> Any:
    """The engine's span of the request: it arrived at its start and finished at its end, on the
    engine's own clock (the test process and the gateway share two cores with busy engines: what
    they see may lag by seconds)."""
    for s in list(collector.spans):
        if s.name == "llm_request" and rid in str(attrs(s).get("gen_ai.request.id", "")):
            return s
    return None


def test_the_engine_accepts_each_class_priority(setup: Setup) -> None:
    gateway = setup.gateway
    for key in ("sk-vip", "sk-batch", "sk-std"):  # -10, 10, and the default 0 (not sent)
        r = chat(gateway, key, 4, f"accept-{key}-{uuid.uuid4().hex[:6]}")
        assert r.status_code == 200, r.text
    # a client's own priority never reaches the engine
    r = httpx.post(
        gateway.url + "/v1/chat/completions",
        headers={"authorization": "Bearer sk-std"},
        timeout=30,
        json={"model": E.MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "priority": -50},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"


def test_the_engine_serves_the_interactive_class_first(setup: Setup) -> None:
    """A long answer holds the engine's one sequence; another long one, a batch and an interactive
    request join its queue, in that order (each sent once the engine counts the one before).
    Served: the interactive one first, the batch one last (FCFS would serve hold-2, batch, vip)."""
    gateway, eng = setup.gateway, setup.engine
    run = uuid.uuid4().hex[:8]
    statuses: dict[str, int] = {}

    def send(key: str, max_tokens: int, name: str) -> threading.Thread:
        rid = f"{name}-{run}"
        t = threading.Thread(
            target=lambda: statuses.update({name: chat(gateway, key, max_tokens, rid).status_code}), daemon=True
        )
        t.start()
        return t

    def engine_counts(running: int, waiting: int) -> bool:
        text = eng.metrics()
        return (sample(text, "vllm:num_requests_running"), sample(text, "vllm:num_requests_waiting")) == (
            running,
            waiting,
        )

    sent = []
    with E.slowed(eng, 0.05):  # the first answer lasts over a minute while the queue is built
        sent.append(send("sk-std", 1500, "hold"))
        assert E.wait_until(lambda: engine_counts(1, 0), timeout=60), eng.metrics()
        for waiting, (key, max_tokens, name) in enumerate(
            [("sk-std", 1000, "hold-2"), ("sk-batch", 50, "batch"), ("sk-vip", 50, "vip")], start=1
        ):
            sent.append(send(key, max_tokens, name))
            assert E.wait_until(lambda w=waiting: engine_counts(1, w), timeout=60), (name, eng.metrics())
    for t in sent:
        t.join(timeout=300)
    assert statuses == dict.fromkeys(("hold", "hold-2", "batch", "vip"), 200), statuses
    names = ("hold", "hold-2", "batch", "vip")
    assert E.wait_until(lambda: all(span_of(setup.collector, f"{n}-{run}") for n in names), timeout=30)
    spans = {n: span_of(setup.collector, f"{n}-{run}") for n in names}
    order = sorted(spans, key=lambda n: spans[n].end_time_unix_nano)
    # sent last, served first (FCFS: hold-2, batch, vip): the engine honoured the classes
    assert order == ["hold", "vip", "hold-2", "batch"], order
