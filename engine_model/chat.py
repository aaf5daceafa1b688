"""Turn an OpenAI chat request into the conversation, template and kwargs vLLM renders.

vLLM normalizes the messages (content parts, tool calls, developer role), picks a chat template,
merges the template kwargs from several sources and calls the tokenizer's ``apply_chat_template``.
The gateway repeats those steps so that its token count, and later its block hashes, equal the
engine's. The rules mirror vLLM 0.32's renderer (``vllm/renderers/hf.py``, ``chat_utils.py``,
``params.py`` and ``online_renderer.py``); the real-engine suite checks the counts end to end.
Everything here is pure: ``gateway.tokenization.tokenizer`` owns the tokenizer and does the rendering.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

import jinja2
import jinja2.meta
import jinja2.nodes as nodes

ContentFormat = Literal["string", "openai"]


class ChatTemplateError(ValueError):
    """vLLM would refuse this conversation (bad parts, tool calls or template); the text is its reason."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


# -- parsing templates --------------------------------------------------------------------------


def _parse(template: str) -> nodes.Template | None:
    """The template's AST, parsed by the Jinja environment transformers renders with.

    That environment knows transformers' own tags (``{% generation %}``) and loop controls; a plain
    environment fails on them, which would lose the content format and the template variables.
    """
    from transformers.utils.chat_template_utils import _compile_jinja_template  # what vLLM uses too

    try:
        # (transformers leaves _compile_jinja_template unannotated: the AST's type is said here)
        ast: nodes.Template = _compile_jinja_template(template).environment.parse(template)
    except Exception:  # a broken template: vLLM falls back to defaults, rendering then reports it
        return None
    return ast


@lru_cache(maxsize=32)
def template_variables(template: str) -> frozenset[str]:
    """Variables the template reads but does not set: the kwargs it can be given."""
    root = _parse(template)
    return frozenset(jinja2.meta.find_undeclared_variables(root)) if root is not None else frozenset()


# -- content format detection (vllm/renderers/hf.py) -------------------------------------------


class _GiveUp(Exception):
    """A construct vLLM's detector cannot follow (a tuple target): it then assumes 'string'."""


def _unwrap(node: nodes.Node) -> nodes.Node | None:
    """Strip filters, tests and slices: ``messages[1:] | list`` still reads ``messages``."""
    while True:
        if isinstance(node, nodes.Filter):
            if node.node is None:
                return None
            node = node.node
        elif isinstance(node, nodes.Test) or (isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)):
            node = node.node
        else:
            return node


def _is_load(node: nodes.Node, names: Iterable[str]) -> bool:
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name in names


def _reads(node: nodes.Node, names: set[str], key: str | None = None) -> bool:
    """Is ``node`` (maybe filtered) a read of one of ``names``, or of ``name[key]`` / ``name.key``?"""
    inner = _unwrap(node)
    if inner is None:
        return False
    if key is None:
        return _is_load(inner, names)
    if isinstance(inner, nodes.Getitem):
        return isinstance(inner.arg, nodes.Const) and inner.arg.value == key and _is_load(inner.node, names)
    if isinstance(inner, nodes.Getattr):
        return inner.attr == key and _is_load(inner.node, names)
    return False


def _target(node: nodes.Node) -> str:
    if not isinstance(node, nodes.Name):
        raise _GiveUp
    return node.name


def _message_variables(root: nodes.Template) -> set[str]:
    """Names a single message is bound to: ``for m in messages`` (or any alias of ``messages``)."""
    lists, pending = {"messages"}, ["messages"]
    while pending:
        current = pending.pop()
        for assign in root.find_all(nodes.Assign):
            if _reads(assign.node, {current}):
                name = _target(assign.target)
                if name not in lists:
                    lists.add(name)
                    pending.append(name)
    return {_target(loop.target) for loop in root.find_all(nodes.For) if _reads(loop.iter, lists)}


def _macro_content_params(root: nodes.Template, message_vars: set[str]) -> tuple[set[int], dict[int, set[str]]]:
    """Loops inside macros, and for each the macro parameters that receive ``message.content``
    (Qwen3-VL / Qwen3.5 pass the content to ``render_content(content, ...)`` and loop there)."""
    in_macros: set[int] = set()
    params_by_loop: dict[int, set[str]] = {}
    for macro in root.find_all(nodes.Macro):
        arg_names = [arg.name for arg in macro.args]
        params: set[str] = set()
        for call in root.find_all(nodes.Call):
            if not (isinstance(call.node, nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args[: len(arg_names)]):
                if _reads(arg, message_vars, "content"):
                    params.add(arg_names[i])
            for kw in call.kwargs:
                if kw.key in arg_names and _reads(kw.value, message_vars, "content"):
                    params.add(kw.key)
        for loop in macro.find_all(nodes.For):
            in_macros.add(id(loop))
            if params:
                params_by_loop[id(loop)] = params
    return in_macros, params_by_loop


def _loops_over_content(root: nodes.Template) -> bool:
    message_vars = _message_variables(root)
    in_macros, params_by_loop = _macro_content_params(root, message_vars)
    for loop in root.find_all(nodes.For):
        it = loop.iter
        bare = it.name if isinstance(it, nodes.Name) else None
        if (
            _reads(it, message_vars, "content")
            or (bare is not None and bare in params_by_loop.get(id(loop), ()))
            or (bare == "content" and id(loop) not in in_macros)
        ):
            _target(loop.target)
            return True
    return False


@lru_cache(maxsize=32)
def detect_content_format(template: str) -> ContentFormat:
    """'openai' when the template loops over a message's content parts, else 'string'.

    This is how vLLM decides whether text parts are joined into one string before rendering.
    """
    root = _parse(template)
    if root is None:
        return "string"
    try:
        return "openai" if _loops_over_content(root) else "string"
    except _GiveUp:
        return "string"


# -- template selection (vllm/renderers/hf.py resolve_chat_template) ---------------------------

NO_TEMPLATE = (
    "As of transformers v4.44, default chat template is no longer allowed, so you must provide a chat "
    "template if the tokenizer does not define one."
)


def select_template(given: str | None, tokenizer_template: str | dict[str, str] | None, tools: Any) -> str:
    """The template text vLLM renders with.

    ``given`` (the request's trusted template, else the server's) wins; it may name one of the
    tokenizer's templates. Otherwise a tokenizer with named templates uses ``tool_use`` when tools are
    given and ``default`` otherwise. (vLLM would also try a multimodal processor's template and its
    built-in fallbacks; the gateway does not load those.)
    """
    named = tokenizer_template if isinstance(tokenizer_template, dict) else None
    if given is not None:
        return named[given] if named is not None and given in named else given
    if named is not None:
        if tools is not None and "tool_use" in named:
            return named["tool_use"]
        if "default" in named:
            return named["default"]
        raise ChatTemplateError(NO_TEMPLATE)
    if isinstance(tokenizer_template, str):
        return tokenizer_template
    raise ChatTemplateError(NO_TEMPLATE)


# -- messages (vllm/renderers/chat_utils.py) ----------------------------------------------------

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


# -- template kwargs (params.py ChatParams, online_renderer.py preprocess_chat) --------------------

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


def template_error_reason(err: BaseException) -> str:
    """The most specific reason in a template failure: the first Jinja error in its chain (that is
    where templates raise to reject input, e.g. an unsupported reasoning_effort)."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, jinja2.TemplateError):
            return str(current)
        current = current.__cause__ or current.__context__
    return str(err)
