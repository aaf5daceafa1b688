"""``pdgate check-config``: the same validation a reload runs, offline."""

from __future__ import annotations

import pytest
import yaml

from gateway.cli import main

BASE = {
    "models": [{"name": "m", "tokenizer": "t", "max_model_len": 100}],
    "pools": {"decode": {"endpoints": ["http://d0:8000"]}},
}


def run(tmp_path, data, capsys, tokenizers: bool = False) -> tuple[int, str]:
    """check-config, by default without loading tokenizers ("t" is no tokenizer)."""
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data) if isinstance(data, dict) else data)
    code = main(["check-config", str(path), *(() if tokenizers else ("--no-tokenizers",))])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_valid(tmp_path, capsys):
    code, out = run(tmp_path, BASE, capsys)
    assert code == 0 and "OK" in out and "1 decode endpoint" in out


def test_tokenizers_are_loaded_as_serve_would(tmp_path, capsys, tokenizer_dir):
    """A config check-config passes does not crash serve: each model's tokenizer loads."""
    good = {**BASE, "models": [{"name": "m", "tokenizer": str(tokenizer_dir), "max_model_len": 100}]}
    code, out = run(tmp_path, good, capsys, tokenizers=True)
    assert code == 0 and "OK" in out
    bad = {
        **BASE,
        "models": [*good["models"], {"name": "n", "tokenizer": str(tmp_path / "nowhere"), "max_model_len": 100}],
    }
    code, out = run(tmp_path, bad, capsys, tokenizers=True)
    assert code == 1 and "models[1].tokenizer: cannot load" in out and "nowhere" in out
    assert "Traceback" not in out and len(out.strip().splitlines()) == 1


def test_unknown_policy_is_caught_offline(tmp_path, capsys):
    code, out = run(tmp_path, {**BASE, "routing": {"decode": {"scorers": [{"name": "prefix_afinity"}]}}}, capsys)
    assert code == 1 and "unknown policy 'prefix_afinity'" in out and "prefix_affinity" in out


def test_bad_policy_parameter(tmp_path, capsys):
    code, out = run(tmp_path, {**BASE, "routing": {"decider": {"name": "cost_model", "kv_bandwidth_gbps": 0}}}, capsys)
    assert code == 1 and "kv_bandwidth_gbps" in out


def test_yaml_error_has_a_location(tmp_path, capsys):
    code, out = run(tmp_path, "models: [\n", capsys)
    assert code == 1 and "line" in out and "YAML syntax error" in out


def test_missing_admin_token_file(tmp_path, capsys):
    code, out = run(tmp_path, {**BASE, "admin": {"token_file": str(tmp_path / "absent")}}, capsys)
    assert code == 1 and "admin.token_file" in out


def test_policy_errors_show_their_yaml_location(tmp_path, capsys):
    code, out = run(
        tmp_path,
        (
            "models: [{name: m, tokenizer: t, max_model_len: 100}]\n"
            "pools: {decode: {endpoints: ['http://d0:8000']}}\n"
            "routing:\n"
            "  decider: {name: token_threshold, threshold: 0}\n"
            "  decode:\n"
            "    scorers:\n"
            "      - {name: prefix_affinity, weight: 2}\n"
            "      - {name: session_affinity, haeder: x-chat}\n"
            "    filters: [{name: bounded_load, slack: yes}]\n"
        ),
        capsys,
    )
    assert code == 1
    assert out.splitlines() == [
        f"{tmp_path / 'c.yaml'}: invalid configuration",
        "  routing.decider.threshold: Input should be greater than 0",
        "  routing.decode.filters[0].slack: Input should be a valid number",
        "  routing.decode.scorers[1].haeder: unknown parameter (did you mean 'header'?)",
    ]


def test_a_policy_twice_or_in_the_wrong_place(tmp_path, capsys):
    routing = {
        "decode": {"scorers": [{"name": "load"}, {"name": "load", "weight": 2}], "picker": {"name": "bounded_load"}}
    }
    code, out = run(tmp_path, {**BASE, "routing": routing}, capsys)
    assert code == 1
    assert "  routing.decode.scorers[1].name: policy 'load' is already in this list" in out
    assert "  routing.decode.picker.name: policy 'bounded_load' is a filter, not a picker" in out


