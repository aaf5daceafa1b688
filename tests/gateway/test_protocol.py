from __future__ import annotations

import orjson
import pytest

from gateway.http.errors import APIError
from gateway.request.protocol import check_lengths, parse_body


def parse(kind="completion", **body):
    return parse_body(orjson.dumps({"model": "m", **body}), kind)


def test_reserved_fields_are_stripped_and_unknown_ones_kept():
    req = parse(prompt="x", kv_transfer_params={"remote_host": "evil"}, vllm_thing=[1])
    assert "kv_transfer_params" not in req.body and req.body["vllm_thing"] == [1]


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"prompt": ["a", "b"]}, "batch_prompts"),
        ({"prompt": [[1], [2]]}, "batch_prompts"),
        ({"prompt": "a", "n": 2}, "multiple_sequences"),
        ({"prompt": "a", "best_of": 3}, "multiple_sequences"),
        ({"prompt": "a", "echo": True}, "prompt_logprobs"),
        ({"prompt": "a", "prompt_logprobs": 0}, "prompt_logprobs"),
        ({"prompt": "a"}, None),
        ({"prompt": [1, 2, 3]}, None),
    ],
)
def test_local_only_reasons(body, reason):
    assert parse(**body).local_only() == reason


def test_stream_options_need_stream():
    with pytest.raises(APIError, match="only be defined when `stream=True`"):
        parse(prompt="x", stream_options={"include_usage": True})
    assert parse(prompt="x", stream=True, stream_options={"include_usage": True}).stream


@pytest.mark.parametrize(
    ("body", "n_tokens", "needle"),
    [
        ({"max_tokens": 0}, 5, "max_tokens must be at least 1, got 0."),
        ({"max_tokens": 101}, 5, "max_tokens=101 cannot be greater than max_model_len=100."),
        ({"max_completion_tokens": 101}, 5, "max_completion_tokens=101 cannot be greater"),
        ({}, 100, "max_tokens must be at least 1, got 0."),
        ({}, 101, "contains at least 101 input tokens"),
        ({"min_tokens": 10, "max_tokens": 5}, 5, "min_tokens must be less than or equal to max_tokens=5, got 10."),
        ({"min_tokens": 10}, 95, "max_tokens=5, got 10."),
    ],
)
def test_length_rules_mirror_vllm(body, n_tokens, needle):
    with pytest.raises(APIError) as info:
        check_lengths(parse(prompt="text", **body), [[1] * n_tokens], 100)
    assert needle in info.value.message and info.value.status == 400


def test_token_id_prompts_report_exact_count():
    with pytest.raises(APIError, match="contains 150 input tokens"):
        check_lengths(parse(prompt=[1] * 150), [[1] * 150], 100)
    check_lengths(parse(prompt="x", max_tokens=50, min_tokens=50), [[1] * 50], 100)  # fits exactly


def test_transfer_params_cannot_be_smuggled():
    req = parse(
        prompt="x",
        ec_transfer_params={"peer_host": "203.0.113.9"},
        vllm_xargs={"kv_transfer_params": "x", "ec_transfer_params": "y", "kv_cache_report_mode": "z", "my_arg": 1},
    )
    assert "ec_transfer_params" not in req.body
    assert req.body["vllm_xargs"] == {"my_arg": 1}


@pytest.mark.parametrize(
    "field", [{"best_of": "3"}, {"use_beam_search": 1}, {"prompt_logprobs": "2"}, {"vllm_xargs": "kv"}]
)
def test_fields_that_steer_routing_are_type_checked(field):
    with pytest.raises(APIError) as info:
        parse(prompt="x", **field)
    [name] = field
    assert (info.value.status, info.value.param) == (400, name)
