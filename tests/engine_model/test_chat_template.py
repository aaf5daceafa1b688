"""Chat templates as vLLM 0.32 handles them (engine_model.chat_template): content-format detection,
the variables a template reads, which template a request renders with, and the reason a failed
rendering reports."""

from __future__ import annotations

import copy

import pytest

from engine_model import chat_template
from gateway.http.errors import APIError
from tests.engine_model.chat_helpers import STRING, make, rendered, req, user

LOOPS_PARTS = "{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endfor %}"


ALIASED = (
    "{% set msgs = messages %}{% for m in msgs %}{% for p in m.content | list %}{{ p.text }}{% endfor %}{% endfor %}"
)


QWEN_VL = """{%- macro render_content(content, do_vision_count) -%}
{%- if content is string %}{{ content }}{%- else %}{%- for item in content %}{{ item.text }}{%- endfor %}{%- endif %}
{%- endmacro -%}
{%- for message in messages %}{{ render_content(message.content, true) }}{%- endfor %}"""


MACRO_KWARG = (
    "{% macro show(x, body) %}{% for i in body %}{{ i.text }}{% endfor %}{% endmacro %}"
    "{% for m in messages %}{{ show(1, body=m['content']) }}{% endfor %}"
)


MACRO_OTHER = (
    "{% macro show(items) %}{% for i in items %}{{ i }}{% endfor %}{% endmacro %}"
    "{% for m in messages %}{{ show(m.role) }}{{ m.content }}{% endfor %}"
)


GENERATION = (
    "{% for m in messages %}{% generation %}{% for p in m.content %}{{ p.text }}{% endfor %}"
    "{% endgeneration %}{% endfor %}{{ enable_thinking }}"
)


@pytest.mark.parametrize(
    ("template", "fmt"),
    [
        (LOOPS_PARTS, "openai"),
        (ALIASED, "openai"),
        (STRING, "string"),
        ("{% broken", "string"),
        (QWEN_VL, "openai"),
        (MACRO_KWARG, "openai"),
        (MACRO_OTHER, "string"),
        (GENERATION, "openai"),
        ("{% for a, b in messages %}{% endfor %}", "string"),  # vLLM's detector gives up on tuple targets
    ],
    ids=[
        "parts",
        "aliased",
        "string",
        "broken",
        "qwen-vl-macro",
        "macro-kwarg",
        "macro-other-param",
        "generation-tag",
        "tuple-target",
    ],
)
def test_content_format_detection(template, fmt):
    assert chat_template.detect_content_format(template) == fmt


def test_generation_tag_keeps_template_variables(hf):
    """F2: transformers' own Jinja environment parses {% generation %}; the template's variables (and
    so custom kwargs like enable_thinking) survive, and the content format is detected."""
    assert "enable_thinking" in chat_template.template_variables(GENERATION)
    tok = make(hf, chat_template=GENERATION)
    body = {"messages": user("hi"), "chat_template_kwargs": {"enable_thinking": "yes", "nope": 1}}
    assert rendered(tok, body) == "hiyes"


def test_named_templates_are_chosen_by_tools(hf):
    named = copy.deepcopy(hf)
    named.chat_template = {"default": "plain:{{ messages[0].content }}", "tool_use": "tools:{{ messages[0].content }}"}
    tok = make(named)
    assert rendered(tok, {"messages": user("q")}) == "plain:q"
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert rendered(tok, {"messages": user("q"), "tools": tools}) == "tools:q"
    assert rendered(make(named, chat_template="{{ 'own' }}"), {"messages": user("q")}) == "own"


def test_chat_template_may_be_a_path_or_the_template(hf, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("file:{{ messages[0].content }}")
    assert rendered(make(hf, chat_template=str(path)), {"messages": user("q")}) == "file:q"
    assert rendered(make(hf, chat_template="lit:{{ messages[0].content }}"), {"messages": user("q")}) == "lit:q"
    with pytest.raises(ValueError, match="looks like a file path"):
        make(hf, chat_template=str(tmp_path / "missing.jinja"))


def test_template_rejection_gives_the_template_reason(hf):
    tok = make(hf, chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(APIError, match=r"^roles must alternate$"):
        tok.prompt_ids(req({"messages": user("q")}))


def test_no_template_is_refused_like_vllm(hf):
    bare = copy.deepcopy(hf)
    bare.chat_template = None
    with pytest.raises(APIError, match="default chat template is no longer allowed"):
        make(bare).prompt_ids(req({"messages": user("q")}))
