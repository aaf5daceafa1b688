"""gateway/tokenization/templates.py renders chat templates as transformers does: one suite of
templates and conversations, each rendered by transformers (the reference) and by the lean renderer,
which must give the same text or refuse with the same kind of error."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.config import ModelConfig
from gateway.tokenization import bundle, reference, templates
from gateway.tokenization.lean import LeanTokenizer

LLAMA3ISH = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
TOOLS = (
    "{% if tools %}{% for t in tools %}{{ t | tojson(indent=2) }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
)
USER = [{"role": "user", "content": 'Hi <b>&amp;</b> 東京 "q"'}]
CHAT = [
    {"role": "system", "content": "sys"},
    {"role": "user", "content": "a"},
    {"role": "assistant", "content": "b  "},
    {"role": "user", "content": "c"},
]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
CASES: list[tuple[str, str, list[dict[str, Any]], dict[str, Any]]] = [
    ("llama3-like", LLAMA3ISH, CHAT, {"add_generation_prompt": True}),
    ("no generation prompt", LLAMA3ISH, CHAT, {}),
    ("tojson keeps HTML and non-ASCII", "{{ messages | tojson }}", USER, {}),
    ("tojson options", "{{ messages[0] | tojson(indent=1, sort_keys=true) }}", USER, {}),
    ("tools", TOOLS, USER, {"tools": [TOOL]}),
    (
        "documents",
        "{% for d in documents %}[{{ d.title }}]{% endfor %}{{ messages[0].content }}",
        USER,
        {"documents": [{"title": "t", "text": "x"}]},
    ),
    (
        "raise_exception",
        "{% if messages[0].role != 'system' %}{{ raise_exception('system first') }}{% endif %}",
        USER,
        {},
    ),
    ("strftime_now", "{{ strftime_now('%Y') }}|{{ messages[0].role }}", USER, {}),
    (
        "loop controls",
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{{ m.content }}{% endfor %}",
        CHAT,
        {},
    ),
    (
        "generation block",
        "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}",
        CHAT,
        {},
    ),
    ("trim and lstrip blocks", "  {% for m in messages %}\n  {{ m.content }}\n  {% endfor %}\n", CHAT, {}),
    (
        "kwargs and special tokens",
        "{{ bos_token }}{{ eos_token }}{{ flavour }}{{ messages[0].content }}",
        USER,
        {"flavour": "hot", "eos_token": "<over>"},
    ),
    ("sandbox refuses mutation", "{% set _ = messages.append(1) %}x", USER, {}),
    ("sandbox refuses internals", "{{ messages.__class__.__mro__ }}", USER, {}),
    ("undefined is empty", "{{ nothing }}|{{ messages[0].nope }}|", USER, {}),
    (
        "continue final message",
        LLAMA3ISH,
        [*USER, {"role": "assistant", "content": "Once upon "}],
        {"continue_final_message": True},
    ),
    (
        "continue a trimmed message",
        "{% for m in messages %}{{ m.content | trim }}|{% endfor %}",
        [*USER, {"role": "assistant", "content": "Once upon   "}],
        {"continue_final_message": True},
    ),
    (
        "continue a list of parts",
        "{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}",
        [{"role": "assistant", "content": [{"type": "text", "text": "abc"}]}],
        {"continue_final_message": True},
    ),
    (
        "continue a deleted message",
        "x",
        [*USER, {"role": "assistant", "content": "gone"}],
        {"continue_final_message": True},
    ),
    (
        "continue with a generation prompt",
        LLAMA3ISH,
        USER,
        {"continue_final_message": True, "add_generation_prompt": True},
    ),
    ("empty conversation", LLAMA3ISH, [], {}),
    ("syntax error", "{% for m in messages %}", USER, {}),
]


@pytest.fixture(scope="module")
def both(tokenizer_dir) -> tuple[Any, LeanTokenizer]:
    ref = reference.load(ModelConfig(name="tiny", tokenizer=str(tokenizer_dir), max_model_len=64))
    return ref.hf, LeanTokenizer(bundle.of(ref))


def _outcome(tok: Any, template: str, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> tuple[str, str]:
    try:
        return "text", tok.apply_chat_template(messages, chat_template=template, tokenize=False, **kwargs)
    except Exception as err:
        return "error", type(err).__name__


@pytest.mark.parametrize(("case", "template", "messages", "kwargs"), CASES, ids=[c[0] for c in CASES])
def test_lean_renders_as_transformers(both, case, template, messages, kwargs) -> None:
    hf, lean = both
    expected = _outcome(hf, template, messages, kwargs)
    assert _outcome(lean, template, messages, kwargs) == expected
    if case.startswith(("sandbox", "raise", "continue a deleted", "continue with", "empty", "syntax")):
        assert expected[0] == "error", expected  # the suite exercises refusals, not only texts


@pytest.mark.parametrize(
    ("given", "tools", "expected"),
    [(None, None, "D"), (None, [TOOL], "T"), ("tool_use", None, "T"), ("{{ 'own' }}", None, "own")],
)
def test_named_templates_are_selected_as_transformers_selects_them(both, given, tools, expected) -> None:
    named = {"default": "D", "tool_use": "T"}
    for tok in both:
        saved = tok.chat_template
        tok.chat_template = named
        try:
            text = tok.apply_chat_template(USER, tools=tools, chat_template=given, tokenize=False)
        finally:
            tok.chat_template = saved
        assert text == expected


def test_without_a_default_template_both_refuse() -> None:
    with pytest.raises(ValueError, match="multiple chat templates with no default"):
        templates.select({"a": "x"}, None, None)
    with pytest.raises(ValueError, match="chat_template is not set"):
        templates.select(None, None, None)


def test_compiled_templates_are_bounded() -> None:
    renderer = templates.TemplateRenderer()
    for i in range(100):  # trusted request templates, each new
        assert renderer.render(f"{i}{{{{ messages[0].content }}}}", USER[:1]).startswith(str(i))
    assert len(renderer._compiled) <= 16
