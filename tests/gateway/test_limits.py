"""limits.*: what one request may ask for (output tokens in all, n, best_of, prompts).

Each bypass of the old per-parameter cap is reproduced here: the old check let all of them through.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.config import LimitsConfig, parse_config
from gateway.http.errors import APIError
from gateway.request.protocol import Kind, ParsedRequest, check_output_limit, parse_body

MSG = [{"role": "user", "content": "hi"}]


def parse(kind: Kind = "completion", **body: Any) -> ParsedRequest:
    return parse_body(orjson.dumps({"model": "m", **body}), kind)


def chat(**body: Any) -> ParsedRequest:
    return parse("chat", messages=MSG, **body)


def limits(**kw: int) -> LimitsConfig:
    return LimitsConfig(**kw)


def refused(req: ParsedRequest, lim: LimitsConfig, max_model_len: int | None = None) -> APIError:
    with pytest.raises(APIError) as info:
        check_output_limit(req, lim, max_model_len)
    assert info.value.status == 400 and info.value.type == "invalid_request_error"
    return info.value


# -- the bypasses -------------------------------------------------------------------------------


def test_n_cannot_multiply_max_tokens_past_the_limit():
    err = refused(parse(prompt="x", max_tokens=100, n=10), limits(max_output_tokens=100))
    assert (err.param, err.code) == ("max_tokens", "max_tokens_too_large")
    assert err.message == (
        "max_tokens must be at most 10, got 100: this gateway allows at most 100 output tokens "
        "per request, and this one asks for 10 sequences (n=10), 1000 tokens in all."
    )
    check_output_limit(parse(prompt="x", max_tokens=10, n=10), limits(max_output_tokens=100))  # exactly fits


def test_best_of_and_batch_prompts_count_as_sequences():
    lim = limits(max_output_tokens=100)
    err = refused(parse(prompt="x", max_tokens=20, n=2, best_of=8), lim)
    assert "this one asks for 8 sequences (best_of=8), 160 tokens in all" in err.message
    err = refused(parse(prompt=["a", "b", "c"], max_tokens=20, n=2), lim)
    assert err.param == "max_tokens" and "max_tokens must be at most 16, got 20" in err.message
    assert "6 sequences (n=2 x 3 prompts), 120 tokens in all" in err.message


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_chat_without_max_tokens_gets_its_share(field):
    req = chat(n=4)
    check_output_limit(req, limits(max_output_tokens=100))
    assert req.body["max_completion_tokens"] == 25 and "max_tokens" not in req.body
    req = chat(**{field: None})  # an explicit null is no cap either
    check_output_limit(req, limits(max_output_tokens=100))
    assert req.body["max_completion_tokens"] == 100


def test_min_tokens_without_max_tokens_is_bounded():
    err = refused(chat(min_tokens=101), limits(max_output_tokens=100))
    assert (err.param, err.code) == ("min_tokens", "min_tokens_too_large")
    assert err.message == (
        "min_tokens must be at most 100, got 101: this gateway allows at most 100 output tokens per request."
    )
    err = refused(parse(prompt="x", min_tokens=30, n=4), limits(max_output_tokens=100))
    assert "min_tokens must be at most 25, got 30" in err.message and "4 sequences (n=4)" in err.message


# -- the rule in detail -------------------------------------------------------------------------


def test_chat_max_completion_tokens_wins_as_in_vllm():
    lim = limits(max_output_tokens=100)
    check_output_limit(chat(max_completion_tokens=50, max_tokens=5000), lim)  # vLLM uses 50
    err = refused(chat(max_completion_tokens=500, max_tokens=5), lim)
    assert err.param == "max_completion_tokens" and err.message.startswith("max_completion_tokens must be at most 100")
    err = refused(chat(max_tokens=500), lim)
    assert err.param == "max_tokens"


def test_completion_default_stays_vllms_sixteen_within_the_share():
    lim = limits(max_output_tokens=100)
    req = parse(prompt="x")
    check_output_limit(req, lim)
    assert req.body["max_tokens"] == 16  # vLLM's default for completions, now explicit
    req = parse(prompt=["a", "b"], n=5)
    check_output_limit(req, lim)
    assert req.body["max_tokens"] == 10  # 16 x 10 sequences would be 160
    req = parse(prompt="x", max_tokens=None)  # null: vLLM 0.32's default too (normalize_null_max_tokens)
    check_output_limit(req, lim)
    assert req.body["max_tokens"] == 16


def test_the_share_never_exceeds_the_context():
    """vLLM refuses max tokens above max_model_len: a share the client did not ask for must not cause that."""
    req = chat()
    check_output_limit(req, limits(max_output_tokens=1_000_000), max_model_len=4096)
    assert req.body["max_completion_tokens"] == 4096


def test_more_sequences_than_tokens_is_a_clear_400():
    err = refused(parse(prompt="x", n=16, best_of=16, max_tokens=1), limits(max_output_tokens=10))
    assert (err.param, err.code) == ("n", "too_many_sequences")
    assert err.message == (
        "This request asks for 16 sequences (n=16), more than the 10 output tokens this gateway "
        "allows per request (at least 1 per sequence); ask for fewer."
    )
    err = refused(parse(prompt=["a"] * 11), limits(max_output_tokens=10))
    assert err.param == "prompt" and "11 sequences (11 prompts)" in err.message


def test_within_limits_the_body_is_untouched():
    sent = {"prompt": ["a", "b"], "max_tokens": 10, "n": 2, "best_of": 3, "min_tokens": 5, "temperature": 0.7}
    req = parse(**sent)
    check_output_limit(req, limits(max_output_tokens=60))
    assert req.body == {"model": "m", **sent}
    for req in (parse(prompt="x"), chat()):  # no output limit: nothing is added
        before = dict(req.body)
        check_output_limit(req, limits())
        assert req.body == before


# -- caps on n, best_of and prompts -------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param", "code", "message"),
    [
        ({"n": 17}, "n", "n_too_large", "n must be at most 16 on this gateway, got 17."),
        ({"n": 100000}, "n", "n_too_large", "n must be at most 16 on this gateway, got 100000."),
        ({"best_of": 17}, "best_of", "best_of_too_large", "best_of must be at most 16 on this gateway, got 17."),
        (
            {"prompt": ["p"] * 65},
            "prompt",
            "too_many_prompts",
            "prompt must hold at most 64 prompts on this gateway, got 65.",
        ),
    ],
)
def test_default_caps(body, param, code, message):
    err = refused(parse(**{"prompt": "x", **body}), limits())
    assert (err.param, err.code, err.message) == (param, code, message)


def test_caps_at_the_edge_and_zero_means_none():
    check_output_limit(parse(prompt=["p"] * 64, n=16, best_of=16), limits())
    check_output_limit(parse(prompt=["p"] * 1000, n=1000, best_of=1000), limits(max_n=0, max_best_of=0, max_prompts=0))
    check_output_limit(chat(n=16), limits())
    assert refused(chat(n=17), limits()).param == "n"


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"n": 4, "best_of": 2}, "best_of", "best_of must be greater than or equal to n, got n=4 and best_of=2."),
        ({"n": 2, "temperature": 0}, "n", "n must be 1 when using greedy sampling, got 2."),
    ],
)
def test_what_vllm_refuses_is_refused_first(body, param, message):
    err = refused(parse(prompt="x", **body), limits(max_n=0, max_best_of=0))
    assert (err.param, err.message) == (param, message)


def test_beam_search_may_be_greedy():
    check_output_limit(parse(prompt="x", n=4, temperature=0, use_beam_search=True), limits())


def test_config_defaults_and_bounds():
    lim = parse_config(
        {
            "models": [{"name": "m", "tokenizer": "t", "max_model_len": 10}],
            "pools": {"decode": {"endpoints": ["http://d:8000"]}},
        }
    ).limits
    assert (lim.max_output_tokens, lim.max_n, lim.max_best_of, lim.max_prompts) == (0, 16, 16, 64)
    for key in ("max_n", "max_best_of", "max_prompts"):
        assert LimitsConfig.model_fields[key].description
        with pytest.raises(ValueError):
            LimitsConfig(**{key: -1})
