"""docs/one-node.md end to end on real vLLM: the suite's engine pair was started with the guide's
engine commands (conftest.py); here the guide's gateway command (no config file) goes in front of
them, and the guide's story holds: a short prompt direct, a long one prefill -> decode with the
KV moved over NIXL, the same long one again direct because the decode engine's KV events say it
holds the prompt, each response saying why."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import httpx
import pytest

from tests.procs import Proc, free_port, wait_for

from . import engines as E
from . import guide
from .conftest import Pair

LONG = "pdgate moves the KV cache between engines. " * 60


@pytest.fixture(scope="module")
def guide_gateway(vllm_pair: Pair) -> Iterator[tuple[Proc, str]]:
    port = free_port()
    events_port = int(vllm_pair.kv_events.rsplit(":", 1)[1])
    cmd = guide.gateway_command(
        model_dir=vllm_pair.model_dir,
        served_name=E.MODEL_NAME,
        port=port,
        prefill_url=vllm_pair.prefill.url,
        decode_url=vllm_pair.decode.url,
        events_port=events_port,
    )
    cmd.set_flag("--threshold", "256")  # the tiny model's context is 2,048 tokens
    proc = vllm_pair.group.start("gateway-guide", [sys.executable, "-m", "gateway", *cmd.argv[1:]], cwd=str(E.REPO))
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_http(url + "/ready", timeout=90)
        assert E.wait_until(
            lambda: httpx.get(url + "/ready", timeout=5).json()["pools"]["prefill"]["healthy"] == 1, timeout=30
        ), proc.log_tail()
        yield proc, url
    finally:
        proc.stop()


def test_the_guides_story_on_real_engines(vllm_pair: Pair, guide_gateway: tuple[Proc, str]) -> None:
    proc, url = guide_gateway
    # The engines were started as the guide says: NIXL both sides, KV events and the hash seed on decode.
    assert vllm_pair.decode.env is not None and vllm_pair.decode.env["PYTHONHASHSEED"] == conftest_seed()
    httpx.post(vllm_pair.decode.url + "/reset_prefix_cache", timeout=30)

    def send(prompt: str) -> httpx.Response:
        r = httpx.post(
            url + "/v1/completions",
            json={"model": E.MODEL_NAME, "prompt": prompt, "max_tokens": 4},
            timeout=E.REQUEST_TIMEOUT_S,
        )
        assert r.status_code == 200, r.text
        return r

    short = send("Say hello")
    assert short.headers["x-pdgate-path"] == "direct" and "x-pdgate-route" in short.headers
    transfers = vllm_pair.decode.metric(E.XFER_COUNT)
    first = send(LONG)
    assert first.headers["x-pdgate-path"] == "pd", first.headers.get("x-pdgate-route")
    assert vllm_pair.decode.metric(E.XFER_COUNT) > transfers  # the KV came over NIXL
    assert wait_for(lambda: send(LONG).headers["x-pdgate-path"] == "direct", timeout=30), proc.log_tail()
    assert "prefix_cached" in send(LONG).headers["x-pdgate-route"]


def conftest_seed() -> str:
    return guide.command("engine decode").env["PYTHONHASHSEED"]
