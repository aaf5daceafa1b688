"""OpenAI request checks, as vLLM 0.32 makes them: a request body to a :class:`Job`, or an
:class:`~sim.errors.ApiError` with vLLM's status, type and message.

The body is checked field by field (no pydantic) in vLLM's order: the schema (pydantic's lax
integers, strings or lists), the P/D handshake (``kv_transfer_params``: which leg, and whether this
engine's role takes it), the model, then tokenization (completions: ``add_special_tokens``; chat:
the messages normalized by the gateway's rules, :mod:`engine_model.chat_messages`, and the chat
template) and the length and ``max_tokens`` checks. The response side is :mod:`sim.responses`.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from engine_model.adapters import LoRARequest
from engine_model.chat_messages import normalize_messages
from engine_model.chat_template import detect_content_format
from engine_model.config import SimConfig
from engine_model.seq import DECODE, PLAIN, PREFILL, Seq
from engine_model.tokens import ByteTokenizer, HFTokenizer
from sim.errors import ApiError, not_supported, schema_error, validation_error

REQUIRED_REMOTE_FIELDS = ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host", "remote_port")
# Request features that change the response shape and that the simulator does not model.
_UNSUPPORTED_COMPLETION = ("echo", "suffix", "prompt_embeds", "prompt_logprobs", "use_beam_search", "logprobs")
_UNSUPPORTED_CHAT = ("prompt_logprobs", "use_beam_search", "logprobs", "echo")


def random_id() -> str:
    """vLLM's random_uuid(): 16 hex characters."""
    return f"{random.getrandbits(64):016x}"


@dataclass
class Job:
    """One parsed HTTP generation request."""

    endpoint: str  # "completions" | "chat"
    kind: str
    base_id: str
    response_id: str
    prompts: list[list[int]]
    n: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    max_tokens: list[int]
    min_tokens: int
    stop: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    return_token_ids: bool
    kv_in: dict[str, Any] | None
    role: str = "assistant"
    created: int = 0
    seqs: list[Seq] = field(default_factory=list)
    lora: LoRARequest | None = None  # the adapter ``model`` named (None: the base model)
    model: str = ""  # what the response's ``model`` says: the adapter's name, else the served name


def classify_kv(kv: Any) -> str:
    """plain | prefill | decode, from kv_transfer_params the way the NIXL connector reads it."""
    if not kv or not isinstance(kv, dict):
        return PLAIN
    if kv.get("do_remote_decode"):
        return PREFILL
    if kv.get("do_remote_prefill"):
        return DECODE
    return PLAIN


# ---------------------------------------------------------------------------- parsing
def _int_field(body: dict[str, Any], name: str, default: int | None, *, minimum: int | None = None) -> int | None:
    v = body.get(name, default)
    if v is None:
        return default
    if type(v) is not int:
        # pydantic's lax mode: 9.0 and "9" are 9; True is 1
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        elif isinstance(v, str) and v.strip().lstrip("+-").isdigit():
            v = int(v.strip())
        elif isinstance(v, bool):
            v = int(v)
        else:
            raise schema_error("Input should be a valid integer, unable to parse string as an integer", f"body.{name}")
    if minimum is not None and v < minimum:
        raise schema_error(f"Input should be greater than or equal to {minimum}", f"body.{name}")
    return v


def _str_list(body: dict[str, Any], name: str) -> list[str]:
    v = body.get(name)
    if v is None:
        return []
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and all(isinstance(x, str) for x in v):
        return list(v)
    raise schema_error("Input should be a valid string or list of strings", f"body.{name}")


def _int_list(body: dict[str, Any], name: str) -> list[int]:
    v = body.get(name)
    if v is None:
        return []
    if isinstance(v, list) and all(type(x) is int for x in v):
        return list(v)
    raise schema_error("Input should be a valid list of integers", f"body.{name}")


def _check_common(body: dict[str, Any], cfg: SimConfig) -> None:
    if body.get("stream_options") and not body.get("stream"):
        raise validation_error("Stream options can only be defined when `stream=True`.", "stream_options")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise schema_error("Input should be a valid string", "body.model")


Adapters = Mapping[str, LoRARequest]  # the LoRA adapters a request's ``model`` may name, by name


