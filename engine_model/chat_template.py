"""Chat templates as vLLM handles them: parsing one (with transformers' Jinja environment), the
variables it reads, whether it wants content parts or joined text (the content format), which
template a request renders with, and the reason to report when rendering fails.

This is the template side of :mod:`engine_model.chat`; the messages handed to the template are
:mod:`engine_model.chat_messages`, its kwargs :mod:`engine_model.chat_kwargs`. The rules mirror
vLLM 0.32's ``vllm/renderers/hf.py``. ``ChatTemplateError`` is here because every step of chat
rendering raises it, and the others build on this module.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache
from typing import Any, Literal

import jinja2
import jinja2.meta
import jinja2.nodes as nodes

from engine_model import chat_env

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
    try:
        ast: nodes.Template = chat_env.environment().parse(template)
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
