"""The gateway renders chat prompts the way vLLM does (the real-engine suite checks the counts)."""

from __future__ import annotations

import pytest

from gateway import chat
from gateway.config import ModelConfig
from gateway.errors import APIError
from gateway.protocol import parse_body
from gateway.tokenizer import ModelTokenizer

LOOPS_PARTS = "{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endfor %}"
ALIASED = ("{% set msgs = messages %}{% for m in msgs %}{% for p in m.content | list %}{{ p.text }}"
           "{% endfor %}{% endfor %}")
STRING = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


@pytest.mark.parametrize(("template", "fmt"), [(LOOPS_PARTS, "openai"), (ALIASED, "openai"), (STRING, "string"),
                                               ("{% broken", "string")])
def test_content_format_detection(template, fmt):
    assert chat.detect_content_format(template) == fmt


def test_string_format_joins_text_parts_and_drops_images():
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}},
                                         {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None}]
    conv = chat.normalize_messages(msgs, "string", STRING)
    assert conv == [{"role": "user", "content": "a\nb"}, {"role": "assistant", "content": ""}]


def test_openai_format_keeps_parts():
    conv = chat.normalize_messages([{"role": "user", "content": "hi"}], "openai", LOOPS_PARTS)
    assert conv == [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]


def test_tool_call_arguments_become_objects():
    msgs = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
        {"id": "2", "type": "function", "function": {"name": "g", "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "1", "content": [{"type": "text", "text": "r"}]}]
    conv = chat.normalize_messages(msgs, "openai", LOOPS_PARTS)
    assert [c["function"]["arguments"] for c in conv[0]["tool_calls"]] == [{"x": 1}, {}]
    assert conv[1] == {"role": "tool", "content": "r", "tool_call_id": "1"}
    assert msgs[0]["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'  # the request is not mutated


def test_developer_becomes_system_when_template_lacks_it():
    msgs = [{"role": "user", "content": "u"}, {"role": "developer", "content": "d"}]
    conv = chat.normalize_messages(msgs, "string", STRING)
    assert conv == [{"role": "system", "content": "d"}, {"role": "user", "content": "u"}]


def test_template_kwargs_follow_vllm_merge_rules():
    template = "{{ enable_thinking }}{{ custom }}"
    body = {"chat_template_kwargs": {"custom": 1, "unknown_var": 2, "add_generation_prompt": False},
            "reasoning_effort": "none"}
    kwargs = chat.template_kwargs(body, template)
    # request fields override chat_template_kwargs; unknown variables are dropped
    assert kwargs == {"custom": 1, "add_generation_prompt": True, "continue_final_message": False,
                      "enable_thinking": False}
    with pytest.raises(chat.ChatTemplateError):
        chat.template_kwargs({"chat_template_kwargs": {"tokenize": False}}, template)


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    return ModelTokenizer.load(ModelConfig(name="tiny", tokenizer=str(tokenizer_dir), max_model_len=64))


def test_chat_ids_match_transformers_rendering(tok):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    req = parse_body(b'{"model": "tiny", "messages": ' + __import__("orjson").dumps(messages) + b"}", "chat")
    ids = tok.prompt_ids(req)[0]
    text = tok.hf.apply_chat_template(
        [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in messages],
        tokenize=False, add_generation_prompt=True)
    assert ids == tok.hf.encode(text, add_special_tokens=False)
    assert text.endswith("<|assistant|>\n")


def test_prompt_length_and_truncation(tok):
    long = parse_body(b'{"model": "tiny", "prompt": "' + b"word " * 200 + b'"}', "completion")
    with pytest.raises(APIError) as info:
        tok.prompt_ids(long)
    assert info.value.code == "context_length_exceeded"
    cut = parse_body(b'{"model": "tiny", "truncate_prompt_tokens": 10, "truncation_side": "left", "prompt": "'
                     + b"word " * 200 + b'"}', "completion")
    full = tok.hf.encode("word " * 200)
    assert tok.prompt_ids(cut)[0] == full[-10:]


def test_request_chat_template_is_refused_like_vllm(tok):
    req = parse_body(b'{"model": "tiny", "chat_template": "{{ 1 }}", "messages": [{"role": "user", "content": "x"}]}',
                     "chat")
    with pytest.raises(APIError, match="trust-request-chat-template"):
        tok.prompt_ids(req)
