"""What a pool's EndpointSlices say: its ready engines, as endpoint configs with their topology."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.config import DiscoveryConfig, EndpointConfig
from policies.base import ZONE

from .selector import LABEL_VALUE


def ready_endpoints(
    slices: dict[str, dict[str, Any]], cfg: DiscoveryConfig, nodes: Mapping[str, Mapping[str, str]] | None = None
) -> tuple[EndpointConfig, ...]:
    """The ready endpoints of ``slices`` (the API's JSON, by name) as the pool's endpoint configs,
    sorted by URL, each with its topology: the slice's ``zone`` and, from ``nodes`` (labels by Node
    name), its Node's ``node_labels``. Only slices of ``address_type`` count: a dual-stack Service
    has one IPv4 and one IPv6 slice per pod set, and counting both would list each pod twice."""
    found: dict[str, EndpointConfig] = {}
    nodes = nodes or {}
    for slice_ in slices.values():
        address_type = slice_.get("addressType", "IPv4")
        if address_type != cfg.address_type:  # the other family of a dual-stack Service, or FQDN
            continue
        port = _port(slice_, cfg.port)
        if port is None:
            continue
        for ep in slice_.get("endpoints") or []:
            ready = (ep.get("conditions") or {}).get("ready")
            addresses = ep.get("addresses") or []
            if ready is False or not addresses:  # unset means ready (the API's own reading)
                continue
            host = _host(addresses[0], address_type)  # several addresses are fungible: the first
            url = f"{cfg.scheme}://{host}:{port}"
            found[url] = EndpointConfig(
                url=url,
                kv_events=f"tcp://{host}:{cfg.kv_events_port}" if cfg.kv_events_port else None,
                kv_events_replay=f"tcp://{host}:{cfg.kv_events_replay_port}" if cfg.kv_events_replay_port else None,
                kv_events_topic=cfg.kv_events_topic,
                topology=_topology(ep, nodes),
            )
    return tuple(found[u] for u in sorted(found))


def node_names(slices: Mapping[str, Mapping[str, Any]]) -> set[str]:
    """The Nodes the slices' endpoints run on."""
    return {
        name
        for s in slices.values()
        for ep in s.get("endpoints") or []
        if isinstance(name := ep.get("nodeName"), str) and name
    }


def node_topology(node: Mapping[str, Any], keys: list[str]) -> dict[str, str]:
    """The labels ``keys`` of a Node (the API's JSON), those that are valid label values only: they
    become topology values that pairing policies compare."""
    have = (node.get("metadata") or {}).get("labels") or {}
    return {k: v for k in keys if isinstance(v := have.get(k), str) and len(v) <= 63 and LABEL_VALUE.fullmatch(v)}


def _host(address: str, address_type: str) -> str:
    return f"[{address}]" if address_type == "IPv6" or ":" in address else address


def _port(slice_: dict[str, Any], want: int | str | None) -> int | None:
    if isinstance(want, int):
        return want
    ports = [p for p in slice_.get("ports") or [] if isinstance(p, dict) and p.get("port")]
    if want is None:
        return int(ports[0]["port"]) if ports else None
    return next((int(p["port"]) for p in ports if p.get("name") == want), None)


def _topology(ep: Mapping[str, Any], nodes: Mapping[str, Mapping[str, str]]) -> dict[str, str]:
    where = dict(nodes.get(ep.get("nodeName") or "", {}))
    zone = ep.get("zone")
    if isinstance(zone, str) and zone and LABEL_VALUE.fullmatch(zone) and len(zone) <= 63:
        where[ZONE] = zone
    return where
