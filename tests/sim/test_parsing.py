"""OpenAI request checks as vLLM 0.32 makes them (sim.parsing): bodies to jobs, and the status, type,
parameter and message of each refusal."""

from __future__ import annotations

import pytest

from engine_model.config import SimConfig
from engine_model.tokens import ByteTokenizer
from sim import errors, parsing

CFG = SimConfig(max_model_len=64, model="m", role="both")
TOK = ByteTokenizer()


def err(fn, body, cfg=CFG, header=None) -> errors.ApiError:
    with pytest.raises(errors.ApiError) as exc:
        fn(body, cfg, TOK, header)
    return exc.value


def test_completion_parse_basics():
    job = parsing.parse_completion({"prompt": "abcdefgh", "max_tokens": 3, "model": "m"}, CFG, TOK, "rid-1")
    assert job.prompts == [TOK.encode("abcdefgh")] and job.max_tokens == [3] and job.kind == "plain"
    assert job.response_id == "cmpl-rid-1" and not job.stream
    [internal] = parsing.internal_ids(job)
    assert internal.startswith("cmpl-rid-1-0-") and len(internal) == len("cmpl-rid-1-0-") + 8
    job = parsing.parse_completion({"prompt": [5, 6, 7], "request_id": "body-id"}, CFG, TOK, None)
    assert job.prompts == [[5, 6, 7]] and job.max_tokens == [16] and job.response_id == "cmpl-body-id"
    job = parsing.parse_completion({"prompt": ["ab", "cd"], "n": 2}, CFG, TOK, None)
    assert len(job.prompts) == 2 and job.n == 2 and len(parsing.internal_ids(job)) == 2
    assert len(parsing.parse_completion({"prompt": "x"}, CFG, TOK, None).base_id) == 16  # vLLM's random_uuid()
    job = parsing.parse_completion({"prompt": "x" * 200, "max_tokens": 1000}, SimConfig(), TOK, None)
    assert job.max_tokens == [1000]
    job = parsing.parse_completion({"prompt": "x" * 200, "max_tokens": 60}, CFG, TOK, None)
    assert job.max_tokens == [64 - 50]  # clamped to the context left


def test_prompt_too_long_like_vllm():
    e = err(parsing.parse_completion, {"prompt": [1] * 70})
    assert e.status == 400 and e.err_type == "BadRequestError" and e.param == "input_tokens"
    assert e.message == (
        "This model's maximum context length is 64 tokens. However, your prompt contains 70 input "
        "tokens, which exceeds this limit even without any output tokens. Please reduce the length "
        "of the input prompt. (parameter=input_tokens, value=70)"
    )
    # vLLM says "at least" whenever the count is max+1 (where its truncating encoder stops)
    assert "contains at least 65 input tokens" in err(parsing.parse_completion, {"prompt": [1] * 65}).message
    e = err(parsing.parse_completion, {"prompt": "x" * 400})  # text prompts are encoded with max_length+1
    assert "contains at least 65 input tokens" in e.message
    e = err(parsing.parse_completion, {"prompt": [1] * 64})  # no room for one output token
    assert e.message == "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"
    e = err(parsing.parse_chat, {"messages": [{"role": "user", "content": "y" * 400}]})
    assert e.param == "input_tokens" and "However, your prompt contains at least 65 input tokens" in e.message


@pytest.mark.parametrize(
    ("body", "status", "err_type", "param", "needle"),
    [
        ({"prompt": "x", "model": "other"}, 404, "NotFoundError", "model", "The model `other` does not exist."),
        ({"prompt": "x", "max_tokens": 65}, 400, "BadRequestError", "max_tokens", "cannot be greater than"),
        ({"prompt": "x", "max_tokens": 0}, 400, "BadRequestError", "max_tokens", "must be at least 1"),
        ({"prompt": "x", "min_tokens": 20, "max_tokens": 5}, 400, "BadRequestError", None, "min_tokens must be"),
        ({"prompt": ""}, 400, "BadRequestError", "prompt", "must be provided and non-empty. (parameter=prompt)"),
        ({"prompt": []}, 400, "BadRequestError", None, "You must pass at least one prompt"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "BadRequestError", "stream_options",
         "Stream options can only be defined when `stream=True`. (parameter=stream_options)"),
        ({"prompt": "x", "max_tokens": "nine"}, 400, "Bad Request", "body.max_tokens", "valid integer"),
        ({"prompt": [1, -2]}, 400, "Bad Request", "body.prompt", "greater than or equal to 0"),
        ({"prompt": "x", "echo": True}, 400, "BadRequestError", "echo", "not supported by the simulator"),
        ({"prompt": "x", "kv_transfer_params": {"do_remote_prefill": True}}, 400, "BadRequestError",
         "kv_transfer_params", "needs remote_block_ids"),
    ],
)  # fmt: skip
def test_completion_errors_like_vllm(body, status, err_type, param, needle):
    e = err(parsing.parse_completion, body)
    assert (e.status, e.err_type, e.param) == (status, err_type, param)
    assert needle in e.message
    assert e.body() == {"error": {"message": e.message, "type": err_type, "param": param, "code": status}}


