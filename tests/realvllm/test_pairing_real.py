"""Topology-aware pairing on real vLLM engines (issue 17): with the prefill pool's ``same_zone``
filter, a decode engine never pulls KV from a prefill engine of another zone. The engines' own
counters prove the path: in different zones, a long prompt is prefilled by the decode engine itself
(no NIXL transfer, the prefill engine never sees it, the gateway says ``no_prefill_in_zone``); once
a reload puts both engines in one zone, the same kind of prompt moves over NIXL."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import yaml

from . import engines as E
from .conftest import THRESHOLD, Gateway, Pair, start_gateway
from .test_real_vllm import chat_messages, counters, expect_direct, expect_pd
from .test_routing_beliefs import TOKEN, chat, gateway_metric
from .test_routing_beliefs import plan as route

pytestmark = [pytest.mark.realvllm, pytest.mark.e2e]

ZONE = "topology.kubernetes.io/zone"


def pools(pair: Pair, prefill_zone: str) -> dict:
    return {
        "prefill": {"endpoints": [{"url": pair.prefill.url, "topology": {ZONE: prefill_zone}}]},
        "decode": {"endpoints": [{"url": pair.decode.url, "topology": {ZONE: "us-east-1a"}}]},
    }


@pytest.fixture(scope="module")
def gw(vllm_pair: Pair) -> Iterator[Gateway]:
    token_file = vllm_pair.group.log_dir / "pairing-admin-token"
    token_file.write_text(TOKEN)
    # prefix routing off: every long prompt is uncached, so the path is the pairing's alone
    routing = {
        "decider": {"name": "token_threshold", "threshold": THRESHOLD},
        "prefix": {"enabled": False},
        "prefill": {"filters": [{"name": "same_zone"}]},
    }
    gw = start_gateway(
        vllm_pair,
        "gateway-pairing",
        routing=routing,
        pools=pools(vllm_pair, "us-east-1b"),
        admin={"token_file": str(token_file)},
    )
    try:
        yield gw
    finally:
        gw.proc.stop()


def test_no_kv_pull_across_zones_and_one_inside_a_zone(vllm_pair: Pair, gw: Gateway) -> None:
    long = chat_messages(vllm_pair, 800)  # above the threshold: P/D if a pairing may be made
    assert route(gw, long)["reason"] == "no_prefill_in_zone"
    before = counters(vllm_pair, gw)
    r = chat(gw, long)
    assert r.status_code == 200 and r.headers["x-pdgate-path"] == "direct", r.text
    expect_direct(vllm_pair, gw, before, 800)  # the decode engine computed it; no NIXL transfer
    assert gateway_metric(gw, "pdgate_route_decisions_total", path="direct", reason="no_prefill_in_zone") == 1

    cfg = yaml.safe_load(gw.config_path.read_text())
    cfg["pools"] = pools(vllm_pair, "us-east-1a")  # the prefill engine moves to the decode engine's zone
    tmp = gw.config_path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(cfg, sort_keys=False))
    tmp.replace(gw.config_path)
    long = chat_messages(vllm_pair, 800)
    assert E.wait_until(lambda: route(gw, long)["path"] == "pd", timeout=30), gw.proc.log_tail()
    before = counters(vllm_pair, gw)
    r = chat(gw, long)
    assert r.status_code == 200 and r.headers["x-pdgate-path"] == "pd", r.text
    expect_pd(vllm_pair, gw, before, 800)  # pulled over NIXL from the prefill engine
