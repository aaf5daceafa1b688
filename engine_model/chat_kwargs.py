"""The kwargs vLLM passes to ``apply_chat_template`` (``params.py`` ChatParams,
``online_renderer.py`` preprocess_chat): the request's ``chat_template_kwargs`` checked against
limits and against configuring the tokenizer call, merged with the server's defaults and the
request's own fields, then filtered to what the template reads.

This is the kwargs side of :mod:`engine_model.chat`; what the template reads comes from
:mod:`engine_model.chat_template`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine_model.chat_template import ChatTemplateError, template_variables

# apply_chat_template's parameters that configure its own tokenizer call, not the template. vLLM
# forwards them (``tokenize`` binds to its safe_apply_chat_template parameter, the rest are
# transformers' base parameters), so a 146-byte request could make the tokenizer pad to ten million
# ids (issue 27). A request may only repeat their defaults; any other value is refused (400), not
# dropped: the body goes upstream unchanged, so a gateway that dropped them would count another
# prompt than the engine's and hand the engine the same allocation. ``truncate_prompt_tokens`` and
# ``truncation_side`` are the request's own fields for truncation.
TOKENIZER_CALL_KWARGS = frozenset(
    {
        "max_length",
        "padding",
        "return_assistant_tokens_mask",
        "return_dict",
        "return_tensors",
        "tokenize",
        "tokenizer_kwargs",
        "truncation",
    }
)
# The call's own arguments, filled from the request itself; as kwargs they only fail the call.
_CALL_ARGUMENTS = frozenset({"conversation", "messages", "self"})
# Parameters of apply_chat_template that reach the template (or transformers' handling of its output)
# whether or not the template reads them; vLLM sets them from the request's own fields.
TEMPLATE_CALL_KWARGS = frozenset({"add_generation_prompt", "continue_final_message", "documents"})
_DEFAULTS = (None, False, "auto")  # what a tokenizer-call kwarg may say: unset, off, or vLLM's "unset"


@dataclass(frozen=True, slots=True)
class KwargsLimits:
    """Bounds on a request's chat_template_kwargs, checked before any other work on it."""

    max_keys: int = 32
    max_depth: int = 16  # the object itself is 1
    max_bytes: int = 256 * 1024  # its compact JSON text


def _json_size(value: Any, max_depth: int, budget: int) -> tuple[int, int]:
    """(size of ``value``'s compact JSON text, its nesting depth), each counted only up to just
    past its bound: the walk stops there, so it costs at most ``budget`` steps whatever was sent.
    Strings count their characters (bytes for ASCII), escapes aside."""
    size, deepest = 0, 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            if depth > max_depth:
                return size, deepest
            size += 1 + max(len(item), 1)  # brackets and separators
            members = item.items() if isinstance(item, dict) else ((None, v) for v in item)
            for key, member in members:
                if key is not None:
                    size += len(key) + 3  # quotes and colon
                stack.append((member, depth + 1))
                if size > budget:
                    return size, deepest
        elif isinstance(item, str):
            size += len(item) + 2
        elif item is None or isinstance(item, bool):
            size += 5 if item is False else 4
        else:  # a number (orjson reads integers past 64 bits as floats)
            size += len(str(item))
        if size > budget:
            return size, deepest
    return size, deepest