def test_roles_refuse_the_other_leg():
    prefill_leg = {"prompt": "x", "kv_transfer_params": {"do_remote_decode": True}}
    decode_leg = {
        "prompt": "x",
        "kv_transfer_params": {"do_remote_prefill": True, "remote_block_ids": [[1]], "remote_engine_id": "e",
                               "remote_request_id": "r", "remote_host": "h", "remote_port": 1},
    }  # fmt: skip
    assert parsing.parse_completion(prefill_leg, SimConfig(role="prefill"), TOK, None).kind == "prefill"
    assert parsing.parse_completion(decode_leg, SimConfig(role="decode"), TOK, None).kind == "decode"
    e = err(parsing.parse_completion, prefill_leg, SimConfig(role="decode"))
    assert e.status == 400 and "role 'decode'" in e.message and "refuses prefill legs" in e.message
    e = err(parsing.parse_completion, decode_leg, SimConfig(role="prefill"))
    assert e.status == 400 and "refuses decode legs" in e.message
    both = SimConfig(role="both")
    assert parsing.parse_completion(prefill_leg, both, TOK, None).kind == "prefill"
    assert parsing.parse_completion({**prefill_leg, "kv_transfer_params": {}}, both, TOK, None).kind == "plain"
    e = err(parsing.parse_completion, {**prefill_leg, "n": 2}, both)
    assert "not supported" in e.message


def test_chat_parse():
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_completion_tokens": 4}
    job = parsing.parse_chat(body, CFG, TOK, None)
    assert job.prompts == [TOK.apply_chat([{"role": "user", "content": "hi"}])] and job.max_tokens == [4]
    assert job.role == "assistant" and job.response_id.startswith("chatcmpl-")
    [internal] = parsing.internal_ids(job)
    assert internal.startswith(job.response_id + "-")
    job = parsing.parse_chat({**body, "add_generation_prompt": False}, CFG, TOK, None)
    assert job.role == "user"
    e = err(parsing.parse_chat, {"messages": "nope"})
    assert e.status == 400
    e = err(parsing.parse_chat, {"prompt": "x"})
    assert e.status == 400 and "Field required" in e.message


def test_chat_reuses_prompt_token_ids_from_kv_transfer_params():
    kv = {"do_remote_prefill": True, "remote_block_ids": [[1]], "remote_engine_id": "e", "remote_request_id": "r",
          "remote_host": "h", "remote_port": 1, "prompt_token_ids": [7, 8, 9]}  # fmt: skip
    body = {"messages": [{"role": "user", "content": "ignored"}], "kv_transfer_params": kv}
    job = parsing.parse_chat(body, CFG, TOK, None)
    assert job.prompts == [[7, 8, 9]] and "prompt_token_ids" not in job.kv_in
    assert "prompt_token_ids" in body["kv_transfer_params"]  # the received body is left alone
    e = err(parsing.parse_chat, {**body, "kv_transfer_params": {**kv, "prompt_token_ids": []}})
    assert e.param == "kv_transfer_params.prompt_token_ids"


def test_lax_integers_like_pydantic():
    assert parsing.parse_completion({"prompt": "x", "max_tokens": "9"}, CFG, TOK, None).max_tokens == [9]
    assert parsing.parse_completion({"prompt": "x", "max_tokens": 3.0}, CFG, TOK, None).max_tokens == [3]


def test_empty_token_prompt_is_a_late_engine_error():
    job = parsing.parse_completion({"prompt": [[]]}, CFG, TOK, None)
    with pytest.raises(errors.ApiError) as exc:
        parsing.check_engine_prompt(job.prompts[0])
    assert exc.value.late and exc.value.message == "The decoder prompt cannot be empty"
    assert exc.value.sse().startswith(b'data: {"error": {"message": "The decoder prompt cannot be empty"')
