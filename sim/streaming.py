"""vLLM's stream generators for the generation routes: one SSE event per output delta (deltas that
piled up while the client was slow are merged, as vLLM's output collector does), the chat role
chunk with the engine's first output, continuous usage, the final usage chunk and ``[DONE]``; a
failed engine request ends the stream with an error event.

The chunks are ``model_dump_json(exclude_unset=True)`` in vLLM, so each carries only the fields
vLLM sets, in its key order. The non-streaming bodies are :mod:`sim.responses`; the route that
calls :func:`stream` is :mod:`sim.generate`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine_model.seq import Collector, Seq
from sim.asgi import SSE_HEADERS, Send
from sim.errors import INTERNAL_ERROR
from sim.parsing import Job
from sim.responses import SSE_DONE, prompt_tokens_details, sse, usage_short
from sim.state import SimState, finish_record


async def stream(
    state: SimState,
    job: Job,
    collector: Collector,
    send: Send,
    rec: dict[str, Any],
    gone: Callable[[], bool],
) -> None:
    """Send ``job``'s stream until its engine requests finish, fail, or the client is ``gone``."""
    chat = job.endpoint == "chat"
    head = {
        "id": job.response_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": job.created,
        "model": job.model or state.cfg.model,
    }
    first_iteration = True
    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
    while True:
        await collector.event.wait()
        collector.event.clear()
        if gone():
            return
        out: list[bytes] = []
        failed = any(s.finish_reason == "error" for s in job.seqs)
        if chat and first_iteration and (failed or any(s.output_ids for s in job.seqs)):
            # The role chunk goes out with the engine's first output (even a failed one).
            first_iteration = False
            out.extend(_role_chunks(job, head))
        if failed:
            await _fail(state, job, send, rec, out)
            return
        for idx, seq in enumerate(job.seqs):
            chunk = _delta_chunk(job, idx, seq, head, state.fingerprint)
            if chunk is not None:
                out.append(sse(chunk))
        if collector.pending <= 0:
            if job.include_usage:
                out.append(sse(_usage_chunk(state, job, head)))
            out.append(SSE_DONE)
            finish_record(job, rec, "completed", 200)
            await send({"type": "http.response.body", "body": b"".join(out), "more_body": False})
            return
        if out:
            await send({"type": "http.response.body", "body": b"".join(out), "more_body": True})


def _role_chunks(job: Job, head: dict[str, Any]) -> list[bytes]:
    out = []
    for c in range(job.n):
        chunk: dict[str, Any] = {
            **head,
            "choices": [
                {
                    "index": c,
                    "delta": {"role": job.role, "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
        }
        if job.continuous_usage:
            p_len = len(job.prompts[0])
            chunk["usage"] = {
                "prompt_tokens": p_len,
                "total_tokens": p_len,
                "completion_tokens": 0,
                "completion_tokens_details": None,
            }
        chunk["prompt_token_ids"] = job.prompts[0] if job.return_token_ids else None
        chunk["prompt_text"] = None
        out.append(sse(chunk))
    return out


async def _fail(state: SimState, job: Job, send: Send, rec: dict[str, Any], out: list[bytes]) -> None:
    out.append(INTERNAL_ERROR.sse())
    out.append(SSE_DONE)
    finish_record(job, rec, "failed", 200)
    rec["error"] = "; ".join(s.error or "" for s in job.seqs if s.error)
    await send({"type": "http.response.body", "body": b"".join(out), "more_body": False})
    engine = state.engine
    assert engine is not None  # the route checked it, and it is never unset once started
    for s in job.seqs:
        engine.abort(s)


def _delta_chunk(job: Job, idx: int, seq: Seq, head: dict[str, Any], fp: str | None) -> dict[str, Any] | None:
    """The chunk for what ``seq`` produced since its last one (None: nothing new)."""
    if seq.final_sent:
        return None
    n_tok = len(seq.output_ids)
    finished = seq.finished
    if n_tok == seq.tokens_sent and not finished:
        return None
    text = seq.text() if finished else "".join(seq.pieces)
    delta = text[seq.text_len_sent :]
    new_ids = seq.output_ids[seq.tokens_sent :]
    first_chunk = seq.tokens_sent == 0
    seq.tokens_sent = n_tok
    seq.text_len_sent = max(len(text), seq.text_len_sent)
    seq.final_sent = finished
    chat = job.endpoint == "chat"
    if chat:
        choice = _chat_choice(job, idx, seq, delta, new_ids)
        p_len = len(job.prompts[0])
    else:
        p_idx = idx // job.n
        p_len = len(job.prompts[p_idx])
        choice = {
            "index": idx,
            "text": delta,
            "logprobs": None,
            "finish_reason": seq.finish_reason if finished else None,
            "stop_reason": seq.stop_reason if finished else None,
            "prompt_token_ids": job.prompts[p_idx] if (job.return_token_ids and first_chunk) else None,
            "token_ids": new_ids if job.return_token_ids else None,
        }
    chunk = {**head, "choices": [choice]}
    if job.continuous_usage:
        usage: dict[str, Any] = {
            "prompt_tokens": p_len,
            "total_tokens": p_len + n_tok,
            "completion_tokens": n_tok,
        }
        if chat:
            usage["completion_tokens_details"] = None
        chunk["usage"] = usage
    if finished and not job.include_usage and fp is not None:
        chunk["system_fingerprint"] = fp
    return chunk


def _chat_choice(job: Job, idx: int, seq: Seq, delta: str, new_ids: list[int]) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": idx, "delta": {"content": delta}, "logprobs": None}
    if seq.finished:
        choice["finish_reason"] = seq.finish_reason
        choice["stop_reason"] = seq.stop_reason
    else:
        choice["finish_reason"] = None
    choice["token_ids"] = new_ids if job.return_token_ids else None
    return choice


def _usage_chunk(state: SimState, job: Job, head: dict[str, Any]) -> dict[str, Any]:
    n_prompt = len(job.prompts[0]) if job.endpoint == "chat" else sum(len(p) for p in job.prompts)
    n_gen = sum(len(s.output_ids) for s in job.seqs)
    final_usage = usage_short(n_prompt, n_gen)
    if state.cfg.enable_prompt_tokens_details:
        final_usage["prompt_tokens_details"] = prompt_tokens_details(job, stream=True)
    return {**head, "choices": [], "usage": final_usage, "system_fingerprint": state.fingerprint}
