"""A chat request's messages as vLLM 0.32 hands them to the template (engine_model.chat_messages):
content parts, the billing header, tool calls, reasoning, developer messages, media parts; mostly
checked by decoding what the gateway rendered and counted."""

from __future__ import annotations

import pytest

from engine_model import chat_messages
from gateway.http.errors import APIError
from gateway.tokenization.tokenizer import PromptIds
from tests.engine_model.chat_helpers import SHOW, STRING, make, rendered, req, unchecked, user


def test_text_like_parts_are_text_and_null_text_is_skipped(hf):
    parts = [
        {"type": "input_text", "text": "a"},
        {"type": "output_text", "text": "b"},
        {"type": "refusal", "refusal": "c"},
        {"type": "thinking", "thinking": "d"},
        {"type": "text", "text": None},
        {"type": "text", "text": ""},
        "e",
    ]
    tok = make(hf, chat_template=SHOW)
    assert (
        tok.backend.decode(tok.prompt_ids(unchecked({"messages": user(parts)}))[0], skip_special_tokens=False)
        == "[user|a\nb\nc\nd\ne]"
    )
    conv, media = chat_messages.normalize_messages(user(parts), "openai")
    assert conv[0]["content"] == [{"type": "text", "text": t} for t in ("a", "b", "c", "d", "", "e")]
    assert not media


def test_openai_parts_keep_their_extra_fields():
    part = {"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}, "uuid": None}
    conv, _ = chat_messages.normalize_messages(user([part]), "openai")
    assert conv[0]["content"] == [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}]


def test_unknown_part_type_is_refused_like_vllm(tok):
    with pytest.raises(APIError, match="Unsupported chat content part type: 'banana'"):
        tok.prompt_ids(req({"messages": user([{"type": "banana"}])}))


def test_claude_code_billing_header_is_stripped_from_system_messages(hf):
    tok = make(hf, chat_template=SHOW)
    header = "x-anthropic-billing-header: cc_version=1; cch=abc"
    body = {
        "messages": [
            {"role": "system", "content": header + "\nYou help."},
            {"role": "system", "content": [{"type": "text", "text": header}, {"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": header + "\nkept for users"},
        ]
    }
    assert rendered(tok, body) == f"[system|You help.][system|Be brief.][user|{header}\nkept for users]"


def test_string_content_shortcut_equals_the_parts_path():
    """A string content takes a shortcut; it must give what the same text as one part gives."""
    header = chat_messages.BILLING_HEADER + ": cc_version=1"
    texts = ["", "hi", "\n", header, header + "\nrest", " " + header, "a\nb"]
    for role in ("system", "user", "assistant", "tool", "developer"):
        for text in texts:
            for fmt in ("string", "openai"):
                short = chat_messages.normalize_messages([{"role": role, "content": text}], fmt)
                parts = chat_messages.normalize_messages([{"role": role, "content": [text]}], fmt)
                assert short == parts, (role, text, fmt)


def test_empty_tool_calls_are_removed_and_task_is_copied(hf):
    tok = make(hf, chat_template=SHOW)
    body = {
        "messages": [
            {"role": "user", "content": "q", "task": "summarize", "name": "ann"},
            {"role": "assistant", "content": "a", "tool_calls": []},
        ]
    }
    assert rendered(tok, body) == '[user|q|name="ann"|task="summarize"][assistant|a]'


def test_tool_call_arguments_parse_like_the_json_module():
    calls = [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": a}}
        for a in ('{"x": NaN, "y": -Infinity, "n": 123456789012345678901234567890}', "[1, 2]", "not json", "", '"text"')
    ]
    msgs = [
        {"role": "assistant", "content": None, "tool_calls": calls},
        {
            "role": "tool",
            "tool_call_id": "1",
            "content": [{"type": "text", "text": "r"}, {"type": "text", "text": "s"}],
        },
    ]
    conv, _ = chat_messages.normalize_messages(msgs, "openai")
    args = [c["function"]["arguments"] for c in conv[0]["tool_calls"]]
    assert args[0]["n"] == 123456789012345678901234567890 and args[0]["x"] != args[0]["x"]  # NaN
    assert args[0]["y"] == float("-inf") and args[1:] == [{}, {}, {}, {}]
    assert list(conv[0]["tool_calls"][0]) == ["id", "function", "type"]  # vLLM's (pydantic's) key order
    assert conv[1] == {"role": "tool", "content": "r\ns", "tool_call_id": "1"}
    assert msgs[0]["tool_calls"][0]["function"]["arguments"].startswith('{"x"')  # the request is not mutated


@pytest.mark.parametrize(
    ("calls", "needle"),
    [(["x"], "entries must be objects"), ([{"type": "custom", "custom": {}}], "of type 'function'")],
)
def test_malformed_tool_calls_are_refused(tok, calls, needle):
    with pytest.raises(APIError, match=needle):
        tok.prompt_ids(req({"messages": [{"role": "assistant", "content": "a", "tool_calls": calls}]}))


def test_reasoning_content_is_read_as_reasoning(hf):
    body = {"messages": [{"role": "assistant", "content": "a", "reasoning_content": "because"}]}
    assert rendered(make(hf, chat_template=SHOW), body) == '[assistant|a|reasoning="because"]'


def test_developer_becomes_system_when_template_lacks_it():
    conv, _ = chat_messages.normalize_messages(
        [{"role": "user", "content": "u"}, {"role": "developer", "content": "d"}, {"role": "system", "content": "s"}],
        "string",
    )
    assert chat_messages.for_template(conv, STRING) == [
        {"role": "system", "content": "d\n\ns"},
        {"role": "user", "content": "u"},
    ]
    assert chat_messages.for_template(conv, STRING + "{# 'developer' #}") == conv


def test_media_parts_make_the_count_approximate(hf, tok):
    parts = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    ids = tok.prompt_ids(req({"messages": user(parts)}))
    assert isinstance(ids, PromptIds) and ids.approximate and ids.approximate_reason == "multimodal"
    assert ids[0] == tok.prompt_ids(req({"messages": user([parts[0]])}))[0]  # the text is still counted
    assert not tok.prompt_ids(req({"messages": user("look")})).approximate
    conv, media = chat_messages.normalize_messages(user(parts), "openai")
    assert media and conv[0]["content"][1] == {"type": "image"}
