"""The gateway renders and counts prompts the way vLLM 0.32 does (the real-engine suite checks the
counts against a real engine; these tests pin each rule, mostly by decoding what was counted)."""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import shutil
import threading
from pathlib import Path

import orjson
import pytest

from engine_model import chat
from gateway.config import ModelConfig, TokenizerConfig
from gateway.http.errors import APIError
from gateway.request.protocol import ParsedRequest, parse_body
from gateway.tokenization.tokenizer import ModelTokenizer, PromptIds, Tokenizers, detect_renderer

LOOPS_PARTS = "{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endfor %}"
ALIASED = (
    "{% set msgs = messages %}{% for m in msgs %}{% for p in m.content | list %}{{ p.text }}{% endfor %}{% endfor %}"
)
STRING = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
# Shows what the template receives: role, content (string or parts as JSON) and extra fields.
SHOW = (
    "{% for m in messages %}[{{ m.role }}|{{ m.content if m.content is string else m.content | tojson }}"
    "{% for k in ['name', 'task', 'tool_calls', 'tool_call_id', 'reasoning'] %}{% if k in m %}|{{ k }}="
    "{{ m[k] | tojson }}{% endif %}{% endfor %}]{% endfor %}{% if tools %}<tools {{ tools | tojson }}>{% endif %}"
)
SHOW_PARTS = SHOW.replace("{% for m in messages %}", "{% for m in messages %}{% for p in m.content %}{% endfor %}")


def req(body: dict, kind: str = "chat"):
    return parse_body(orjson.dumps({"model": "tiny", **body}), kind)


def unchecked(body: dict) -> ParsedRequest:
    """A chat request the way vLLM accepts it, past checks protocol.py may still make."""
    return ParsedRequest(kind="chat", body=body, model="tiny", stream=False, raw_size=len(orjson.dumps(body)))


@pytest.fixture(scope="module")
def hf(tokenizer_dir):
    return ModelTokenizer.load(ModelConfig(name="tiny", tokenizer=str(tokenizer_dir), max_model_len=64)).hf


def make(hf, max_model_len: int = 4096, **cfg) -> ModelTokenizer:
    return ModelTokenizer(hf, ModelConfig(name="tiny", tokenizer="unused", max_model_len=max_model_len, **cfg))


def rendered(tok: ModelTokenizer, body: dict) -> str:
    return tok.hf.decode(tok.prompt_ids(req(body))[0])


def user(content) -> list[dict]:
    return [{"role": "user", "content": content}]


@pytest.fixture(scope="module")
def tok(hf):
    return make(hf, max_model_len=64)


# -- content format (F1, F2) ---------------------------------------------------------------------

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
    assert chat.detect_content_format(template) == fmt


def test_generation_tag_keeps_template_variables(hf):
    """F2: transformers' own Jinja environment parses {% generation %}; the template's variables (and
    so custom kwargs like enable_thinking) survive, and the content format is detected."""
    assert "enable_thinking" in chat.template_variables(GENERATION)
    tok = make(hf, chat_template=GENERATION)
    body = {"messages": user("hi"), "chat_template_kwargs": {"enable_thinking": "yes", "nope": 1}}
    assert rendered(tok, body) == "hiyes"


# -- content parts (F4, F7) ----------------------------------------------------------------------


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
    assert tok.hf.decode(tok.prompt_ids(unchecked({"messages": user(parts)}))[0]) == "[user|a\nb\nc\nd\ne]"
    conv, media = chat.normalize_messages(user(parts), "openai")
    assert conv[0]["content"] == [{"type": "text", "text": t} for t in ("a", "b", "c", "d", "", "e")]
    assert not media