def check_model(body: dict[str, Any], cfg: SimConfig, loras: Adapters | None = None) -> LoRARequest | None:
    """vLLM's ``_check_model``: no model or the served name is the base model, a loaded adapter's
    name is that adapter; anything else is a 404 that lists the base names only."""
    model = body.get("model")
    if not model or model == cfg.model:
        return None
    lora = loras.get(model) if loras else None
    if lora is None:
        raise ApiError(
            f"The model `{model}` does not exist. Valid aliases: {cfg.model}.", 404, "NotFoundError", "model"
        )
    return lora


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool, bool]:
    stream = bool(body.get("stream"))
    opts = body.get("stream_options") if stream else None
    if opts is not None and not isinstance(opts, dict):
        raise schema_error("Input should be a valid dictionary", "body.stream_options")
    include = bool(opts and opts.get("include_usage"))
    continuous = include and opts is not None and bool(opts.get("continuous_usage_stats"))
    return stream, include, continuous


def check_token_len(tokens: list[int], cfg: SimConfig, truncated_text: bool = False) -> None:
    """vLLM's post-tokenization length check (TokenizeParams._token_len_check)."""
    limit = cfg.max_model_len
    count = len(tokens)
    if count > limit:
        if truncated_text:  # text prompts are encoded with max_length = limit + 1
            count = limit + 1
        qualifier = "at least " if count == limit + 1 else ""
        raise validation_error(
            f"This model's maximum context length is {limit} tokens. However, your prompt "
            f"contains {qualifier}{count} input tokens, which exceeds this limit even without "
            f"any output tokens. Please reduce the length of the input prompt.",
            "input_tokens",
            count,
        )


def check_engine_prompt(tokens: list[int]) -> None:
    """vLLM's input-processor check, which runs once the engine has the request: in
    streaming mode the client already has HTTP 200 and gets an error event instead.
    (A prompt of exactly max_model_len tokens is refused earlier, by the max_tokens check.)"""
    if not tokens:
        e = validation_error("The decoder prompt cannot be empty")
        e.late = True
        raise e


def check_vocab(tokens: list[int], tok: ByteTokenizer | HFTokenizer, parameter: str | None = None) -> None:
    if not tokens or tok.max_token_id is None:
        return
    lo, hi = min(tokens), max(tokens)
    if lo < 0:
        raise validation_error(f"Token id {lo} is out of vocabulary", parameter)
    if hi > tok.max_token_id:
        raise validation_error(f"Token id {hi} is out of vocabulary", parameter)


def _encode_text(text: str, tok: ByteTokenizer | HFTokenizer, cfg: SimConfig, add_special: bool) -> list[int]:
    mcpt = tok.max_chars_per_token
    if mcpt is not None and len(text) > cfg.max_model_len * mcpt:
        raise validation_error(
            f"This model's maximum context length is {cfg.max_model_len} tokens. However, your "
            f"prompt contains {len(text)} characters (more than {cfg.max_model_len * mcpt} "
            f"characters, which is the upper bound for {cfg.max_model_len} input tokens). "
            f"Please reduce the length of the input prompt.",
            "input_text",
            len(text),
        )
    ids = tok.encode(text, add_special_tokens=add_special)
    check_token_len(ids, cfg, truncated_text=True)
    return ids


def check_max_param(requested: int | None, param: str, cfg: SimConfig) -> None:
    """TokenizeParams: the output budget alone must fit in the context (checked before tokenizing)."""
    if requested is not None and requested > cfg.max_model_len:
        raise validation_error(
            f"{param}={requested} cannot be greater than max_model_len={cfg.max_model_len}. "
            f"Please request fewer output tokens.",
            param,
            requested,
        )


def sampling_max_tokens(requested: int | None, prompt_len: int, cfg: SimConfig, min_tokens: int) -> int:
    """get_max_tokens() clamping, then SamplingParams' checks (in vLLM's order)."""
    fallback = requested if requested is not None else cfg.default_max_tokens
    value = min(cfg.max_model_len - prompt_len, fallback)
    if value < 1:
        raise validation_error(f"max_tokens must be at least 1, got {value}.", "max_tokens", value)
    if min_tokens < 0:
        raise validation_error(f"min_tokens must be greater than or equal to 0, got {min_tokens}.")
    if min_tokens > value:
        raise validation_error(f"min_tokens must be less than or equal to max_tokens={value}, got {min_tokens}.")
    return value


