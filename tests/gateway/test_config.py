from __future__ import annotations

import pytest

from gateway.config import ConfigError, load_config, parse_config

BASE = {
    "models": [{"name": "m", "tokenizer": "/tok", "max_model_len": 4096}],
    "pools": {"decode": {"endpoints": ["http://d0:8000/"]}},
}


def test_defaults():
    cfg = parse_config(BASE)
    assert cfg.routing.decider.name == "token_threshold"
    assert cfg.pools.decode.urls == ["http://d0:8000"]
    assert cfg.pools.prefill.urls == []
    assert cfg.model("m").max_model_len == 4096 and cfg.model("x") is None


@pytest.mark.parametrize(
    ("patch", "where"),
    [
        ({"pools": {"decode": {"endpoints": []}}}, "pools.decode"),
        ({"pools": {"decode": {"endpoints": ["d0:8000"]}}}, "pools.decode.endpoints"),
        ({"pools": {"decode": {"endpoints": ["http://d0/v1"]}}}, "pools.decode.endpoints"),
        ({"serverr": {}}, "serverr"),
        ({"models": [{"name": "m", "tokenizer": "/t", "max_model_len": "big"}]}, "models.0.max_model_len"),
        ({"models": []}, "models"),
    ],
)
def test_errors_name_their_location(patch, where):
    with pytest.raises(ConfigError) as info:
        parse_config({**BASE, **patch}, "gw.yaml")
    assert str(info.value).startswith("gw.yaml: invalid configuration")
    assert f"  {where}" in str(info.value)


def test_yaml_syntax_error_has_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("models:\n  - name: [oops\n")
    with pytest.raises(ConfigError, match="line"):
        load_config(path)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "none.yaml")


def test_endpoint_objects_with_kv_events_and_pipeline_per_pool():
    cfg = parse_config({
        **BASE,
        "pools": {"decode": {"endpoints": [
            "http://d0:8000",
            {"url": "http://d1:8000/", "kv_events": "tcp://d1:5557", "kv_events_replay": "tcp://d1:5558"},
        ]}},
        "routing": {
            "decider": {"name": "cost_model", "kv_bandwidth_gbps": 100},
            "decode": {"scorers": [{"name": "session_affinity", "weight": 3, "header": "x-chat"}]},
            "prefix": {"block_size": 128, "hash_seed": "0"},
        },
    })
    assert cfg.pools.decode.urls == ["http://d0:8000", "http://d1:8000"]
    assert cfg.pools.decode.endpoints[1].kv_events == "tcp://d1:5557"
    scorer = cfg.routing.decode.scorers[0]
    assert (scorer.name, scorer.weight, scorer.params) == ("session_affinity", 3, {"header": "x-chat"})
    assert [s.name for s in cfg.routing.prefill.scorers] == ["prefix_affinity", "load"]  # defaults
    assert cfg.routing.decider.params == {"kv_bandwidth_gbps": 100}


@pytest.mark.parametrize(
    ("routing", "where"),
    [({"prefix": {"hash_algo": "md5"}}, "routing.prefix.hash_algo"),
     ({"decode": {"scorers": [{"name": "load", "weight": -1}]}}, "routing.decode.scorers.0.weight"),
     ({"prefix": {"block_size": 0}}, "routing.prefix.block_size")],
)
def test_bad_routing_values_name_their_place(routing, where):
    with pytest.raises(ConfigError, match=where.replace(".", r"\.")):
        parse_config({**BASE, "routing": routing})


def test_kv_events_address_must_be_zmq():
    with pytest.raises(ConfigError, match="ZMQ address"):
        parse_config({**BASE, "pools": {"decode": {"endpoints": [{"url": "http://d0", "kv_events": "http://x"}]}}})