def test_openai_parts_keep_their_extra_fields():
    part = {"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}, "uuid": None}
    conv, _ = chat.normalize_messages(user([part]), "openai")
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
    header = chat.BILLING_HEADER + ": cc_version=1"
    texts = ["", "hi", "\n", header, header + "\nrest", " " + header, "a\nb"]
    for role in ("system", "user", "assistant", "tool", "developer"):
        for text in texts:
            for fmt in ("string", "openai"):
                short = chat.normalize_messages([{"role": role, "content": text}], fmt)
                parts = chat.normalize_messages([{"role": role, "content": [text]}], fmt)
                assert short == parts, (role, text, fmt)


# -- message fields (F6, F8, F11) -----------------------------------------------------------------


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
    conv, _ = chat.normalize_messages(msgs, "openai")
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
    conv, _ = chat.normalize_messages(
        [{"role": "user", "content": "u"}, {"role": "developer", "content": "d"}, {"role": "system", "content": "s"}],
        "string",
    )
    assert chat.for_template(conv, STRING) == [
        {"role": "system", "content": "d\n\ns"},
        {"role": "user", "content": "u"},
    ]
    assert chat.for_template(conv, STRING + "{# 'developer' #}") == conv


# -- kwargs (F5, F10) -----------------------------------------------------------------------------


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
    merged = chat.merged_kwargs(body, None, {"from_server": "s", "tokenize": True})
    args = chat.render_args(merged, template)
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
    args = chat.render_args(chat.merged_kwargs({}, None, server), "{{ padding }}{{ max_length }}{{ tokenize }}")
    assert chat.TOKENIZER_CALL_KWARGS.isdisjoint(set(args.kwargs) - {"return_dict"})


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


# -- templates (F9) -------------------------------------------------------------------------------


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


def test_chat_ids_match_transformers_rendering(tok):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    ids = tok.prompt_ids(req({"messages": messages}))[0]
    text = tok.hf.apply_chat_template(
        [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in messages],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert ids == tok.hf.encode(text, add_special_tokens=False)
    assert text.endswith("<|assistant|>\n")


# -- tokenizing kwargs (F3, issue 27) ---------------------------------------------------------------


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


# -- media and model-specific renderers (F12) -----------------------------------------------------


def test_media_parts_make_the_count_approximate(hf, tok):
    parts = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    ids = tok.prompt_ids(req({"messages": user(parts)}))
    assert isinstance(ids, PromptIds) and ids.approximate and ids.approximate_reason == "multimodal"
    assert ids[0] == tok.prompt_ids(req({"messages": user([parts[0]])}))[0]  # the text is still counted
    assert not tok.prompt_ids(req({"messages": user("look")})).approximate
    conv, media = chat.normalize_messages(user(parts), "openai")
    assert media and conv[0]["content"][1] == {"type": "image"}


@pytest.mark.parametrize(
    ("config", "mode", "renderer"),
    [
        ({"architectures": ["DeepseekV32ForCausalLM"]}, "auto", "deepseek_v32"),
        ({"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"]}, "auto", "harmony"),
        ({"architectures": ["LlamaForCausalLM"]}, "cohere", "cohere"),
        ({"architectures": ["LlamaForCausalLM"]}, "auto", None),
    ],
)
def test_model_specific_renderers_are_detected(tokenizer_dir, tmp_path, caplog, config, mode, renderer):
    folder = tmp_path / "model"
    shutil.copytree(tokenizer_dir, folder)
    (folder / "config.json").write_text(json.dumps(config))
    cfg = ModelConfig(name="m", tokenizer=str(folder), max_model_len=64, tokenizer_mode=mode)
    assert detect_renderer(cfg) == renderer
    with caplog.at_level(logging.WARNING, logger="gateway.tokenization.tokenizer"):
        tok = ModelTokenizer.load(cfg)
    assert tok.prompt_ids(req({"messages": user("hi")})).approximate_reason == renderer
    assert ("approximate" in caplog.text) == (renderer is not None)


# -- truncation and lengths (F13, F14, P7) ----------------------------------------------------------


@pytest.fixture(scope="module")
def bos_dir(tokenizer_dir, tmp_path_factory):
    """The test tokenizer with a post-processor that adds BOS and EOS, like many models'."""
    from tokenizers import Tokenizer, processors

    folder = tmp_path_factory.mktemp("bos")
    shutil.copytree(tokenizer_dir, folder, dirs_exist_ok=True)
    rust = Tokenizer.from_file(str(folder / "tokenizer.json"))
    rust.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)])
    rust.save(str(folder / "tokenizer.json"))
    return folder