def test_the_shipped_examples_pass(tmp_path, capsys, monkeypatch):
    """examples/ are what users copy: they must stay valid configs."""
    from pathlib import Path

    monkeypatch.setenv("PDGATE_API_KEYS", "sk-example")
    monkeypatch.setenv("PDGATE_ADMIN_TOKEN", "example-admin")
    monkeypatch.setenv("PDGATE_REDIS_URL", "redis://127.0.0.1:6379/0")
    examples = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))
    assert {e.name for e in examples} >= {"minimal.yaml", "every-policy.yaml", "kubernetes.yaml"}
    for example in examples:
        code = main(["check-config", str(example), "--no-tokenizers"])  # hub names: no hub here
        out = capsys.readouterr()
        assert code == 0, f"{example.name}: {out.out}{out.err}"


def test_serve_with_a_tokenizer_it_cannot_load_says_so_in_one_line(tmp_path, capsys):
    bad = {**BASE, "models": [{"name": "m", "tokenizer": str(tmp_path / "nowhere"), "max_model_len": 100}]}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(bad))
    code = main(["serve", "--config", str(path)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith(f"{path}: models[0].tokenizer: cannot load")
    assert len(err.splitlines()) == 1


def test_serve_with_workers_and_a_secret_not_mounted_says_so_in_one_line(tmp_path, capsys, monkeypatch):
    """What would fail in every worker (here a missing API key variable) fails once, before any starts."""
    monkeypatch.delenv("PDGATE_TEST_KEYS_UNSET", raising=False)
    cfg = {**BASE, "server": {"workers": 2}, "auth": {"api_keys_env": "PDGATE_TEST_KEYS_UNSET"}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    code = main(["serve", "--config", str(path)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith(f"{path}: ") and "PDGATE_TEST_KEYS_UNSET" in err
    assert len(err.splitlines()) == 1


def test_a_duplicate_auth_key_and_an_empty_keys_path_are_reported(tmp_path, capsys):
    """Both once passed check-config and served without keys (issue 27)."""
    (tmp_path / "keys").write_text("sk-a\n")
    text = yaml.safe_dump(BASE) + f"auth: {{api_keys_file: {tmp_path / 'keys'}}}\nauth: {{}}\n"
    code, out = run(tmp_path, text, capsys)
    assert code == 1 and "'auth' appears twice" in out and "line" in out and "Traceback" not in out
    code, out = run(tmp_path, {**BASE, "auth": {"api_keys_file": ""}}, capsys)
    assert code == 1 and "auth.api_keys_file: is empty" in out
    code, out = run(tmp_path, {**BASE, "auth": {}}, capsys)
    assert code == 1 and "auth: names no API keys" in out


def test_a_change_that_switches_keys_off_must_say_so(tmp_path, capsys):
    (tmp_path / "keys").write_text("sk-a\n")
    running = tmp_path / "running.yaml"
    running.write_text(yaml.safe_dump({**BASE, "auth": {"api_keys_file": str(tmp_path / "keys")}}))
    new = tmp_path / "new.yaml"
    new.write_text(yaml.safe_dump(BASE))
    code = main(["check-config", str(new), "--previous", str(running), "--no-tokenizers"])
    out = capsys.readouterr()
    assert code == 1 and "switches off API keys" in out.err and "auth.disabled: true" in out.err
    new.write_text(yaml.safe_dump({**BASE, "auth": {"disabled": True}}))
    code = main(["check-config", str(new), "--previous", str(running), "--no-tokenizers"])
    out = capsys.readouterr()
    assert code == 0 and "warning: switches off API keys" in out.err and "no API keys" in out.out


def test_demo_help_describes_it_and_gives_every_default(capsys):
    with pytest.raises(SystemExit) as done:
        main(["demo", "--help"])
    assert done.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "simulated prefill and decode engines" in out and "admin token" in out
    for default in ("(default 8000)", "(default 127.0.0.1)", "engines (default 2)", "(default 4096)"):
        assert default in out
    assert out.count("engines (default 2)") == 2
