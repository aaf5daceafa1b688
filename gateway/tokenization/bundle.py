"""What a worker needs of a model's tokenizer, made by transformers in a short-lived child process.

transformers is the reference for how a model's prompt is tokenized (``reference.py``), but
importing it costs a worker ~30 MB and its tokenizer wrapper ~20 MB more, for the life of the
process: over a third of a worker beyond Python and the server. So a process that has not
imported transformers runs the reference load in a child (``python -m
gateway.tokenization.bundle``, the model's config on stdin) and gets back a ``Bundle``: the Rust
tokenizer exactly as transformers set it up (serialized), the chat templates, the special tokens,
and **probes**: conversations rendered and texts encoded by transformers. ``LeanTokenizer``
(``lean.py``) is built from the bundle and must reproduce every probe before it is used; where it
does not, the process loads transformers after all (``ModelTokenizer.load``). A process that
already imported transformers (a test, a tool) loads in place: the child would only cost time.
"""

from __future__ import annotations

import builtins
import json
import logging
import os
import subprocess
import sys
from typing import Any

from pydantic import BaseModel

from gateway.config import ModelConfig
from gateway.tokenization import frameworks, hub, reference

log = logging.getLogger(__name__)

CHILD_TIMEOUT_S = 600.0  # a hub download of a tokenizer's files included

_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
# Conversations every template is rendered with, by transformers and by the lean renderer.
PROBE_CHATS: tuple[dict[str, Any], ...] = (
    {"messages": [{"role": "user", "content": "Hello, world"}], "add_generation_prompt": True},
    {
        "messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "東京の天気は  <b>&amp;</b>"},
        ],
        "add_generation_prompt": True,
    },
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
    {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [_TOOL], "add_generation_prompt": True},
    {
        "messages": [{"role": "user", "content": "Tell a story"}, {"role": "assistant", "content": "Once upon "}],
        "continue_final_message": True,
    },
)
PROBE_TEXTS = ("Hello, world", "こんにちは、世界 🌍 مرحبا", "def f(x):\n\treturn x  # ok\n", "  spaced   out  ")


class ChatProbe(BaseModel):
    template: str | None  # the model's template by name (None: its only one)
    chat: int  # index into PROBE_CHATS
    text: str | None = None
    error: str | None = None  # the exception's class name, when transformers refused


class TextProbe(BaseModel):
    text: str
    add_special: bool
    ids: list[int]


class Bundle(BaseModel):
    """A model's tokenizer as transformers loaded it, and what it rendered and encoded."""

    tokenizer_json: str  # the Rust tokenizer, as transformers set it up
    chat_template: str | dict[str, str] | None
    special_tokens: dict[str, str]  # template variables: bos_token, eos_token, ...
    truncation_side: str
    max_chars_per_token: int
    renderer: str | None
    ranks_file: str | None
    chats: list[ChatProbe]
    texts: list[TextProbe]
    notes: list[tuple[int, str]] = []  # log records of the load, replayed where it is used


def of(ref: reference.Reference) -> Bundle:
    """The bundle of a loaded reference, probes included."""
    hf = ref.hf
    templates = hf.chat_template
    names: list[str | None] = list(templates) if isinstance(templates, dict) else [None] if templates else []
    chats = []
    for name in names:
        text = templates[name] if name is not None else templates
        for i, chat in enumerate(PROBE_CHATS):
            probe = ChatProbe(template=name, chat=i)
            try:
                probe.text = hf.apply_chat_template(
                    chat["messages"],
                    tools=chat.get("tools"),
                    chat_template=text,
                    tokenize=False,
                    add_generation_prompt=chat.get("add_generation_prompt", False),
                    continue_final_message=chat.get("continue_final_message", False),
                )
            except Exception as err:  # a template may refuse a probe (roles, tools): it must refuse alike
                probe.error = type(err).__name__
            chats.append(probe)
    backend = hf.backend_tokenizer
    texts = [
        TextProbe(text=t, add_special=s, ids=backend.encode(t, add_special_tokens=s).ids)
        for t in PROBE_TEXTS
        for s in (False, True)
    ]
    return Bundle(
        tokenizer_json=backend.to_str(),
        chat_template=templates,
        special_tokens=dict(hf.special_tokens_map),
        truncation_side=getattr(hf, "truncation_side", None) or "left",
        max_chars_per_token=max((len(t) for t in hf.get_vocab()), default=1),
        renderer=ref.renderer,
        ranks_file=ref.ranks_file,
        chats=chats,
        texts=texts,
    )


def make(cfg: ModelConfig) -> Bundle:
    """The model's bundle: loaded in place where transformers is already imported, else in a child."""
    if "transformers" in sys.modules:
        return of(reference.load(cfg))
    return _from_child(cfg)


def _from_child(cfg: ModelConfig) -> Bundle:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "gateway.tokenization.bundle"],
            input=cfg.model_dump_json().encode(),
            capture_output=True,
            timeout=CHILD_TIMEOUT_S,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"loading the tokenizer took longer than {CHILD_TIMEOUT_S:.0f} s") from None
    try:
        answer = json.loads(done.stdout)
    except ValueError:
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"exit status {done.returncode}"]
        raise RuntimeError(f"the tokenizer's loading process failed: {tail[0]}") from None
    if "error" in answer:
        raise _error(answer["error"])
    bundle = Bundle.model_validate(answer)
    for level, message in bundle.notes:
        log.log(level, "%s", message)
    return bundle


def _error(err: dict[str, str]) -> Exception:
    """The child's exception, as the same class where it is a built-in or one of ours."""
    kind, message = err.get("type", "RuntimeError"), err.get("message", "")
    ours = {"TokenizerUnavailable": hub.TokenizerUnavailable, "FrameworkNeeded": frameworks.FrameworkNeeded}
    cls = ours.get(kind) or getattr(builtins, kind, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(message)
        except TypeError:  # a built-in with another signature
            pass
    return RuntimeError(f"{kind}: {message}")


class _Notes(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith("gateway"):
            self.records.append((record.levelno, record.getMessage()))


def main() -> int:
    """The child: a ModelConfig on stdin, the bundle (or ``{"error": ...}``) on stdout."""
    notes = _Notes()
    logging.getLogger().addHandler(notes)
    logging.getLogger().setLevel(logging.INFO)
    try:
        cfg = ModelConfig.model_validate_json(sys.stdin.buffer.read())
        bundle = of(reference.load(cfg))
    except Exception as err:
        sys.stdout.write(json.dumps({"error": {"type": type(err).__name__, "message": str(err)}}))
        return 0
    bundle.notes = notes.records
    sys.stdout.write(bundle.model_dump_json())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
