"""Mid-stream migration: what may continue on another decode engine, from where, and as what.

When a decode leg fails after its first token, the answer can go on elsewhere: the new request's
prompt is the original prompt's token ids plus the generated ids behind the text the client has,
as a ``/v1/completions`` request with the same sampling parameters and what is left of the output
budget. It is routed like any request, so a long context takes the P/D path and the new decode
engine pulls its KV over NIXL instead of computing it. Three things are decided here, without I/O:

- ``unmigratable``: requests whose continuation would not be the same answer (guided decoding,
  tool parsing, several sequences, logprobs, media in the prompt);
- ``resume_point``: how many generated ids the continuation keeps. The engine holds text back
  (an incomplete UTF-8 character; the tail that may start a stop string), so the ids received can
  run ahead of the text sent. The ids are replayed through the same incremental detokenizer vLLM
  0.32 uses (``tokenizers``' ``DecodeStream``, primed with the prompt) and the continuation starts
  at the last token boundary that is fully detokenized and within the text sent; what the client
  has beyond it (the *overlap*) the continuation reproduces first, and it is checked and dropped;
- ``continuation_body``: the request that continues it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from gateway.request.protocol import COMPLETION_DEFAULT_MAX_TOKENS, ParsedRequest

PRIME_TOKENS = 64  # prompt tokens a replay primes its detokenizer with (vLLM primes with the whole prompt)

# Structured output makes the engine constrain decoding with a grammar over the whole output; a
# continuation's grammar would start over at the cut.
_GUIDED = (
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
    "guided_whitespace_pattern",
    "json_schema",
    "regex",
    "grammar",
)

# Fields of the client's body a /v1/completions continuation does not take: chat-only fields (the
# prompt is already rendered), and those the continuation sets itself.
_NOT_CARRIED = frozenset(
    {
        "messages",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "response_format",
        "chat_template",
        "chat_template_kwargs",
        "add_generation_prompt",
        "continue_final_message",
        "documents",
        "mm_processor_kwargs",
        "media_io_kwargs",
        "reasoning_effort",
        "include_reasoning",
        "return_prompt_text",
        "logprobs",
        "top_logprobs",
        "max_completion_tokens",
        "prompt",
        "prompt_embeds",
        "suffix",
        "echo",
        "max_tokens",
        "min_tokens",
        "stream",
        "stream_options",
        "return_token_ids",
        "n",
        "best_of",
        "truncate_prompt_tokens",
        "truncation_side",
        "add_special_tokens",
        "prompt_logprobs",
        "kv_transfer_params",
        "ec_transfer_params",
    }
)


def unmigratable(req: ParsedRequest, approximate: str | None) -> str | None:
    """Why this request's answer cannot be continued on another engine (None: it can).

    ``approximate``: why the gateway's prompt ids may differ from the engine's (PromptIds); with
    media, the engine's own ids hold placeholders a text-only continuation cannot fill.
    """
    body = req.body
    if req.kind == "completion" and len(req.prompts) > 1:
        return "batch_prompts"
    if (body.get("n") or 1) > 1 or (body.get("best_of") or 1) > 1 or body.get("use_beam_search"):
        return "multiple_sequences"
    if body.get("echo"):
        return "echo"
    logprobs = body.get("logprobs")
    if (
        (logprobs if req.kind == "chat" else logprobs is not None)
        or body.get("top_logprobs") is not None
        or body.get("prompt_logprobs") is not None
    ):
        return "logprobs"
    fmt = body.get("response_format")
    if (isinstance(fmt, dict) and fmt.get("type") not in (None, "text")) or any(
        body.get(k) is not None for k in _GUIDED
    ):
        return "guided_decoding"
    if req.kind == "chat" and body.get("tools") and body.get("tool_choice") != "none":
        return "tools"
    if body.get("prompt_embeds") is not None:
        return "prompt_embeds"
    if approximate == "multimodal":
        return "multimodal"
    return None


def output_budget(req: ParsedRequest) -> int | None:
    """The output tokens the request asked for, as vLLM 0.32 reads them (None, chat only: the
    context's room). A completions request's absent or null ``max_tokens`` is 16
    (``CompletionRequest.normalize_null_max_tokens``)."""
    body = req.body
    if req.kind == "chat":
        value = body.get("max_completion_tokens")
        return value if value is not None else body.get("max_tokens")
    value = body.get("max_tokens")
    return COMPLETION_DEFAULT_MAX_TOKENS if value is None else int(value)


@dataclass(frozen=True, slots=True)
class ResumePoint:
    tokens: int  # generated ids the continuation's prompt keeps
    overlap: str  # text the client has beyond them, which the continuation reproduces first


def resume_point(
    tokenizer: Tokenizer,
    prompt: Sequence[int],
    generated: Sequence[int],
    sent_chars: int,
    sent_tail: str,
    *,
    skip_special_tokens: bool = True,
    spaces_between_special_tokens: bool = True,
    max_tokens: int | None = None,
) -> ResumePoint | None:
    """Where a continuation starts (None: nowhere the text sent can be trusted to join).

    ``sent_chars`` characters of text went to the client, ending with ``sent_tail``; ``max_tokens``
    caps the ids kept, so that the continuation generates at least one token.
    """
    texts = _replay(tokenizer, prompt, generated, skip_special_tokens, spaces_between_special_tokens)
    if texts is None:
        return None
    offsets, clean, text = texts
    if len(text) < sent_chars or (sent_tail and text[sent_chars - len(sent_tail) : sent_chars] != sent_tail):
        return None  # the client has text this replay does not produce: another tokenizer
    last = len(generated) if max_tokens is None else min(len(generated), max_tokens - 1)
    for i in range(last, -1, -1):
        if clean[i] and offsets[i] <= sent_chars:
            return ResumePoint(i, text[offsets[i] : sent_chars])
    return None


def _replay(
    tokenizer: Tokenizer, prompt: Sequence[int], generated: Sequence[int], skip_special: bool, spaces_between: bool
) -> tuple[list[int], list[bool], str] | None:
    """vLLM 0.32's FastIncrementalDetokenizer over ``generated``: the text after each token
    (``offsets[i]``: its length after i tokens), and whether everything up to there is decoded
    (``clean[i]``: no partial character or skipped token pending)."""
    stream = DecodeStream(ids=list(prompt[-PRIME_TOKENS:]), skip_special_tokens=skip_special)
    added: dict[int, str] = {}
    if not (skip_special or spaces_between):
        added = {tid: tok.content for tid, tok in tokenizer.get_added_tokens_decoder().items()}
    last_special = False
    offsets, clean, pieces, length = [0], [True], [], 0
    for tid in generated:
        try:
            piece = stream.step(tokenizer, tid)
        except Exception:  # an invalid prefix or id: vLLM resets its stream there, so no join is trusted
            return None
        flushed = piece is not None
        if added:
            special = added.get(tid)
            if special is not None and last_special:
                piece = special
            last_special = special is not None
        if piece:
            pieces.append(piece)
            length += len(piece)
        offsets.append(length)
        clean.append(flushed)
    return offsets, clean, "".join(pieces)


def continuation_body(
    req: ParsedRequest, prompt: Sequence[int], kept: int, *, max_model_len: int, continuous: bool
) -> dict[str, Any]:
    """The ``/v1/completions`` request that continues ``req`` after ``kept`` generated tokens:
    ``prompt`` (the original prompt's ids and those tokens), the same sampling parameters, the
    output budget less what is kept, streamed with its token ids."""
    body = {k: v for k, v in req.body.items() if k not in _NOT_CARRIED}
    budget = output_budget(req)
    body["prompt"] = list(prompt)
    # A chat request without a budget runs to the context's end; a completions request must say so
    # (its null means 16).
    body["max_tokens"] = max_model_len - len(prompt) if budget is None else budget - kept
    min_tokens = req.body.get("min_tokens") or 0
    if min_tokens > kept:
        body["min_tokens"] = min_tokens - kept
    body["stream"] = True
    body["stream_options"] = {"include_usage": True, "continuous_usage_stats": continuous}
    body["return_token_ids"] = True
    return body