TEXT = "one two three four five six seven eight nine ten"


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("keep", [1, 2, 5])
def test_truncation_keeps_special_tokens_like_the_tokenizer(bos_dir, side, keep):
    """Without truncation_side vLLM has the tokenizer truncate (the text is cut, BOS/EOS stay); with
    it, vLLM slices the encoded prompt."""
    from transformers import AutoTokenizer

    tok = ModelTokenizer.load(ModelConfig(name="b", tokenizer=str(bos_dir), max_model_len=64))
    ref = AutoTokenizer.from_pretrained(str(bos_dir), truncation_side="left")
    full = ref(TEXT)["input_ids"]
    want = ref(TEXT, truncation=True, max_length=keep)["input_ids"]
    want = want[-keep:]  # vLLM's own slice after the tokenizer's (left, its default side)
    assert tok.prompt_ids(req({"prompt": TEXT, "truncate_prompt_tokens": keep}, "completion"))[0] == want
    sliced = full[-keep:] if side == "left" else full[:keep]
    got = tok.prompt_ids(req({"prompt": TEXT, "truncate_prompt_tokens": keep, "truncation_side": side}, "completion"))
    assert got[0] == sliced


def test_add_special_tokens_is_honoured_for_chat(bos_dir):
    tok = ModelTokenizer.load(ModelConfig(name="b", tokenizer=str(bos_dir), max_model_len=64))
    plain = tok.prompt_ids(req({"messages": user("hi")}))[0]
    assert tok.prompt_ids(req({"messages": user("hi"), "add_special_tokens": True}))[0] == [1, *plain, 2]


def test_truncate_prompt_tokens_edge_values(hf):
    tok = make(hf, max_model_len=32)
    long = {"prompt": "word " * 100}
    with pytest.raises(APIError, match="decoder prompt cannot be empty"):
        tok.prompt_ids(req(long | {"truncate_prompt_tokens": 0, "truncation_side": "left"}, "completion"))
    # -1: the whole context, less one token when the request asks for output (completions default to 16)
    assert len(tok.prompt_ids(req(long | {"truncate_prompt_tokens": -1}, "completion"))[0]) == 31
    chat_long = {"messages": user("word " * 100), "truncate_prompt_tokens": -1}
    assert len(tok.prompt_ids(req(chat_long | {"max_tokens": 4}))[0]) == 31
    with pytest.raises(APIError, match="max_tokens must be at least 1"):  # 32 tokens leave no room
        tok.prompt_ids(req(chat_long))
    with pytest.raises(APIError, match="cannot be greater than max_model_len = 32"):
        tok.prompt_ids(req(long | {"truncate_prompt_tokens": 33}, "completion"))


def test_prompt_length_and_truncation(tok):
    long = req({"prompt": "word " * 200}, "completion")
    with pytest.raises(APIError) as info:
        tok.prompt_ids(long)
    assert info.value.code == "context_length_exceeded"
    cut = req({"truncate_prompt_tokens": 10, "truncation_side": "left", "prompt": "word " * 200}, "completion")
    assert tok.prompt_ids(cut)[0] == tok.hf.encode("word " * 200)[-10:]


def test_token_ids_are_not_checked_against_the_vocabulary(tok):
    """F14: the engine knows the model's (possibly padded) vocabulary; the gateway does not."""
    assert tok.prompt_ids(req({"prompt": [1, 2, len(tok.hf) + 100]}, "completion"))[0] == [1, 2, len(tok.hf) + 100]


def test_text_too_long_for_any_tokenization_is_refused_before_tokenizing(hf):
    tok = make(hf, max_model_len=8)
    assert tok.max_chars_per_token == max(len(t) for t in hf.get_vocab())
    limit = 8 * tok.max_chars_per_token
    calls = []
    tok.backend = _CountingBackend(tok.backend, calls)
    with pytest.raises(APIError, match=f"contains {limit + 1} characters \\(more than {limit} characters"):
        tok.prompt_ids(req({"prompt": "x" * (limit + 1)}, "completion"))
    assert calls == []  # refused without tokenizing
    # with truncation vLLM cuts the text first instead
    ids = tok.prompt_ids(
        req({"prompt": "x" * (limit * 3), "truncate_prompt_tokens": 4, "truncation_side": "left"}, "completion")
    )
    assert len(ids[0]) == 4 and calls == [limit]


