"""Reading an OpenAI request body: parse, type-check the fields the gateway relies on, strip what
clients must never set.

Fields it does not know are left untouched for vLLM (which has many extensions); fields it does
know are checked here so that a bad request gets a clear 400 and never reaches an engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import orjson

from gateway.http.errors import APIError, bad_request

if TYPE_CHECKING:
    from gateway.config import LimitsConfig

Kind = Literal["chat", "completion"]

# They name hosts and ports an engine will connect to (KV and encoder-cache transfer), or steer
# its KV connector: only the gateway may set them, at the top level or through vllm_xargs (which
# vLLM merges into the engine's request arguments).
RESERVED_FIELDS = ("kv_transfer_params", "ec_transfer_params")
RESERVED_XARGS = ("kv_transfer_params", "ec_transfer_params", "kv_cache_report_mode")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _opt(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or check(v)


def _str_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(s, str) for s in v)


# field -> (check, what it must be)
_COMMON: dict[str, tuple[Callable[[Any], bool], str]] = {
    "stream": (_opt(lambda v: isinstance(v, bool)), "a boolean"),
    "stream_options": (_opt(lambda v: isinstance(v, dict)), "an object"),
    # Any integer here: below 1 gets vLLM's own "must be at least 1, got N" (check_lengths), so 0
    # and -1 get the same message.
    "max_tokens": (_opt(_is_int), "an integer"),
    "max_completion_tokens": (_opt(_is_int), "an integer"),
    "min_tokens": (_opt(lambda v: _is_int(v) and v >= 0), "a non-negative integer"),
    "n": (_opt(lambda v: _is_int(v) and v >= 1), "an integer >= 1"),
    "temperature": (_opt(lambda v: _is_num(v) and v >= 0), "a number >= 0"),
    "top_p": (_opt(lambda v: _is_num(v) and 0 < v <= 1), "a number in (0, 1]"),
    "top_k": (_opt(_is_int), "an integer"),
    "presence_penalty": (_opt(_is_num), "a number"),
    "frequency_penalty": (_opt(_is_num), "a number"),
    "seed": (_opt(_is_int), "an integer"),
    "stop": (_opt(lambda v: isinstance(v, str) or _str_list(v)), "a string or a list of strings"),
    "user": (_opt(lambda v: isinstance(v, str)), "a string"),
    "add_special_tokens": (_opt(lambda v: isinstance(v, bool)), "a boolean"),
    "truncate_prompt_tokens": (_opt(lambda v: _is_int(v) and v >= -1), "an integer >= -1"),
    "truncation_side": (_opt(lambda v: v in ("left", "right")), "'left' or 'right'"),
    "best_of": (_opt(lambda v: _is_int(v) and v >= 1), "an integer >= 1"),
    "use_beam_search": (_opt(lambda v: isinstance(v, bool)), "a boolean"),
    "prompt_logprobs": (_opt(lambda v: _is_int(v) and v >= -1), "an integer >= -1"),
    "vllm_xargs": (_opt(lambda v: isinstance(v, dict)), "an object"),
}
_CHAT: dict[str, tuple[Callable[[Any], bool], str]] = {
    "logprobs": (_opt(lambda v: isinstance(v, bool)), "a boolean"),
    "top_logprobs": (_opt(lambda v: _is_int(v) and v >= 0), "a non-negative integer"),
    "add_generation_prompt": (_opt(lambda v: isinstance(v, bool)), "a boolean"),
    "continue_final_message": (_opt(lambda v: isinstance(v, bool)), "a boolean"),
    "chat_template": (_opt(lambda v: isinstance(v, str)), "a string"),
    "chat_template_kwargs": (_opt(lambda v: isinstance(v, dict)), "an object"),
    "tools": (_opt(lambda v: isinstance(v, list) and all(isinstance(t, dict) for t in v)), "a list of objects"),
    "documents": (_opt(lambda v: isinstance(v, list)), "a list"),
    "reasoning_effort": (_opt(lambda v: isinstance(v, str)), "a string"),
}
_COMPLETION: dict[str, tuple[Callable[[Any], bool], str]] = {
    "logprobs": (_opt(lambda v: _is_int(v) and v >= 0), "a non-negative integer"),
    "echo": (_opt(lambda v: isinstance(v, bool)), "a boolean"),
    "suffix": (_opt(lambda v: isinstance(v, str)), "a string"),
}


_CHAT_CHECKS = {**_COMMON, **_CHAT}
_COMPLETION_CHECKS = {**_COMMON, **_COMPLETION}


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A checked request body; ``body`` is what goes upstream (reserved fields removed)."""

    kind: Kind
    body: dict[str, Any]
    model: str
    stream: bool
    raw_size: int = 0  # bytes of the JSON body: a cheap bound on the work tokenizing it takes
    # Completion prompts, one entry per prompt (classified once; empty for chat).
    prompts: list[str] | list[list[int]] = field(default_factory=list)

    def local_only(self) -> str | None:
        """Why this request cannot take the P/D path (None when it can).

        One prefill hands over one sequence's KV, so several prompts or choices stay local; and
        prompt logprobs / echo make the decode engine recompute the prompt anyway.
        """
        body = self.body
        if self.kind == "completion" and len(self.prompts) > 1:
            return "batch_prompts"
        if (body.get("n") or 1) > 1 or (body.get("best_of") or 1) > 1 or body.get("use_beam_search"):
            return "multiple_sequences"
        if body.get("prompt_logprobs") is not None or body.get("echo"):
            return "prompt_logprobs"
        return None


