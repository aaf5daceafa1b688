"""``pdgate serve`` without a config file: docs/one-node.md's gateway command, as written there
(ports and model changed as tests/realvllm/guide.py says), in front of simulated engines that
publish KV events. The same command runs in front of real vLLM engines in
tests/realvllm/test_one_node_guide.py."""

from __future__ import annotations

import json
import sys

import httpx
import pytest

from tests.e2e.cluster import Cluster
from tests.procs import ProcGroup, free_port, wait_for
from tests.realvllm import guide

pytestmark = pytest.mark.e2e

LONG = "pdgate moves the KV cache between engines. " * 60  # ~600 tokens of the tiny tokenizer


def test_the_guides_gateway_command_routes_and_explains(tokenizer_dir, tmp_path):
    group = ProcGroup(tmp_path)
    c = Cluster(group, tokenizer_dir)
    seed = guide.command("gateway").flag("--hash-seed")  # the engines' PYTHONHASHSEED, as the guide says
    try:
        prefill = c.start_sim("prefill", env={"PYTHONHASHSEED": seed})
        pub, replay = free_port(), free_port()
        events = json.dumps(
            {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{replay}"}
        )
        decode = c.start_sim("decode", "--kv-events-config", events, env={"PYTHONHASHSEED": seed})
        port = free_port()
        cmd = guide.gateway_command(
            model_dir=tokenizer_dir,
            served_name="tiny",
            port=port,
            prefill_url=prefill.url,
            decode_url=decode.url,
            events_port=pub,
        )
        assert "--max-model-len" not in cmd.argv  # asked of the engines
        cmd.set_flag("--threshold", "256")  # the tiny tokenizer's prompts are short
        tmp = tmp_path / "tmp"
        tmp.mkdir()
        gw = group.start("gateway", [sys.executable, "-m", "gateway", *cmd.argv[1:]], env={"TMPDIR": str(tmp)})
        url = f"http://127.0.0.1:{port}"
        gw.wait_http(url + "/ready", timeout=60)
        assert wait_for(lambda: httpx.get(url + "/ready").json()["pools"]["prefill"]["healthy"] == 1, timeout=30)

        def send(prompt: str) -> httpx.Response:
            r = httpx.post(
                url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 4}, timeout=30
            )
            assert r.status_code == 200, r.text
            return r

        short = send("Say hello")
        assert short.headers["x-pdgate-path"] == "direct"
        assert "x-pdgate-route" in short.headers  # --debug-headers: why it went direct
        first = send(LONG)
        assert first.headers["x-pdgate-path"] == "pd", first.headers.get("x-pdgate-route")
        # The decode engine now holds the prompt's KV and says so in its KV events: the same prompt goes
        # direct, and the response says why.
        assert wait_for(lambda: send(LONG).headers["x-pdgate-path"] == "direct", timeout=10)
        again = send(LONG)
        assert "prefix_cached" in again.headers["x-pdgate-route"], again.headers["x-pdgate-route"]
        assert any(tmp.iterdir())  # the config the flags made lives in a private folder ...
        gw.stop()
        assert not any(tmp.iterdir())  # ... removed when the gateway stops
    finally:
        group.stop_all()
