"""What the chat tests share: requests parsed as the gateway parses them, a ModelTokenizer over
the test tokenizer, what it renders, and templates that show what they were handed."""

from __future__ import annotations

import orjson

from gateway.config import ModelConfig
from gateway.request.protocol import ParsedRequest, parse_body
from gateway.tokenization.tokenizer import ModelTokenizer

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


def make(hf, max_model_len: int = 4096, **cfg) -> ModelTokenizer:
    return ModelTokenizer(hf, ModelConfig(name="tiny", tokenizer="unused", max_model_len=max_model_len, **cfg))


def rendered(tok: ModelTokenizer, body: dict) -> str:
    return tok.backend.decode(tok.prompt_ids(req(body))[0], skip_special_tokens=False)


def user(content) -> list[dict]:
    return [{"role": "user", "content": content}]
