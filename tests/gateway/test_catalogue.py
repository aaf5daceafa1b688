"""Which model names are LoRA adapters: configured ones, and those the engines list with a
configured model as parent; the path their blocks are hashed with is the engines' when they say."""

from __future__ import annotations

from gateway.adapters.catalogue import Catalogue
from gateway.config import GatewayConfig
from gateway.engines.pools import Pools


def _cfg(discover: bool = True) -> GatewayConfig:
    return GatewayConfig.model_validate(
        {
            "models": [
                {
                    "name": "tiny",
                    "tokenizer": "/t",
                    "max_model_len": 64,
                    "adapters": [{"name": "adpA", "path": "/adapters/adpA", "max_rank": 8}],
                }
            ],
            "pools": {"decode": {"endpoints": ["http://d0", "http://d1", "http://d2"]}},
            "lora": {"discover": discover},
        }
    )


def test_configured_adapters_resolve_to_their_base_and_path():
    pools = Pools([], ["http://d0"])
    cat = Catalogue(_cfg(), pools)
    a = cat.resolve("adpA")
    assert (a.base, a.path, a.configured, a.max_rank, a.lora) == (
        "tiny",
        "/adapters/adpA",
        True,
        8,
        ("adpA", "/adapters/adpA"),
    )
    assert cat.resolve("tiny") is None and cat.resolve("nope") is None


def test_adapters_the_engines_list_are_served_with_the_path_most_of_them_loaded():
    pools = Pools([], ["http://d0", "http://d1", "http://d2"])
    d0, d1, d2 = pools.decode
    pools.set_served(d0, frozenset({"tiny", "found"}), {"found": ("/mnt/found", "tiny")})
    pools.set_served(d1, frozenset({"tiny", "found"}), {"found": ("/mnt/found", "tiny")})
    pools.set_served(
        d2,
        frozenset({"tiny", "found", "adpA", "alien"}),
        {
            "found": ("/other/found", "tiny"),
            "adpA": ("/mnt/adpA", "tiny"),  # loaded from elsewhere than configured: its blocks hash with this path
            "alien": ("/x", "some-other-base"),  # not of a model this gateway serves
        },
    )
    cat = Catalogue(_cfg(), pools)
    found = cat.resolve("found")
    assert (found.base, found.path, found.configured) == ("tiny", "/mnt/found", False)
    assert cat.resolve("adpA").path == "/mnt/adpA" and cat.resolve("adpA").configured
    assert cat.resolve("alien") is None
    assert [a.name for a in cat.all()] == ["adpA", "found"]
    assert Catalogue(_cfg(discover=False), pools).resolve("found") is None


def test_an_adapter_named_like_a_model_or_twice_is_a_config_error():
    import pytest
    from pydantic import ValidationError

    base = {"pools": {"decode": {"endpoints": ["http://d0"]}}}
    m = {"name": "tiny", "tokenizer": "/t", "max_model_len": 64}
    with pytest.raises(ValidationError, match="has the name of a model"):
        GatewayConfig.model_validate({**base, "models": [{**m, "adapters": [{"name": "tiny", "path": "/a"}]}]})
    twice = [{"name": "a", "path": "/a"}, {"name": "a", "path": "/b"}]
    with pytest.raises(ValidationError, match="two adapters share a name"):
        GatewayConfig.model_validate({**base, "models": [{**m, "adapters": twice}]})
    with pytest.raises(ValidationError, match=r"adapters\.0\.name"):
        GatewayConfig.model_validate({**base, "models": [{**m, "adapters": [{"name": "a b\n", "path": "/a"}]}]})
