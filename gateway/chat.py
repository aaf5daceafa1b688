"""Turn an OpenAI chat request into the exact token ids vLLM will see.

vLLM normalizes the messages (content parts, tool calls, developer role) and then calls the
tokenizer's ``apply_chat_template`` with ``tokenize=True``. The gateway repeats those steps so that
its token count, and later its block hashes, equal the engine's. The rules mirror vLLM 0.32's
renderer (``vllm/renderers/hf.py`` and ``chat_utils.py``); the real-engine test checks parity.
"""

from __future__ import annotations

import copy
from collections import deque
from functools import lru_cache
from typing import Any, Literal

import jinja2
import jinja2.meta
import jinja2.nodes as nodes
import orjson

ContentFormat = Literal["string", "openai"]

# Parameters of transformers' apply_chat_template that a request may set through
# chat_template_kwargs even when the template does not name them.
_HF_STANDARD_KWARGS = frozenset(
    {
        "tools", "documents", "add_generation_prompt", "continue_final_message", "sanitize_control_tokens",
        "padding", "truncation", "max_length", "return_tensors", "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
_FORBIDDEN_KWARGS = frozenset({"chat_template", "tokenize"})


class ChatTemplateError(ValueError):
    """The template (or the request's kwargs for it) rejected the conversation."""


def _env() -> jinja2.Environment:
    return jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])


def _loads_from(node: nodes.Node, names: set[str], key: str | None) -> bool:
    """Is ``node`` a read of one of ``names`` (or of ``name[key]`` / ``name.key``), maybe filtered?"""
    while isinstance(node, (nodes.Filter, nodes.Test)) or (
        isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)
    ):
        node = node.node
        if node is None:
            return False
    if key is None:
        return isinstance(node, nodes.Name) and node.name in names
    if isinstance(node, nodes.Getitem):
        inner, ok = node.node, isinstance(node.arg, nodes.Const) and node.arg.value == key
    elif isinstance(node, nodes.Getattr):
        inner, ok = node.node, node.attr == key
    else:
        return False
    return ok and isinstance(inner, nodes.Name) and inner.name in names


def _aliases(root: nodes.Template, name: str) -> set[str]:
    """``name`` plus every variable assigned from it (``{% set msgs = messages[1:] %}``)."""
    found, queue = {name}, deque([name])
    while queue:
        current = queue.popleft()
        for assign in root.find_all(nodes.Assign):
            target = assign.target
            if isinstance(target, nodes.Name) and target.name not in found and _loads_from(
                assign.node, {current}, None
            ):
                found.add(target.name)
                queue.append(target.name)
    return found


@lru_cache(maxsize=32)
def detect_content_format(template: str) -> ContentFormat:
    """'openai' when the template loops over a message's content parts, else 'string'.

    This is how vLLM decides whether text parts are joined into one string before rendering.
    """
    try:
        root = _env().parse(template)
    except jinja2.TemplateSyntaxError:
        return "string"
    messages = _aliases(root, "messages")
    loops = list(root.find_all(nodes.For))
    message_vars = {
        loop.target.name
        for loop in loops
        if isinstance(loop.target, nodes.Name) and _loads_from(loop.iter, messages, None)
    }
    in_macros = {id(loop) for macro in root.find_all(nodes.Macro) for loop in macro.find_all(nodes.For)}
    for loop in loops:
        if _loads_from(loop.iter, message_vars, "content"):
            return "openai"
        if id(loop) not in in_macros and isinstance(loop.iter, nodes.Name) and loop.iter.name == "content":
            return "openai"
    return "string"


@lru_cache(maxsize=32)
def template_variables(template: str) -> frozenset[str]:
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(_env().parse(template)))
    except jinja2.TemplateSyntaxError:
        return frozenset()


def _texts(content: Any) -> list[str]:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    out = []
    for part in content:
        if isinstance(part, str):
            out.append(part)
        elif part.get("type") == "text":
            out.append(part["text"])
    return out


def normalize_messages(messages: list[dict[str, Any]], fmt: ContentFormat, template: str) -> list[dict]:
    """The conversation as vLLM hands it to the template."""
    conversation: list[dict[str, Any]] = []
    for msg in messages:
        role = msg["role"]
        texts = _texts(msg.get("content"))
        if fmt == "openai":
            out: dict[str, Any] = {"role": role, "content": [{"type": "text", "text": t} for t in texts]}
        else:
            out = {"role": role, "content": "\n".join(texts)}
        if role == "assistant":
            if msg.get("tool_calls") is not None:
                out["tool_calls"] = _tool_calls(msg["tool_calls"])
            if msg.get("reasoning") is not None:
                out["reasoning"] = out["reasoning_content"] = msg["reasoning"]
        elif role == "tool":
            if "tool_call_id" in msg:
                out["tool_call_id"] = msg["tool_call_id"]
            if isinstance(out["content"], list):
                out["content"] = "\n".join(texts)
        if isinstance(msg.get("name"), str):
            out["name"] = msg["name"]
        if role == "developer":
            out["tools"] = msg.get("tools")
        conversation.append(out)
    if any(m["role"] == "developer" for m in conversation) and not (
        '"developer"' in template or "'developer'" in template
    ):
        conversation = _developer_to_system(conversation)
    return conversation


def _tool_calls(calls: Any) -> list[dict] | None:
    if not isinstance(calls, list):
        return calls
    calls = copy.deepcopy(calls)
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            continue
        args = fn.get("arguments")
        if not args:
            fn["arguments"] = {}
        elif isinstance(args, str):
            try:
                parsed = orjson.loads(args)
            except orjson.JSONDecodeError:
                parsed = {}
            fn["arguments"] = parsed if isinstance(parsed, dict) else {}
    return calls or None


def _developer_to_system(conversation: list[dict]) -> list[dict]:
    converted = []
    for m in conversation:
        if m["role"] == "developer":
            m = {k: v for k, v in m.items() if k != "tools"} | {"role": "system"}
        converted.append(m)
    systems = [i for i, m in enumerate(converted) if m["role"] == "system"]
    if not systems or systems == [0]:
        return converted
    merged = "\n\n".join(t for m in converted if m["role"] == "system" if (t := "\n".join(_texts(m["content"]))))
    return [{"role": "system", "content": merged}] + [m for m in converted if m["role"] != "system"]


def normalize_tools(tools: list[dict] | None) -> list[dict] | None:
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


def template_kwargs(body: dict[str, Any], template: str) -> dict[str, Any]:
    """The keyword arguments vLLM passes to apply_chat_template for this request."""
    user = body.get("chat_template_kwargs") or {}
    bad = _FORBIDDEN_KWARGS & user.keys()
    if bad:
        raise ChatTemplateError(f"Found unexpected chat template kwargs from request: {sorted(bad)}")
    kwargs: dict[str, Any] = dict(user)
    reasoning_effort = body.get("reasoning_effort")
    extra = {
        "add_generation_prompt": body.get("add_generation_prompt", True),
        "continue_final_message": body.get("continue_final_message", False),
        "documents": body.get("documents"),
        "reasoning_effort": reasoning_effort,
    }
    if reasoning_effort is not None and "enable_thinking" not in user:
        extra["enable_thinking"] = reasoning_effort != "none"
    # vLLM merges the request's own fields over chat_template_kwargs, skipping unset ones.
    kwargs.update({k: v for k, v in extra.items() if v is not None and v != "auto"})
    accepted = template_variables(template) | _HF_STANDARD_KWARGS
    return {k: v for k, v in kwargs.items() if k in accepted}
