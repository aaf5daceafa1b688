"""vLLM's response shapes: the completion and chat bodies, their usage blocks, SSE framing and the
render routes' answer (``GenerateRequest``), as plain dicts in vLLM's key order.

Non-streaming bodies are pydantic ``model_dump()`` in vLLM (every field, nulls included), so
every field is here; stream chunks (:mod:`sim.streaming`) are ``model_dump_json(exclude_unset=True)``.
The request side is :mod:`sim.parsing`.
"""

from __future__ import annotations

from typing import Any

import orjson

from sim.parsing import Job, random_id

VLLM_VERSION = "0.32.0"


def usage_full(
    prompt_tokens: int, completion_tokens: int, prompt_details: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": prompt_details,
        "completion_tokens_details": None,
    }


def prompt_tokens_details(job: Job, *, stream: bool) -> dict[str, Any] | None:
    """vLLM's ``usage.prompt_tokens_details`` under ``--enable-prompt-tokens-details`` (the
    caller checks the flag). Chat reports cached and newly cached tokens of the request;
    completions only the cached tokens of the last prompt. Streamed usage drops null fields."""
    if not job.seqs:
        return None
    if job.endpoint == "chat":
        seq = job.seqs[0]
        details: dict[str, Any] = {
            "cached_tokens": seq.cached_tokens,
            "created_cache_tokens": seq.created_cache_tokens,
            "multimodal_tokens": None,
        }
    else:
        seq = job.seqs[(len(job.prompts) - 1) * job.n]
        details = {"cached_tokens": seq.cached_tokens, "created_cache_tokens": None, "multimodal_tokens": None}
    if stream:
        return {k: v for k, v in details.items() if v is not None}
    return details


def usage_short(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }


def completion_response(job: Job, model: str, fingerprint: str | None, prompt_details: bool = False) -> dict[str, Any]:
    choices: list[dict[str, Any]] = []
    n_prompt = 0
    n_gen = 0
    for p_idx, ids in enumerate(job.prompts):
        for c in range(job.n):
            seq = job.seqs[p_idx * job.n + c]
            choices.append(
                {
                    "index": len(choices),
                    "text": seq.text(),
                    "logprobs": None,
                    "finish_reason": seq.finish_reason,
                    "stop_reason": seq.stop_reason,
                    "token_ids": list(seq.output_ids) if job.return_token_ids else None,
                    "prompt_logprobs": None,
                    "prompt_token_ids": ids if job.return_token_ids else None,
                    "routed_experts": None,
                }
            )
            n_gen += len(seq.output_ids)
        n_prompt += len(ids)
    return {
        "id": job.response_id,
        "object": "text_completion",
        "created": job.created,
        "model": model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": fingerprint,
        "usage": usage_full(n_prompt, n_gen, prompt_tokens_details(job, stream=False) if prompt_details else None),
        "kv_transfer_params": job.seqs[0].kv_out if job.seqs else None,
        "ec_transfer_params": None,
        "metrics": None,
    }


def chat_response(job: Job, model: str, fingerprint: str | None, prompt_details: bool = False) -> dict[str, Any]:
    choices = []
    for c, seq in enumerate(job.seqs):
        choices.append(
            {
                "index": c,
                "message": {
                    "role": job.role,
                    "content": seq.text(),
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "reasoning": None,
                },
                "logprobs": None,
                "finish_reason": seq.finish_reason or "stop",
                "stop_reason": seq.stop_reason,
                "token_ids": list(seq.output_ids) if job.return_token_ids else None,
                "routed_experts": None,
            }
        )
    n_gen = sum(len(s.output_ids) for s in job.seqs)
    return {
        "id": job.response_id,
        "object": "chat.completion",
        "created": job.created,
        "model": model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": fingerprint,
        "usage": usage_full(
            len(job.prompts[0]), n_gen, prompt_tokens_details(job, stream=False) if prompt_details else None
        ),
        "prompt_logprobs": None,
        "prompt_token_ids": job.prompts[0] if job.return_token_ids else None,
        "prompt_text": None,
        "kv_transfer_params": job.seqs[0].kv_out if job.seqs else None,
        "ec_transfer_params": None,
        "metrics": None,
    }


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def _sampling_params(body: dict[str, Any], job: Job, max_tokens: int) -> dict[str, Any]:
    """The ``sampling_params`` of a render answer: vLLM's SamplingParams fields the simulator
    knows, with the request's values or vLLM's defaults (sampling itself is not modelled)."""

    def num(name: str, default: float | None) -> Any:
        v = body.get(name)
        return v if isinstance(v, int | float) and not isinstance(v, bool) else default

    return {
        "n": job.n,
        "presence_penalty": num("presence_penalty", 0.0),
        "frequency_penalty": num("frequency_penalty", 0.0),
        "repetition_penalty": num("repetition_penalty", 1.0),
        "temperature": num("temperature", 1.0),
        "top_p": num("top_p", 1.0),
        "top_k": num("top_k", 0),
        "min_p": num("min_p", 0.0),
        "seed": num("seed", None),
        "stop": list(job.stop),
        "stop_token_ids": list(job.stop_token_ids),
        "ignore_eos": job.ignore_eos,
        "max_tokens": max_tokens,
        "min_tokens": job.min_tokens,
        "logprobs": None,
        "prompt_logprobs": None,
        "skip_special_tokens": body.get("skip_special_tokens", True) is not False,
        "spaces_between_special_tokens": body.get("spaces_between_special_tokens", True) is not False,
        "include_stop_str_in_output": bool(body.get("include_stop_str_in_output")),
    }


def render_requests(body: dict[str, Any], job: Job) -> list[dict[str, Any]]:
    """vLLM's render answer (``/v1/*/render``): one ``GenerateRequest`` per prompt, as
    ``ServingRender`` builds them: a fresh ``cmpl-``/``chatcmpl-`` request id, the prompt's token
    ids, the sampling params, and the stream flags; no kv_transfer_params (render never sees any)."""
    prefix = "cmpl" if job.endpoint == "completions" else "chatcmpl"
    stream_options = body.get("stream_options") if job.stream else None
    return [
        {
            "request_id": f"{prefix}-{random_id()}",
            "token_ids": list(ids),
            "features": None,
            "sampling_params": _sampling_params(body, job, max_tokens),
            "model": body.get("model"),
            "stream": job.stream,
            "stream_options": stream_options,
            "cache_salt": body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None,
            "priority": body.get("priority") if type(body.get("priority")) is int else 0,
            "kv_transfer_params": None,
        }
        for ids, max_tokens in zip(job.prompts, job.max_tokens, strict=True)
    ]