def parse_body(raw: bytes, kind: Kind) -> ParsedRequest:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as err:
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as bad:  # orjson says "surrogates not allowed": say what is wrong
            raise bad_request(f"The request body is not valid UTF-8 (byte {bad.start}).", code="invalid_json") from None
        raise bad_request(f"The request body is not valid JSON: {err}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    for name in RESERVED_FIELDS:
        body.pop(name, None)
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict):
        for name in RESERVED_XARGS:
            xargs.pop(name, None)

    # The gateway owns the engines' priority field (from the API key's class): a client's own
    # would let it jump every queue on engines that run priority scheduling.
    if body.pop("priority", None) not in (None, 0):
        raise bad_request(
            "`priority` is set by the gateway from the API key's priority class; ask for "
            "another class with the x-pdgate-priority header.",
            param="priority",
            code="priority_not_allowed",
        )
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("`model` is required and must be a non-empty string.", param="model")
    for name, (check, what) in (_CHAT_CHECKS if kind == "chat" else _COMPLETION_CHECKS).items():
        if name in body and not check(body[name]):
            raise bad_request(f"`{name}` must be {what}.", param=name)
    opts = body.get("stream_options")
    if opts is not None and "include_usage" in opts and not isinstance(opts["include_usage"], bool):
        raise bad_request("`stream_options.include_usage` must be a boolean.", param="stream_options")
    # The prefill leg drops stream_options, so vLLM would only object on the decode leg: check here.
    if opts and not body.get("stream"):
        raise bad_request("Stream options can only be defined when `stream=True`.", param="stream_options")
    if kind == "chat":
        _check_messages(body.get("messages"))
        if body.get("add_generation_prompt") and body.get("continue_final_message"):
            raise bad_request(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                param="continue_final_message",
            )
        prompts: list[str] | list[list[int]] = []
    else:
        prompts = _prompt_list(body.get("prompt"))
    return ParsedRequest(
        kind=kind, body=body, model=model, stream=bool(body.get("stream")), raw_size=len(raw), prompts=prompts
    )


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise bad_request("`messages` is required and must be a non-empty list.", param="messages")
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise bad_request(f"`{where}` must be an object.", param=where)
        if not isinstance(msg.get("role"), str):
            raise bad_request(f"`{where}.role` is required and must be a string.", param=f"{where}.role")
        content = msg.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise bad_request(f"`{where}.content` must be a string or a list of parts.", param=where)
        for j, part in enumerate(content):
            if isinstance(part, str):
                continue
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise bad_request(f"`{where}.content[{j}]` must be an object with a `type`.", param=f"{where}.content")
            # vLLM skips a text part whose text is missing or null, and refuses other types.
            if part["type"] == "text" and part.get("text") is not None and not isinstance(part["text"], str):
                raise bad_request(f"`{where}.content[{j}].text` must be a string.", param=f"{where}.content")


