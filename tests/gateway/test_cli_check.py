"""``pdgate check-config``: the same validation a reload runs, offline."""

from __future__ import annotations

import yaml

from gateway.cli import main

BASE = {
    "models": [{"name": "m", "tokenizer": "t", "max_model_len": 100}],
    "pools": {"decode": {"endpoints": ["http://d0:8000"]}},
}


def run(tmp_path, data, capsys) -> tuple[int, str]:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data) if isinstance(data, dict) else data)
    code = main(["check-config", str(path)])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_valid(tmp_path, capsys):
    code, out = run(tmp_path, BASE, capsys)
    assert code == 0 and "OK" in out and "1 decode endpoint" in out


def test_unknown_policy_is_caught_offline(tmp_path, capsys):
    code, out = run(tmp_path, {**BASE, "routing": {"decode": {"scorers": [{"name": "prefix_afinity"}]}}}, capsys)
    assert code == 1 and "unknown policy 'prefix_afinity'" in out and "prefix_affinity" in out


def test_bad_policy_parameter(tmp_path, capsys):
    code, out = run(tmp_path, {**BASE, "routing": {"decider": {"name": "cost_model", "kv_bandwidth_gbps": 0}}},
                    capsys)
    assert code == 1 and "kv_bandwidth_gbps" in out


def test_yaml_error_has_a_location(tmp_path, capsys):
    code, out = run(tmp_path, "models: [\n", capsys)
    assert code == 1 and "line" in out and "YAML syntax error" in out


def test_missing_admin_token_file(tmp_path, capsys):
    code, out = run(tmp_path, {**BASE, "admin": {"token_file": str(tmp_path / "absent")}}, capsys)
    assert code == 1 and "admin.token_file" in out


def test_policy_errors_show_their_yaml_location(tmp_path, capsys):
    code, out = run(tmp_path, (
        "models: [{name: m, tokenizer: t, max_model_len: 100}]\n"
        "pools: {decode: {endpoints: ['http://d0:8000']}}\n"
        "routing:\n"
        "  decider: {name: token_threshold, threshold: 0}\n"
        "  decode:\n"
        "    scorers:\n"
        "      - {name: prefix_affinity, weight: 2}\n"
        "      - {name: session_affinity, haeder: x-chat}\n"
        "    filters: [{name: bounded_load, slack: yes}]\n"
    ), capsys)
    assert code == 1
    assert out.splitlines() == [
        f"{tmp_path / 'c.yaml'}: invalid configuration",
        "  routing.decider.threshold: Input should be greater than 0",
        "  routing.decode.filters[0].slack: Input should be a valid number",
        "  routing.decode.scorers[1].haeder: unknown parameter (did you mean 'header'?)",
    ]


def test_a_policy_twice_or_in_the_wrong_place(tmp_path, capsys):
    routing = {"decode": {"scorers": [{"name": "load"}, {"name": "load", "weight": 2}],
                          "picker": {"name": "bounded_load"}}}
    code, out = run(tmp_path, {**BASE, "routing": routing}, capsys)
    assert code == 1
    assert "  routing.decode.scorers[1].name: policy 'load' is already in this list" in out
    assert "  routing.decode.picker.name: policy 'bounded_load' is a filter, not a picker" in out