def _kv_params(body: dict[str, Any], cfg: SimConfig) -> tuple[str, dict[str, Any] | None]:
    kv = body.get("kv_transfer_params")
    if kv is not None and not isinstance(kv, dict):
        raise schema_error("Input should be a valid dictionary", "body.kv_transfer_params")
    kind = classify_kv(kv)
    if kind == PREFILL and not cfg.accepts_prefill_legs():
        raise ApiError(
            f"sim: this engine has role '{cfg.role}' and refuses prefill legs "
            f"(kv_transfer_params.do_remote_decode=true); send them to a prefill engine",
            400,
            "BadRequestError",
            "kv_transfer_params",
        )
    if kind == DECODE:
        assert kv is not None  # classify_kv() says DECODE only for a non-empty dict
        if not cfg.accepts_decode_legs():
            raise ApiError(
                f"sim: this engine has role '{cfg.role}' and refuses decode legs "
                f"(kv_transfer_params.do_remote_prefill=true); send them to a decode engine",
                400,
                "BadRequestError",
                "kv_transfer_params",
            )
        missing = [f for f in REQUIRED_REMOTE_FIELDS if kv.get(f) in (None, [], "")]
        if missing:
            # vLLM 0.32 would hang the request or trip an assertion in the engine core.
            raise ApiError(
                "sim: kv_transfer_params.do_remote_prefill=true needs " + ", ".join(missing),
                400,
                "BadRequestError",
                "kv_transfer_params",
            )
        groups = kv["remote_block_ids"]
        if not isinstance(groups, list) or not all(isinstance(g, list) for g in groups):
            raise ApiError(
                "sim: kv_transfer_params.remote_block_ids must be a list of lists of block ids",
                400,
                "BadRequestError",
                "kv_transfer_params",
            )
    return kind, (dict(kv) if kv else None)


def _request_id_base(body: dict[str, Any], header_id: str | None) -> str:
    if header_id is not None:
        return header_id
    rid = body.get("request_id")
    if isinstance(rid, str):
        return rid
    return random_id()


def _reject_unsupported(body: dict[str, Any], names: tuple[str, ...]) -> None:
    for name in names:
        v = body.get(name)
        if v is not None and v is not False:
            raise not_supported(name)


