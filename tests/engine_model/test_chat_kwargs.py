"""The kwargs vLLM 0.32 hands apply_chat_template (engine_model.chat_kwargs): merge rules, the
server's flags, and tokenizer-call kwargs refused unless they repeat their defaults."""

from __future__ import annotations

import pytest

from engine_model import chat_kwargs
from gateway.http.errors import APIError
from tests.engine_model.chat_helpers import SHOW, SHOW_PARTS, make, rendered, req, user


def test_kwargs_tools_replace_the_request_tools(hf):
    tok = make(hf, chat_template=SHOW)
    body = {
        "messages": user("q"),
        "tools": [{"type": "function", "function": {"name": "from_request"}}],
        "chat_template_kwargs": {"tools": [{"name": "from_kwargs"}]},
    }
    assert rendered(tok, body) == '[user|q]<tools [{"name": "from_kwargs"}]>'


def test_template_kwargs_follow_vllm_merge_rules():
    template = "{{ enable_thinking }}{{ custom }}{{ from_server }}"
    body = {
        "chat_template_kwargs": {
            "custom": 1,
            "unknown_var": 2,
            "add_generation_prompt": False,
            "from_server": None,
            "tokenize": "auto",
        },
        "reasoning_effort": "none",
    }
    merged = chat_kwargs.merged_kwargs(body, None, {"from_server": "s", "tokenize": True})
    args = chat_kwargs.render_args(merged, template)
    # request fields override chat_template_kwargs, which override the server's defaults unless
    # null or "auto"; unknown variables are dropped; the server cannot make vLLM tokenize in the template
    assert args.kwargs == {
        "custom": 1,
        "add_generation_prompt": True,
        "continue_final_message": False,
        "enable_thinking": False,
        "from_server": "s",
        "return_dict": False,
    }
    assert args.tools is None
    # tokenizer-call kwargs never reach the template call, even from a template that names them
    server = {"tokenize": True, "padding": "max_length", "max_length": 10**7, "truncation": True}
    args = chat_kwargs.render_args(
        chat_kwargs.merged_kwargs({}, None, server), "{{ padding }}{{ max_length }}{{ tokenize }}"
    )
    assert chat_kwargs.TOKENIZER_CALL_KWARGS.isdisjoint(set(args.kwargs) - {"return_dict"})


def test_server_flags_are_mirrored(hf):
    """F10: --default-chat-template-kwargs, --exclude-tools-when-tool-choice-none,
    --chat-template-content-format, --trust-request-chat-template."""
    tools = [{"type": "function", "function": {"name": "f"}}]
    tok = make(
        hf,
        chat_template=SHOW + "{{ flavour }}",
        default_chat_template_kwargs={"flavour": "mild"},
        exclude_tools_when_tool_choice_none=True,
    )
    assert rendered(tok, {"messages": user("q")}) == "[user|q]mild"
    assert rendered(tok, {"messages": user("q"), "chat_template_kwargs": {"flavour": "hot"}}) == "[user|q]hot"
    assert rendered(tok, {"messages": user("q"), "tools": tools, "tool_choice": "none"}) == "[user|q]mild"
    assert "<tools" in rendered(tok, {"messages": user("q"), "tools": tools, "tool_choice": "auto"})

    parts = rendered(make(hf, chat_template=SHOW_PARTS), {"messages": user("q")})
    assert parts == '[user|[{"type": "text", "text": "q"}]]'
    forced = make(hf, chat_template=SHOW_PARTS, chat_template_content_format="string")
    assert rendered(forced, {"messages": user("q")}) == "[user|q]"

    untrusted = {"messages": user("q"), "chat_template": "{{ messages[0].content }}!"}
    with pytest.raises(APIError, match="trust-request-chat-template"):
        tok.prompt_ids(req(untrusted))
    with pytest.raises(APIError, match="trust-request-chat-template"):
        tok.prompt_ids(req({"messages": user("q"), "chat_template_kwargs": {"chat_template": "x"}}))
    assert rendered(make(hf, trust_request_chat_template=True), untrusted) == "q!"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"tokenize": True, "padding": "max_length", "max_length": 10_000_000},
        {"tokenize": True, "truncation": True, "max_length": 5},
        {"tokenize": True},
        {"padding": "longest"},
        {"tokenizer_kwargs": {"padding": "max_length"}},
        {"return_tensors": "np"},
    ],
    ids=["pad-10M", "truncate", "tokenize", "padding-alone", "tokenizer-kwargs", "tensors"],
)
def test_tokenizer_call_kwargs_are_refused(hf, kwargs):
    """vLLM forwards these to apply_chat_template, whose tokenizer then pads or truncates: 150 bytes
    padded to 10M ids (~1 GB). The gateway refuses them before any work, naming the parameter."""
    tok = make(hf)
    body = {"messages": user("hello there, how are you doing today?"), "chat_template_kwargs": kwargs}
    with pytest.raises(APIError) as err:
        tok.prompt_ids(req(body))
    assert err.value.status == 400 and err.value.param == "chat_template_kwargs"
    assert err.value.code == "invalid_chat_template_kwargs"
    assert "configure the tokenizer" in err.value.message
    assert tok.backend.truncation is None and tok.backend.padding is None  # the shared tokenizer is untouched


def test_tokenizer_call_kwargs_at_their_defaults_are_accepted(hf):
    tok = make(hf)
    body = {"messages": user("hello there, how are you doing today?")}
    full = tok.prompt_ids(req(body))[0]
    defaults = {"tokenize": False, "padding": False, "truncation": None, "max_length": None, "return_dict": "auto"}
    assert tok.prompt_ids(req(body | {"chat_template_kwargs": defaults}))[0] == full
    # truncation is the request's own field
    assert tok.prompt_ids(req(body | {"truncate_prompt_tokens": 5}))[0] == full[-5:]