def check_template_kwargs(kwargs: Any, limits: KwargsLimits) -> None:
    """Refuse a request's chat_template_kwargs that are too big, or that try to configure the
    tokenizer call rather than the template (``TOKENIZER_CALL_KWARGS``). Runs before anything is
    merged, rendered or tokenized; the walk is bounded by the limits, not by what was sent."""
    if not kwargs:
        return
    if not isinstance(kwargs, dict):
        raise ChatTemplateError("`chat_template_kwargs` must be an object.", param="chat_template_kwargs")
    if len(kwargs) > limits.max_keys:
        raise ChatTemplateError(
            f"`chat_template_kwargs` has {len(kwargs)} keys; this gateway accepts at most {limits.max_keys} "
            "(models[].chat_template_kwargs_max_keys).",
            param="chat_template_kwargs",
        )
    size, depth = _json_size(kwargs, limits.max_depth, limits.max_bytes)
    if depth > limits.max_depth:
        raise ChatTemplateError(
            f"`chat_template_kwargs` is nested deeper than {limits.max_depth} levels "
            "(models[].chat_template_kwargs_max_depth).",
            param="chat_template_kwargs",
        )
    if size > limits.max_bytes:
        raise ChatTemplateError(
            f"`chat_template_kwargs` is larger than {limits.max_bytes} bytes "
            "(models[].chat_template_kwargs_max_bytes).",
            param="chat_template_kwargs",
        )
    tokenizing = sorted(k for k in TOKENIZER_CALL_KWARGS & kwargs.keys() if kwargs[k] not in _DEFAULTS)
    if tokenizing:
        raise ChatTemplateError(
            f"`chat_template_kwargs` may not set {', '.join(tokenizing)}: they configure the tokenizer, not the "
            "chat template. Use `truncate_prompt_tokens` and `truncation_side` to truncate a prompt.",
            param="chat_template_kwargs",
        )
    arguments = sorted(_CALL_ARGUMENTS & kwargs.keys())
    if arguments:
        raise ChatTemplateError(
            f"`chat_template_kwargs` may not set {', '.join(arguments)}: the request's messages fill it.",
            param="chat_template_kwargs",
        )


def _merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's merge_kwargs: ``over`` wins, except where its value is null or "auto" (unset)."""
    return {**base, **{k: v for k, v in over.items() if v is not None and not (isinstance(v, str) and v == "auto")}}


def merged_kwargs(
    body: Mapping[str, Any], tools: list[dict[str, Any]] | None, server_defaults: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Every kwarg vLLM puts together for apply_chat_template, before filtering.

    Lowest to highest: the server's --default-chat-template-kwargs, the request's ``tools`` (and
    ``tokenize=False``), the request's chat_template_kwargs (so its ``tools`` replace the request's),
    the request's own fields. Null and "auto" values never override.
    """
    user = body.get("chat_template_kwargs") or {}
    effort = body.get("reasoning_effort")
    fields: dict[str, Any] = {
        "add_generation_prompt": True if body.get("add_generation_prompt") is None else body["add_generation_prompt"],
        "continue_final_message": bool(body.get("continue_final_message")),
        "documents": body.get("documents"),
        "reasoning_effort": effort,
    }
    if effort is not None and "enable_thinking" not in user:
        fields["enable_thinking"] = effort != "none"
    defaults = _merge(server_defaults or {}, {"tools": tools, "tokenize": False})
    return _merge(defaults, _merge(user, fields))


@dataclass(frozen=True)
class RenderArgs:
    """How to call apply_chat_template (never tokenizing) for one request."""

    tools: Any
    kwargs: dict[str, Any]  # the rest: only what the template reads, or the call passes to it


def render_args(merged: Mapping[str, Any], template: str) -> RenderArgs:
    """Keep only the kwargs the template reads (its undeclared variables, as vLLM finds them) or
    apply_chat_template hands to it (``TEMPLATE_CALL_KWARGS``); like vLLM, the others are dropped
    silently (clients send e.g. enable_thinking to every model). Tokenizer-call kwargs never pass,
    whatever the template reads: a request's were refused by ``check_template_kwargs``, the server
    defaults' do nothing in vLLM (its ``tokenize`` is always False)."""
    accepted = template_variables(template) | TEMPLATE_CALL_KWARGS
    accepted -= TOKENIZER_CALL_KWARGS | _CALL_ARGUMENTS | {"chat_template", "tools"}
    kwargs = {k: v for k, v in merged.items() if k in accepted}
    kwargs["return_dict"] = False
    return RenderArgs(tools=merged.get("tools"), kwargs=kwargs)