def parse_completion(
    body: Any, cfg: SimConfig, tok: ByteTokenizer | HFTokenizer, header_id: str | None, loras: Adapters | None = None
) -> Job:
    if not isinstance(body, dict):
        raise schema_error("Input should be a valid dictionary or object to extract fields from")
    _check_common(body, cfg)
    prompt = body.get("prompt")
    if prompt is None or prompt == "":
        if body.get("prompt_embeds") is not None:
            raise not_supported("prompt_embeds")
        raise validation_error("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
    if prompt == []:
        raise validation_error("You must pass at least one prompt")
    # prompt: str | list[int] | list[list[int]] | list[str]
    if isinstance(prompt, str):
        raw_prompts: list[str | list[int]] = [prompt]
    elif isinstance(prompt, list) and all(type(t) is int for t in prompt):
        if any(t < 0 for t in prompt):
            raise schema_error("Input should be greater than or equal to 0", "body.prompt")
        raw_prompts = [prompt]
    elif (
        isinstance(prompt, list)
        and all(
            isinstance(p, str) or (isinstance(p, list) and all(type(t) is int and t >= 0 for t in p)) for p in prompt
        )
        and len({isinstance(p, str) for p in prompt}) == 1
    ):
        raw_prompts = list(prompt)
    else:
        raise schema_error("Input should be a valid string or list of token ids", "body.prompt")
    n = _int_field(body, "n", 1, minimum=1) or 1
    stream, include_usage, continuous = _stream_flags(body)
    max_req = _int_field(body, "max_tokens", None)
    min_tokens = _int_field(body, "min_tokens", 0) or 0
    stop = _str_list(body, "stop")
    stop_ids = _int_list(body, "stop_token_ids")
    kind, kv = _kv_params(body, cfg)
    lora = check_model(body, cfg, loras)
    _reject_unsupported(body, _UNSUPPORTED_COMPLETION)
    if kind != PLAIN and (n > 1 or len(raw_prompts) > 1):
        raise not_supported("n > 1 or several prompts with kv_transfer_params")
    check_max_param(max_req, "max_tokens", cfg)
    add_special = body.get("add_special_tokens", True) is not False
    prompts: list[list[int]] = []
    for p in raw_prompts:
        if isinstance(p, str):
            prompts.append(_encode_text(p, tok, cfg, add_special))
        else:
            ids = list(p)
            check_token_len(ids, cfg)
            prompts.append(ids)
    for ids in prompts:
        check_vocab(ids, tok)
    max_tokens = [sampling_max_tokens(max_req, len(ids), cfg, min_tokens) for ids in prompts]
    base = _request_id_base(body, header_id)
    return Job(
        endpoint="completions",
        kind=kind,
        base_id=base,
        response_id=f"cmpl-{base}",
        prompts=prompts,
        n=n,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop=stop,
        stop_token_ids=stop_ids,
        ignore_eos=bool(body.get("ignore_eos")),
        return_token_ids=bool(body.get("return_token_ids")),
        kv_in=kv,
        lora=lora,
        model=lora.name if lora is not None else cfg.model,
    )


def _message_text(content: Any, idx: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text"):
                parts.append(str(part.get("text", "")))
            elif isinstance(part, dict) and "text" in part and "type" not in part:
                parts.append(str(part["text"]))
            else:
                ptype = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise not_supported(f"messages[{idx}].content part of type {ptype}")
        return "\n".join(parts)
    raise schema_error("Input should be a valid string or list of content parts", f"body.messages.{idx}.content")


def parse_chat(
    body: Any, cfg: SimConfig, tok: ByteTokenizer | HFTokenizer, header_id: str | None, loras: Adapters | None = None
) -> Job:
    if not isinstance(body, dict):
        raise schema_error("Input should be a valid dictionary or object to extract fields from")
    _check_common(body, cfg)
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise schema_error("Field required" if messages is None else "Input should be a valid list", "body.messages")
    conversation: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise schema_error("Input should be a valid message with a role", f"body.messages.{i}")
        conversation.append({"role": msg["role"], "content": _message_text(msg.get("content"), i)})
    template = getattr(getattr(tok, "tok", None), "chat_template", None)
    if isinstance(template, str):
        # Hand the template the conversation exactly as vLLM does (joined text, or content parts
        # when the template loops over them): the same rules the gateway counts tokens with.
        conversation, _ = normalize_messages(messages, detect_content_format(template))
    add_gen = body.get("add_generation_prompt", True) is not False
    cont = bool(body.get("continue_final_message"))
    if cont and add_gen:
        raise validation_error("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    n = _int_field(body, "n", 1, minimum=1) or 1
    stream, include_usage, continuous = _stream_flags(body)
    if body.get("max_completion_tokens") is not None:
        max_req = _int_field(body, "max_completion_tokens", None)
        max_param = "max_completion_tokens"
    else:
        max_req = _int_field(body, "max_tokens", None)
        max_param = "max_tokens"
    min_tokens = _int_field(body, "min_tokens", 0) or 0
    stop = _str_list(body, "stop")
    stop_ids = _int_list(body, "stop_token_ids")
    kind, kv = _kv_params(body, cfg)
    lora = check_model(body, cfg, loras)
    _reject_unsupported(body, _UNSUPPORTED_CHAT)
    if kind != PLAIN and n > 1:
        raise not_supported("n > 1 with kv_transfer_params")
    check_max_param(max_req, max_param, cfg)
    reuse = kv.pop("prompt_token_ids", None) if kv else None
    if reuse is not None:
        # vLLM 0.32: a decode stage may get the prefill stage's token ids and skip templating.
        if not isinstance(reuse, list) or not reuse or any(type(x) is not int or x < 0 for x in reuse):
            raise validation_error(
                "`kv_transfer_params['prompt_token_ids']` must be a non-empty list of non-negative integers.",
                "kv_transfer_params.prompt_token_ids",
            )
        check_vocab(reuse, tok, "kv_transfer_params.prompt_token_ids")
        ids = list(reuse)
    else:
        template_kwargs = body.get("chat_template_kwargs")
        kwargs: dict[str, Any] = template_kwargs if isinstance(template_kwargs, dict) else {}
        try:
            ids = tok.apply_chat(conversation, add_generation_prompt=add_gen, continue_final_message=cont, **kwargs)
        except ApiError:
            raise
        except Exception as e:  # the template rejected the conversation
            raise validation_error(str(e)) from e
    check_token_len(ids, cfg, truncated_text=reuse is None)
    max_tokens = sampling_max_tokens(max_req, len(ids), cfg, min_tokens)
    base = _request_id_base(body, header_id)
    role = "assistant" if add_gen else conversation[-1]["role"] if conversation else "assistant"
    return Job(
        endpoint="chat",
        kind=kind,
        base_id=base,
        response_id=f"chatcmpl-{base}",
        prompts=[ids],
        n=n,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        max_tokens=[max_tokens],
        min_tokens=min_tokens,
        stop=stop,
        stop_token_ids=stop_ids,
        ignore_eos=bool(body.get("ignore_eos")),
        return_token_ids=bool(body.get("return_token_ids")),
        kv_in=kv,
        role=role,
        lora=lora,
        model=lora.name if lora is not None else cfg.model,
    )


def internal_ids(job: Job) -> list[str]:
    """Engine request ids: vLLM appends '-<8 random hex>' to the id it is given."""
    if job.endpoint == "completions":
        return [f"{job.response_id}-{i}-{random_id()[:8]}" for i in range(len(job.prompts))]
    return [f"{job.response_id}-{random_id()[:8]}"]
