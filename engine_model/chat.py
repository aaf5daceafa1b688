"""Turn an OpenAI chat request into the conversation, template and kwargs vLLM renders.

vLLM normalizes the messages (content parts, tool calls, developer role), picks a chat template,
merges the template kwargs from several sources and calls the tokenizer's ``apply_chat_template``.
The gateway repeats those steps so that its token count, and later its block hashes, equal the
engine's. The rules mirror vLLM 0.32's renderer (``vllm/renderers/hf.py``, ``chat_utils.py``,
``params.py`` and ``online_renderer.py``); the real-engine suite checks the counts end to end.
Everything here is pure: ``gateway.tokenization.tokenizer`` owns the tokenizer and does the rendering.

The steps live in three modules (this one gathers what the gateway uses, so that
``from engine_model import chat`` stays its one import): :mod:`engine_model.chat_messages`
(normalizing the messages and tools), :mod:`engine_model.chat_template` (parsing, content-format
detection, selection, error reasons) and :mod:`engine_model.chat_kwargs` (checking, merging and
filtering the template kwargs).
"""

from __future__ import annotations

from engine_model.chat_kwargs import (
    TEMPLATE_CALL_KWARGS,
    TOKENIZER_CALL_KWARGS,
    KwargsLimits,
    RenderArgs,
    _json_size,
    check_template_kwargs,
    merged_kwargs,
    render_args,
)
from engine_model.chat_messages import BILLING_HEADER, for_template, normalize_messages, normalize_tools
from engine_model.chat_template import (
    NO_TEMPLATE,
    ChatTemplateError,
    ContentFormat,
    detect_content_format,
    select_template,
    template_error_reason,
    template_variables,
)

__all__ = [
    "BILLING_HEADER",
    "NO_TEMPLATE",
    "TEMPLATE_CALL_KWARGS",
    "TOKENIZER_CALL_KWARGS",
    "ChatTemplateError",
    "ContentFormat",
    "KwargsLimits",
    "RenderArgs",
    "_json_size",
    "check_template_kwargs",
    "detect_content_format",
    "for_template",
    "merged_kwargs",
    "normalize_messages",
    "normalize_tools",
    "render_args",
    "select_template",
    "template_error_reason",
    "template_variables",
]
