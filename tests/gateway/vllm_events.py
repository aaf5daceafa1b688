"""vLLM 0.32's stream events for given tokens, for tests of the gateway's reading of them.

The text of each event is what vLLM's detokenizer releases at that token: ``tokenizers``'
``DecodeStream`` primed with the prompt (vllm/v1/engine/detokenizer.py), less the last
``stop_buffer`` characters until the end (the tail that may start a stop string). The shapes are
those seen from a real vLLM 0.32 engine with ``return_token_ids`` (chat: the role chunk carries
``prompt_token_ids``; completions: the first token chunk does).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


def texts(tok: Tokenizer, prompt: Sequence[int], generated: Sequence[int], stop_buffer: int = 0) -> list[str]:
    """The text delta vLLM sends with each generated token."""
    stream = DecodeStream(ids=list(prompt), skip_special_tokens=True)
    out, sent, deltas = "", 0, []
    for i, tid in enumerate(generated):
        out += stream.step(tok, tid) or ""
        end = len(out) - (0 if i == len(generated) - 1 else stop_buffer)
        deltas.append(out[sent:end] if end > sent else "")
        sent = max(sent, end)
    return deltas


def full_text(tok: Tokenizer, prompt: Sequence[int], generated: Sequence[int]) -> str:
    return "".join(texts(tok, prompt, generated))


def events(
    tok: Tokenizer,
    prompt: Sequence[int],
    generated: Sequence[int],
    *,
    kind: str,
    rid: str = "r1",
    created: int = 1000,
    stop_buffer: int = 0,
    finish: str = "length",
    usage: bool = False,
    ids: bool = True,
) -> list[bytes]:
    """Each SSE event (``data: ...\\n\\n``) of the stream, ``[DONE]`` last."""
    chat = kind == "chat"
    head: dict[str, Any] = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": "tiny",
    }
    out: list[dict[str, Any]] = []
    if chat:
        out.append(
            {
                **head,
                "choices": [
                    {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                ],
                "prompt_token_ids": list(prompt) if ids else None,
                "prompt_text": None,
            }
        )
    deltas = texts(tok, prompt, generated, stop_buffer)
    for i, (tid, text) in enumerate(zip(generated, deltas, strict=True)):
        last = i == len(generated) - 1
        fr = finish if last else None
        if chat:
            choice: dict[str, Any] = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": fr}
            if last:
                choice["stop_reason"] = None
            choice["token_ids"] = [tid] if ids else None
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": fr,
                "stop_reason": None,
                "prompt_token_ids": list(prompt) if ids and i == 0 else None,
                "token_ids": [tid] if ids else None,
            }
        out.append({**head, "choices": [choice]})
    if usage:
        out.append(
            {
                **head,
                "choices": [],
                "usage": {
                    "prompt_tokens": len(prompt),
                    "total_tokens": len(prompt) + len(generated),
                    "completion_tokens": len(generated),
                },
                "system_fingerprint": "vllm-0.32.0-test",
            }
        )
    return [b"data: " + orjson.dumps(o) + b"\n\n" for o in out] + [b"data: [DONE]\n\n"]


def client_text(sent: bytes, kind: str) -> str:
    """The text a client reads from the SSE bytes it was sent."""
    text = ""
    for event in sent.split(b"\n\n"):
        if not event.startswith(b"data: {"):
            continue
        obj = orjson.loads(event[6:])
        for c in obj.get("choices") or []:
            text += (c["delta"].get("content") or "") if kind == "chat" else (c.get("text") or "")
    return text
