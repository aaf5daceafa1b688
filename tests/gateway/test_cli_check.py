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
