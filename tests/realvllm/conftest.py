"""Fixtures for the real-engine suite: a real vLLM prefill engine and decode engine (CPU, NIXL),
and the real gateway in front of them. One engine pair per module (they cost ~50 s to start and
busy-spin a core each, so they must not outlive the module).

Nothing here skips on its own: if the venv cannot be built or an engine does not come up, the
tests fail with the reason. ``PDGATE_SKIP_REALVLLM=1`` skips the suite on purpose (local runs).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from tests.procs import Proc, ProcGroup, free_port

from . import engines as E

THRESHOLD = 512  # the gateway's token_threshold decider: P/D from this many prompt tokens


@dataclass
class Pair:
    prefill: E.Engine
    decode: E.Engine
    model_dir: Path
    group: ProcGroup


@dataclass
class Gateway:
    proc: Proc
    port: int
    config_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def vllm_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    if os.environ.get("PDGATE_SKIP_REALVLLM") == "1":
        pytest.skip("PDGATE_SKIP_REALVLLM=1")
    failure = None
    try:
        venv = E.ensure_venv()
        model_dir = E.ensure_model(venv)
    except E.SetupError as err:
        failure = str(err)
    if failure:  # outside the except block, so the report is just the reason
        pytest.fail(f"real vLLM setup failed: {failure}", pytrace=False)
    work = tmp_path_factory.mktemp("realvllm")
    group = ProcGroup(work)
    pair = None
    try:
        p_core, d_core = E.engine_cores()
        prefill = E.start_engine(group, "prefill", venv, model_dir, work, p_core)
        decode = E.start_engine(group, "decode", venv, model_dir, work, d_core)
        pair = Pair(prefill, decode, model_dir, group)
        try:
            E.wait_ready([prefill, decode])
        except E.SetupError as err:
            failure = str(err)
        if failure:
            pytest.fail(f"real vLLM engines did not start: {failure}", pytrace=False)
        for eng in (prefill, decode):
            E.pin_engine(eng)
        yield pair
    finally:
        group.stop_all()
        if pair is not None:
            pair.prefill.http.close()
            pair.decode.http.close()


@pytest.fixture(scope="module")
def gateway(vllm_pair: Pair) -> Iterator[Gateway]:
    port = free_port()
    cfg = {
        "server": {"host": "127.0.0.1", "port": port},
        "models": [{"name": E.MODEL_NAME, "tokenizer": str(vllm_pair.model_dir), "max_model_len": E.MAX_MODEL_LEN}],
        "pools": {
            "prefill": {"endpoints": [vllm_pair.prefill.url]},
            "decode": {"endpoints": [vllm_pair.decode.url]},
        },
        "routing": {"decider": {"name": "token_threshold", "threshold": THRESHOLD}},
    }
    path = vllm_pair.group.log_dir / "gateway.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    proc = vllm_pair.group.start(
        "gateway", [sys.executable, "-m", "gateway", "serve", "--config", str(path)], cwd=str(E.REPO)
    )
    gw = Gateway(proc, port, path)
    try:
        proc.wait_http(gw.url + "/ready", timeout=90)
        # /ready needs only a decode engine; these tests need the prefill pool up too.
        ok = E.wait_until(
            lambda: httpx.get(gw.url + "/ready", timeout=5).json()["pools"]["prefill"]["healthy"] == 1,
            timeout=30,
        )
        assert ok, f"the gateway never saw the prefill engine healthy:\n{proc.log_tail()}"
        yield gw
    finally:
        proc.stop()
