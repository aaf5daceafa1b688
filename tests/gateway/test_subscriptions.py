"""The KV event feeds follow the config in force: one subscriber per publishing endpoint, started,
replaced or stopped as reloads and discovery change the endpoints."""

from __future__ import annotations

from typing import Any

from gateway.config import GatewayConfig, parse_config
from gateway.engines.subscriptions import Subscriptions
from policies.beliefs.prefix_index import PrefixIndex
from tests.procs import free_port


def _cfg(decode: list[Any], **prefix: Any) -> GatewayConfig:
    return parse_config(
        {
            "models": [{"name": "m", "tokenizer": "/tok", "max_model_len": 4096}],
            "pools": {"decode": {"endpoints": decode}},
            "routing": {"prefix": {"hash_seed": "0", **prefix}},
        }
    )


def _publisher(url: str) -> dict[str, str]:
    return {"url": url, "kv_events": f"tcp://127.0.0.1:{free_port()}"}  # nothing listens: it retries


async def test_one_subscriber_per_publishing_endpoint_and_reloads_replace_them() -> None:
    subs = Subscriptions(PrefixIndex())
    a, b = _publisher("http://127.0.0.1:1"), _publisher("http://127.0.0.1:2")
    try:
        await subs.update(_cfg([a, b, "http://127.0.0.1:3"]))  # the third publishes nothing
        assert sorted(s.url for s in subs.all()) == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
        kept = next(s for s in subs.all() if s.url == "http://127.0.0.1:1")
        await subs.update(_cfg([a]))  # b left the config: its feed stops
        assert subs.all() == [kept]  # a's settings did not change: the same subscriber goes on
        await subs.update(_cfg([a], block_size=32))  # how blocks hash changed: a new feed
        assert len(subs.all()) == 1 and subs.all()[0] is not kept
    finally:
        await subs.close()
    assert subs.all() == []


async def test_prefix_routing_off_follows_no_feed() -> None:
    subs = Subscriptions(PrefixIndex())
    try:
        await subs.update(_cfg([_publisher("http://127.0.0.1:1")], enabled=False))
        assert subs.all() == []
    finally:
        await subs.close()
