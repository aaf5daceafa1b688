"""``pdgate serve`` from flags alone (gateway/config/flags.py): the flags make the YAML a user would
write, the config validator takes it, and every mistake is one line naming the flag."""

from __future__ import annotations

import httpx
import pytest
import respx
import yaml

from gateway.cli import main
from gateway.config import parse_config


def printed(capsys, *argv: str) -> dict:
    assert main(["serve", *argv, "--print-config"]) == 0
    return yaml.safe_load(capsys.readouterr().out)


def test_flags_make_the_config_a_user_would_write(capsys):
    cfg = printed(
        capsys,
        "--prefill",
        "http://10.0.0.1:8100",
        "--prefill",
        "http://10.0.0.2:8100/",
        "--decode",
        "http://10.0.0.3:8200",
        "5557",
        "--decode",
        "http://[fd00::4]:8200",
        "5557",
        "--model",
        "llama",
        "--tokenizer",
        "/models/llama",
        "--max-model-len",
        "8192",
        "--threshold",
        "2048",
        "--hash-seed",
        "0",
        "--port",
        "9000",
        "--debug-headers",
    )
    assert cfg["pools"]["prefill"]["endpoints"] == ["http://10.0.0.1:8100", "http://10.0.0.2:8100"]
    assert cfg["pools"]["decode"]["endpoints"] == [
        {"url": "http://10.0.0.3:8200", "kv_events": "tcp://10.0.0.3:5557"},
        {"url": "http://[fd00::4]:8200", "kv_events": "tcp://[fd00::4]:5557"},
    ]
    assert cfg["models"] == [{"name": "llama", "tokenizer": "/models/llama", "max_model_len": 8192}]
    assert cfg["routing"] == {
        "decider": {"name": "token_threshold", "threshold": 2048},
        "debug_headers": True,
        "prefix": {"hash_seed": "0"},
    }
    assert cfg["server"] == {"port": 9000}
    parsed = parse_config(cfg, "flags")  # the gateway's own validator takes it as it is
    assert parsed.routing.prefix.hash_seed == "0"
    assert parsed.pools.decode.endpoints[1].kv_events == "tcp://[fd00::4]:5557"


def test_the_tokenizer_defaults_to_the_model_and_the_threshold_to_4096(capsys):
    cfg = printed(capsys, "--decode", "http://d:8000", "--model", "org/model", "--max-model-len", "100")
    assert cfg["models"][0]["tokenizer"] == "org/model"
    assert cfg["routing"]["decider"]["threshold"] == 4096
    assert cfg["pools"]["prefill"]["endpoints"] == []  # no prefill pool: every request goes direct


@respx.mock
def test_the_context_length_is_asked_of_the_engines(capsys):
    respx.get("http://d1:8000/v1/models").mock(side_effect=httpx.ConnectError("refused"))
    respx.get("http://d2:8000/v1/models").mock(
        return_value=httpx.Response(
            200, json={"data": [{"id": "other", "max_model_len": 1}, {"id": "m", "max_model_len": 32768}]}
        )
    )
    cfg = printed(capsys, "--decode", "http://d1:8000", "--decode", "http://d2:8000", "--model", "m")
    assert cfg["models"][0]["max_model_len"] == 32768


@respx.mock
def test_no_engine_telling_the_context_length_is_one_line(capsys):
    respx.get("http://d1:8000/v1/models").mock(side_effect=httpx.ConnectError("refused"))
    respx.get("http://d2:8000/v1/models").mock(return_value=httpx.Response(200, json={"data": [{"id": "x"}]}))
    assert main(["serve", "--decode", "http://d1:8000", "--decode", "http://d2:8000", "--model", "m"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "http://d1:8000 unreachable" in err and "serves ['x']" in err and "pass --max-model-len" in err


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b'{"object":"list","data":null}', "http://d1:8000: not a model list"),
        (b'{"data":5}', "http://d1:8000: not a model list"),
        (b'{"data":"m"}', "http://d1:8000: not a model list"),
        (b'{"data":{"id":"m","max_model_len":8}}', "http://d1:8000: not a model list"),
        (b'[{"id":"m","max_model_len":8}]', "http://d1:8000: not a model list"),
        (b"null", "http://d1:8000: not a model list"),
        (b'{"data":[{"id":["m"],"max_model_len":8}]}', "http://d1:8000 serves []"),
        (b'{"data":[{"id":{"m":1}},{"id":null},5,"m"]}', "http://d1:8000 serves []"),
        (b'{"data":[{"id":"m","max_model_len":true}]}', "http://d1:8000 does not say its max_model_len"),
    ],
)
@respx.mock
def test_a_wrongly_typed_model_list_is_an_engine_that_did_not_tell(capsys, body, says):
    """Valid JSON of the wrong shape: the next engine is asked, and if none tells, one line."""
    respx.get("http://d1:8000/v1/models").mock(return_value=httpx.Response(200, content=body))
    respx.get("http://d2:8000/v1/models").mock(
        return_value=httpx.Response(200, json={"data": [{"id": "m", "max_model_len": 32768}]})
    )
    cfg = printed(capsys, "--decode", "http://d1:8000", "--decode", "http://d2:8000", "--model", "m")
    assert cfg["models"][0]["max_model_len"] == 32768
    assert main(["serve", "--decode", "http://d1:8000", "--model", "m"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert says in err and "pass --max-model-len" in err, err


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--decode", "ftp://d:1", "--model", "m"], "--decode: endpoint 'ftp://d:1' must be an http(s) URL"),
        (["--decode", "http://d:1/v1", "--model", "m"], "must be a base URL"),
        (["--decode", "http://d:1", "tcp://x:1", "extra", "--model", "m"], "at most a KV events address"),
        (["--decode", "http://d:1", "udp://x:1", "--model", "m"], "must be tcp://HOST:PORT"),
        (["--decode", "http://d:1"], "--model NAME is needed"),
        (["--model", "m"], "without --config, give the engines"),
        ([], "without --config, give the engines"),
        (["--config", "x.yaml", "--decode", "http://d:1"], "not both"),
        (
            ["--decode", "http://d:1", "--model", "m", "--max-model-len", "0"],
            "--max-model-len: Input should be greater than 0",
        ),
    ],
)
def test_mistakes_are_one_line(capsys, argv, says):
    assert (
        main(
            ["serve", *argv, "--max-model-len", "10"]
            if "--max-model-len" not in argv and argv[:1] != ["--config"]
            else ["serve", *argv]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert says in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
