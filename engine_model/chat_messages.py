"""A chat request's messages as vLLM hands them to the template (``vllm/renderers/chat_utils.py``):
content parts joined or kept as parts (the template's content format), media parts dropped or
typed, tool calls with parsed arguments, developer messages and tools in vLLM's key order, the
system messages merged when the template has no developer role.

This is the message side of :mod:`engine_model.chat`; the template side (content-format
detection, selection) is :mod:`engine_model.chat_template`. The request is never modified (its
body goes upstream as sent).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from engine_model.chat_template import ChatTemplateError, ContentFormat

# Text part types and the field that holds their text. A text or refusal part whose text is null
# is skipped; the others render a null text.
_TEXT_PARTS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
_SKIP_NULL = frozenset({"text", "refusal"})
# Media part types and the modality they become.
_MEDIA_PARTS = {
    "image_url": "image",
    "input_image": "image",
    "image_pil": "image",
    "image_embeds": "image",
    "audio_url": "audio",
    "input_audio": "audio",
    "audio_embeds": "audio",
    "video_url": "video",
    "video_embeds": "video",
    "prompt_embeds": "prompt_embeds",
}
# A part without a type (or with a uuid) is recognized by its keys, in this order.
_UNTYPED_KEYS = (
    "image_url",
    "image_pil",
    "image_embeds",
    "audio_embeds",
    "video_embeds",
    "prompt_embeds",
    "audio_url",
    "input_audio",
    "video_url",
    "tool_reference",
)
# Fields of vLLM's content-part types; any other field of a text or media part reaches the template.
_KNOWN_PART_FIELDS = frozenset(
    {
        "audio_embeds",
        "audio_url",
        "closed",
        "data",
        "file",
        "image_embeds",
        "image_pil",
        "image_url",
        "input_audio",
        "name",
        "prompt_cache_breakpoint",
        "refusal",
        "text",
        "thinking",
        "type",
        "uuid",
        "video_embeds",
        "video_url",
    }
)
_SUPPORTED_PARTS = ", ".join(sorted({*_TEXT_PARTS, *_MEDIA_PARTS, "tool_reference"}))
BILLING_HEADER = "x-anthropic-billing-header"


def _extras(part: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in part.items() if k not in _KNOWN_PART_FIELDS}


def _text_of(part: Any) -> Any:
    if isinstance(part, str):
        return part
    return part.get("text") if part.get("type") == "text" else None


def _strip_billing_header(parts: list[Any]) -> list[Any]:
    """Claude Code starts system prompts with a per-request attribution line; vLLM drops that line
    (it would defeat the prefix cache), and the part when nothing else is left."""
    out = []
    for part in parts:
        text = _text_of(part)
        if not (isinstance(text, str) and text.startswith(BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _part(part: Any, fmt: ContentFormat) -> tuple[Any, bool]:
    """One content part as the template sees it (None: dropped), and whether it is media."""
    if isinstance(part, str):
        return ({"type": "text", "text": part} if fmt == "openai" else part), False
    kind = part.get("type")
    if kind is None or part.get("uuid") is not None:
        kind = next((k for k in _UNTYPED_KEYS if k in part), None)
        if kind is None:
            raise ChatTemplateError("Missing 'type' field in multimodal part.", param="type")
    if not isinstance(kind, str):
        raise ChatTemplateError("Invalid 'type' field in multimodal part.", param="type")
    if kind in _TEXT_PARTS:
        text = part.get(_TEXT_PARTS[kind])
        if text is None and kind in _SKIP_NULL:
            return None, False
        return ({"type": "text", "text": text, **_extras(part)} if fmt == "openai" else text), False
    if kind == "tool_reference":
        name = part.get("name")
        return ({"type": "tool_reference", "name": name} if fmt == "openai" else name), False
    if kind in _MEDIA_PARTS:
        # The engine expands a media part into placeholder tokens the gateway cannot count. In the
        # string format vLLM also adds the model's placeholder text; here the part just drops out.
        return ({"type": _MEDIA_PARTS[kind], **_extras(part)} if fmt == "openai" else None), True
    raise ChatTemplateError(
        f"Unsupported chat content part type: {kind!r}. Supported types: {_SUPPORTED_PARTS}.", param="type"
    )


def _content(msg: Mapping[str, Any], fmt: ContentFormat) -> tuple[str | list[Any], bool]:
    content = msg.get("content")
    if (
        isinstance(content, str)
        and fmt == "string"
        and not (msg["role"] == "system" and content.startswith(BILLING_HEADER))
    ):
        return content, False  # what the loop below makes of it (a conversation is mostly these)
    parts = [] if content is None else [content] if isinstance(content, str) else list(content)
    if msg["role"] == "system":
        parts = _strip_billing_header(parts)
    rendered, media = [], False
    for part in parts:
        out, is_media = _part(part, fmt)
        media |= is_media
        if out:  # vLLM keeps truthy results only: empty strings drop out of the string format
            rendered.append(out)
    return (rendered if fmt == "openai" else "\n".join(rendered)), media


def _tool_content(content: str | list[Any]) -> str | list[Any]:
    """Tool results sent as text parts become one string (most templates expect that)."""
    if not isinstance(content, list) or any(isinstance(p, dict) and p.get("type") != "text" for p in content):
        return content
    return "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")


def normalize_messages(messages: list[dict[str, Any]], fmt: ContentFormat) -> tuple[list[dict[str, Any]], bool]:
    """The conversation as vLLM hands it to the template, and whether it has media parts.

    The request is not modified (its body goes upstream as sent).
    """
    conversation: list[dict[str, Any]] = []
    has_media = False
    for msg in messages:
        role = msg["role"]
        content, media = _content(msg, fmt)
        has_media |= media
        out: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant":
            if msg.get("tool_calls") is not None:
                out["tool_calls"] = _tool_calls(msg["tool_calls"])
            # vLLM renames the deprecated reasoning_content to reasoning before anything else.
            reasoning = msg.get("reasoning")
            if reasoning is None:
                reasoning = msg.get("reasoning_content")
            if reasoning is not None:
                out["reasoning"] = out["reasoning_content"] = reasoning
        elif role == "tool":
            if "tool_call_id" in msg:
                out["tool_call_id"] = msg["tool_call_id"]
            out["content"] = _tool_content(content)
        for key in ("name", "task"):
            if isinstance(msg.get(key), str):
                out[key] = msg[key]
        if role == "developer":
            out["tools"] = _developer_tools(msg.get("tools"))
        if out.get("tool_calls") == []:
            del out["tool_calls"]  # keeps templates on the plain assistant path
        conversation.append(out)
    return conversation, has_media


def _tool_calls(calls: Any) -> Any:
    """Tool calls with their JSON-string arguments parsed to objects, as templates expect them."""
    if not isinstance(calls, list):
        return calls
    out = []
    for call in calls:
        if not isinstance(call, dict):
            raise ChatTemplateError("assistant tool_calls entries must be objects.", param="tool_calls")
        fn = call.get("function")
        if call.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ChatTemplateError(
                "chat completions only support assistant tool_calls of type 'function'.", param="tool_calls"
            )
        function = _declared_first({**fn, "arguments": _arguments(fn.get("arguments"))}, ("arguments", "name"))
        out.append(_declared_first({**call, "function": function}, ("id", "function", "type")))
    return out


def _declared_first(obj: Mapping[str, Any], fields: tuple[str, ...]) -> dict[str, Any]:
    """Keys in the order vLLM's pydantic validation leaves them: declared fields, then the rest.
    Templates that dump a whole tool call with ``tojson`` show that order."""
    return {k: obj[k] for k in fields if k in obj} | {k: v for k, v in obj.items() if k not in fields}


def _developer_tools(tools: Any) -> Any:
    """A developer message's tools, keys in vLLM's order (see _declared_first)."""
    if not isinstance(tools, list):
        return tools
    out = []
    for tool in tools:
        if isinstance(tool, dict) and isinstance(tool.get("function"), dict):
            fn = _declared_first(tool["function"], ("name", "description", "parameters", "strict"))
            tool = _declared_first({**tool, "function": fn}, ("function", "type"))
        out.append(tool)
    return out


def _arguments(args: Any) -> dict[str, Any]:
    """vLLM parses with the standard json module (it accepts NaN, Infinity and any int size), and
    turns anything that is not an object into ``{}`` so that the conversation can go on."""
    if not args:
        return {}
    if isinstance(args, dict):
        return args
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return {}
    return args if isinstance(args, dict) else {}


def for_template(conversation: list[dict[str, Any]], template: str) -> list[dict[str, Any]]:
    """Developer messages become system messages when the template has no 'developer' role, and
    then every system message is merged into one at the top (some templates require that)."""
    if (
        not any(m["role"] == "developer" for m in conversation)
        or '"developer"' in template
        or ("'developer'" in template)
    ):
        return conversation
    converted = [
        {k: v for k, v in m.items() if k != "tools"} | {"role": "system"} if m["role"] == "developer" else m
        for m in conversation
    ]
    if all(i == 0 for i, m in enumerate(converted) if m["role"] == "system"):
        return converted
    texts = []
    for m in converted:
        if m["role"] != "system":
            continue
        content = m.get("content", "")
        if isinstance(content, list):
            content = "\n".join(
                p["text"] if isinstance(p, dict) else p
                for p in content
                if isinstance(p, str) or (isinstance(p, dict) and "text" in p)
            )
        if content:
            texts.append(content)
    return [{"role": "system", "content": "\n\n".join(texts)}] + [m for m in converted if m["role"] != "system"]


def normalize_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Tools as vLLM's pydantic models dump them (absent optional fields become None)."""
    if tools is None:
        return None
    out = []
    for tool in tools:
        fn = tool.get("function") or {}
        function = {"name": fn.get("name"), "description": fn.get("description"), "parameters": fn.get("parameters")}
        for opt in ("strict", "defer_loading"):
            if fn.get(opt) is not None:
                function[opt] = fn[opt]
        if tool.get("defer_loading") is not None and "defer_loading" not in function:
            function["defer_loading"] = tool["defer_loading"]
        entry: dict[str, Any] = {"type": tool.get("type", "function"), "function": function}
        if tool.get("defer_loading") is not None:
            entry["defer_loading"] = tool["defer_loading"]
        out.append(entry)
    return out