class _CountingBackend:
    def __init__(self, inner, calls: list[int]) -> None:
        self._inner, self._calls = inner, calls

    def encode(self, text: str, add_special_tokens: bool = True):
        self._calls.append(len(text))
        return self._inner.encode(text, add_special_tokens=add_special_tokens)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


# -- event loop safety (P5, P6) ---------------------------------------------------------------------


class _ThreadRecorder(ModelTokenizer):
    def __init__(self, inner: ModelTokenizer) -> None:
        self.__dict__.update(inner.__dict__)
        self.threads: list[int] = []

    def prompt_ids(self, req):
        self.threads.append(threading.get_ident())
        return super().prompt_ids(req)


async def test_large_bodies_are_tokenized_on_a_worker_thread(tok):
    recorder = _ThreadRecorder(tok)
    toks = Tokenizers([recorder], TokenizerConfig(inline_max_bytes=256))
    try:
        loop_thread = threading.get_ident()
        small = req({"prompt": "hi"}, "completion")
        # token ids count 0 characters but still cost work: the body's size decides
        large = req({"prompt": [1000] * 60}, "completion")
        assert small.raw_size <= 256 < large.raw_size
        for r in (small, large):
            await toks.prompt_ids(recorder, r)
        assert recorder.threads[0] == loop_thread
        assert loop_thread not in recorder.threads[1:]
    finally:
        toks.close()


def test_inline_limit_config_is_in_bytes():
    assert TokenizerConfig().inline_max_bytes == 256
    assert "inline_max_chars" not in TokenizerConfig.model_fields


def test_tokenizers_run_concurrently_without_sharing_state(tok):
    """The pool's threads share one Rust tokenizer: it is used read-only (truncation cuts each call's own
    encoding; no call configures the tokenizer, issue 27)."""

    async def main():
        toks = Tokenizers([tok], TokenizerConfig(inline_max_bytes=0, workers=2))
        try:
            bodies = [
                {"messages": user("word " * 20), "truncate_prompt_tokens": 3},
                {"messages": user("word " * 20)},
            ] * 10
            return await asyncio.gather(*(toks.prompt_ids(tok, req(b)) for b in bodies))
        finally:
            toks.close()

    results = asyncio.run(main())
    assert {len(r[0]) for r in results[::2]} == {3}
    assert len({len(r[0]) for r in results[1::2]}) == 1 and len(results[1][0]) > 3


def test_template_rejection_gives_the_template_reason(hf):
    tok = make(hf, chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(APIError, match=r"^roles must alternate$"):
        tok.prompt_ids(req({"messages": user("q")}))


def test_no_template_is_refused_like_vllm(hf):
    bare = copy.deepcopy(hf)
    bare.chat_template = None
    with pytest.raises(APIError, match="default chat template is no longer allowed"):
        make(bare).prompt_ids(req({"messages": user("q")}))


def test_renderer_warning_is_silent_for_plain_models(tokenizer_dir):
    assert detect_renderer(ModelConfig(name="m", tokenizer=str(Path(tokenizer_dir)), max_model_len=8)) is None


def test_tokenizer_json_truncation_and_padding_settings_are_ignored(tokenizer_dir, tmp_path):
    """transformers switches a tokenizer.json's own truncation/padding off on every call (and so
    does vLLM's tokenizing); the gateway, encoding with the Rust tokenizer directly, must too."""
    from tokenizers import Tokenizer

    folder = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, folder)
    rust = Tokenizer.from_file(str(folder / "tokenizer.json"))
    rust.enable_truncation(max_length=3)
    rust.enable_padding(length=50, pad_id=3, pad_token="<pad>")
    rust.save(str(folder / "tokenizer.json"))
    tok = ModelTokenizer.load(ModelConfig(name="t", tokenizer=str(folder), max_model_len=64))
    assert tok.prompt_ids(req({"prompt": TEXT}, "completion"))[0] == tok.hf(TEXT)["input_ids"]
    assert 3 < len(tok.hf(TEXT)["input_ids"]) < 50