def _prompt_list(prompt: Any) -> list[str] | list[list[int]]:
    """The completion prompt(s) as one list entry per prompt, checked in a single pass each."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(_is_int(t) and t >= 0 for t in prompt):
            return [prompt]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, list) and p and all(_is_int(t) and t >= 0 for t in p) for p in prompt):
            return list(prompt)
    raise bad_request(
        "`prompt` is required and must be a string, a list of strings, a list of token ids "
        "or a list of token-id lists.",
        param="prompt",
    )


def check_lengths(req: ParsedRequest, prompts: list[list[int]], max_model_len: int) -> None:
    """vLLM's length rules, applied before any leg starts.

    The prefill leg rewrites max_tokens and drops min_tokens, so a request vLLM would refuse for
    them would only fail on the decode leg, after a wasted prefill: the gateway refuses it first,
    with vLLM's wording.
    """
    body = req.body
    param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_out = body.get(param)
    min_out = body.get("min_tokens") or 0
    if max_out is not None:
        if max_out < 1:
            raise bad_request(f"max_tokens must be at least 1, got {max_out}.", param="max_tokens")
        if max_out > max_model_len:
            raise bad_request(
                f"{param}={max_out} cannot be greater than max_model_len={max_model_len}. "
                "Please request fewer output tokens.",
                param=param,
            )
    for ids in prompts:
        n = len(ids)
        if n > max_model_len:
            # vLLM tokenizes text with truncation at max_model_len + 1, hence its "at least".
            shown = f"at least {max_model_len + 1}" if req.kind == "chat" or isinstance(req.prompts[0], str) else n
            raise APIError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
                f"contains {shown} input tokens, which exceeds this limit even without any output tokens. "
                "Please reduce the length of the input prompt.",
                param="input_tokens",
                code="context_length_exceeded",
            )
        room = max_model_len - n
        if room < 1:
            raise bad_request("max_tokens must be at least 1, got 0.", param="max_tokens")
        effective = room if max_out is None else min(max_out, room)
        if min_out > effective:
            raise bad_request(
                f"min_tokens must be less than or equal to max_tokens={effective}, got {min_out}.",
                param="min_tokens",
            )


def too_large(limit: int) -> APIError:
    return APIError(
        413, f"The request body is larger than this gateway accepts ({limit} bytes).", code="request_too_large"
    )


# vLLM's default max_tokens for completions (CompletionRequest); chat has none (the context's room).
COMPLETION_DEFAULT_MAX_TOKENS = 16


def check_output_limit(req: ParsedRequest, limits: LimitsConfig, max_model_len: int | None = None) -> None:
    """The gateway's caps on what one request may ask for (``limits``), checked once after parsing.

    ``n``, ``best_of`` and the number of prompts are capped first: each sequence holds a decode
    slot and its KV. ``max_output_tokens`` (0: none) then bounds the request as a whole, max tokens
    x sequences, since a per-sequence cap alone is multiplied away by ``n``. A request that names no
    max tokens gets its share written into the body the engines receive (never forwarded
    uncapped), no more than ``max_model_len`` (vLLM refuses more). Within the limits the body is
    otherwise left as sent.
    """
    body = req.body
    n = body.get("n") or 1
    best_of = body.get("best_of") or 1
    prompts = len(req.prompts) if req.kind == "completion" else 1
    if limits.max_prompts and prompts > limits.max_prompts:
        raise bad_request(
            f"prompt must hold at most {limits.max_prompts} prompts on this gateway, got {prompts}.",
            param="prompt",
            code="too_many_prompts",
        )
    if limits.max_n and n > limits.max_n:
        raise bad_request(f"n must be at most {limits.max_n} on this gateway, got {n}.", param="n", code="n_too_large")
    if limits.max_best_of and best_of > limits.max_best_of:
        raise bad_request(
            f"best_of must be at most {limits.max_best_of} on this gateway, got {best_of}.",
            param="best_of",
            code="best_of_too_large",
        )
    # What vLLM refuses anyway (older versions for best_of): refused here, before any engine is held.
    if body.get("best_of") is not None and best_of < n:
        raise bad_request(
            f"best_of must be greater than or equal to n, got n={n} and best_of={best_of}.", param="best_of"
        )
    temperature = body.get("temperature")  # below vLLM's _SAMPLING_EPS: greedy, one sequence only
    if n > 1 and temperature is not None and temperature < 1e-5 and not body.get("use_beam_search"):
        raise bad_request(f"n must be 1 when using greedy sampling, got {n}.", param="n")

    limit = limits.max_output_tokens
    if not limit:
        return
    per_prompt = max(n, best_of)
    seqs = per_prompt * prompts
    parts = [f"best_of={best_of}" if best_of > n else f"n={n}"] if per_prompt > 1 else []
    parts += [f"{prompts} prompts"] if prompts > 1 else []
    asks = f"{seqs} sequences ({' x '.join(parts)})"
    cap = limit // seqs
    if cap < 1:
        param = "best_of" if best_of > n else "n" if n > 1 else "prompt"
        raise bad_request(
            f"This request asks for {asks}, more than the {limit} output tokens this gateway "
            "allows per request (at least 1 per sequence); ask for fewer.",
            param=param,
            code="too_many_sequences",
        )

    def over(param: str, value: int, code: str) -> APIError:
        total = "" if seqs == 1 else f", and this one asks for {asks}, {value * seqs} tokens in all"
        return bad_request(
            f"{param} must be at most {cap}, got {value}: this gateway allows at most {limit} "
            f"output tokens per request{total}.",
            param=param,
            code=code,
        )

    # The value vLLM uses: for chat max_completion_tokens wins when both are set.
    chat_mct = req.kind == "chat" and body.get("max_completion_tokens") is not None
    param = "max_completion_tokens" if chat_mct else "max_tokens"
    value = body.get(param)
    if value is not None and value > cap:
        raise over(param, value, "max_tokens_too_large")
    min_tokens = body.get("min_tokens") or 0
    if min_tokens > cap:
        raise over("min_tokens", min_tokens, "min_tokens_too_large")
    if value is None:
        share = min(cap, max_model_len) if max_model_len else cap
        if req.kind == "chat":
            body["max_completion_tokens"] = share
        else:
            # Absent or null, vLLM's default applies (vLLM 0.32 turns a null into it too): keep it, bounded.
            body["max_tokens"] = min(COMPLETION_DEFAULT_MAX_TOKENS, share)
