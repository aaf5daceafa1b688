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
    assert cfg.pools.decode.endpoints == ["http://d0:8000"]
    assert cfg.pools.prefill.endpoints == []
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
