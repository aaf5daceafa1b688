"""Token ids of a request's prompt, computed the way the engine computes them.

Loading mirrors vLLM's: transformers' AutoTokenizer (a local folder or a hub name) with
``truncation_side="left"``, as vLLM loads tokenizers for generative models (``reference.py``), run in
a child process so that workers never import transformers (``bundle.py``, ``lean.py``). Chat prompts follow
``engine_model.chat``'s rules, are rendered to text and encoded by the Rust tokenizer directly (the same
ids as the transformers wrapper, at well under half the cost). Truncation and length checks follow
vLLM's ``TokenizeParams`` (``vllm/renderers/params.py``).

Tokenizing a long prompt takes milliseconds, so ``Tokenizers`` runs it on a small thread pool (the
Rust tokenizer releases the GIL) and never on the event loop; request bodies of at most
``inline_max_bytes`` (4 KiB) are cheaper to tokenize in place than to hand to a thread: the hop costs
the worker ~250 us of CPU in GIL hand-offs, more than tokenizing 2 KB, and most of the work (the chat
template, the segment cache, fasttok) holds the GIL anyway.

A conversation comes back with one more turn: ``SegmentEncoder`` reuses the ids of the text between
the tokenizer's added tokens (one segment per message in chat formats with special header tokens),
so only the new turn's text is tokenized again, with ids provably equal to encoding the whole text;
when the previous turn's text starts the new one, its ids are taken whole up to one of its added
tokens, so the long shared part is not even split and looked up again.
Where ``fasttok`` proves tiktoken's encoder equivalent for a byte-level BPE, that text is encoded by
it (several times faster than the Rust tokenizer); for Meta's Llama 3, whose tokenizer.json that
proof refuses, tiktoken runs on the vocabulary's ranks (Meta's ``original/tokenizer.model`` when it is
there and identical, else read off ``tokenizer.json``), checked at load and sampled at run time, and
the exact tokenizer decides near the context limit. Text in any script qualifies (fasttok compares
the regex engines on every code point).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from engine_model import chat
from gateway.config import ModelConfig, TokenizerConfig
from gateway.http.errors import APIError, bad_request
from gateway.request.protocol import ParsedRequest, check_lengths
from gateway.tokenization import bundle, heap, reference
from gateway.tokenization.lean import LeanTokenizer
from gateway.tokenization.segments import SegmentEncoder

T = TypeVar("T")

log = logging.getLogger(__name__)

# Renderers that still tokenize with the model's Hugging Face tokenizer: only chat counts differ.
_HF_TOKENIZER_RENDERERS = frozenset({"harmony", "kimi_k3", "cohere", "inkling"})
EMPTY_PROMPT = "The decoder prompt cannot be empty"
# A prompt counted by a checked (not proven) fast encoder this close to the context limit is
# re-encoded exactly before the length check: 1% of max_model_len, at least 64 tokens.
NEAR_LIMIT_SHARE = 0.01
NEAR_LIMIT_MIN = 64


class PromptIds(list[list[int]]):
    """One token-id list per prompt (chat has one), as returned by ``prompt_ids``.

    ``approximate`` is True when the engine's count will differ from ``len(ids)``: media parts
    (the engine expands them into placeholder tokens the gateway cannot count) or a model vLLM
    renders with its own code; ``approximate_reason`` says which. The ids are still the text's.
    """

    def __init__(self, prompts: Iterable[list[int]], approximate_reason: str | None = None) -> None:
        super().__init__(prompts)
        self.approximate_reason = approximate_reason

    @property
    def approximate(self) -> bool:
        return self.approximate_reason is not None


@dataclass(frozen=True, slots=True)
class _Truncation:
    """A request's truncate_prompt_tokens, resolved as vLLM resolves it."""

    keep: int | None  # tokens to keep; None: no truncation
    side: str | None  # the side the request asked for; None: the tokenizer's (left)


def load_template(value: str | None) -> str | None:
    """A template as vLLM's --chat-template takes it: a file's text, else the value itself when it
    looks like a template (has braces or a newline)."""
    if value is None:
        return None
    try:
        return Path(value).read_text(encoding="utf-8")
    except (OSError, ValueError) as err:
        if any(c in value for c in "{}\n"):
            return value
        raise ValueError(f"chat_template {value!r} looks like a file path, but it cannot be read: {err}") from None


class ModelTokenizer:
    """One model's tokenizer and chat template, with vLLM's prompt rules."""

    def __init__(
        self,
        hf_tokenizer: Any,
        cfg: ModelConfig,
        renderer: str | None = None,
        *,
        reuse_tokens: int = 1 << 20,
        fast: bool = True,
        ranks_file: str | os.PathLike[str] | None = None,
    ) -> None:
        """``reuse_tokens``: token ids of recent text segments kept for reuse, and as many again of
        recent whole texts (0: none; about 40 bytes each, plus the texts); ``fast``: encode with
        ``fasttok`` where proven exact, or checked from ``ranks_file`` (the model's tiktoken
        ranks, see ``find_ranks_file``). See ``SegmentEncoder``."""
        self.hf = hf_tokenizer
        self.cfg = cfg
        self._reuse_tokens = reuse_tokens
        self._fast = fast
        self._ranks_file = ranks_file
        # The Rust tokenizer underneath. A tokenizer.json may carry truncation or padding settings
        # that the transformers wrapper switches off on every call; encoding directly, do the same.
        backend = hf_tokenizer.backend_tokenizer
        if backend.truncation is not None:
            backend.no_truncation()
        if backend.padding is not None:
            backend.no_padding()
        self.backend = backend  # and the segment encoder around it (see the setter)
        self.server_template = load_template(cfg.chat_template)
        self.default_side: str = getattr(hf_tokenizer, "truncation_side", None) or "left"
        # vLLM refuses text longer than max_model_len x the longest vocabulary entry before it
        # tokenizes; this is the same bound, so the gateway refuses exactly that text.
        self.max_chars_per_token = max((len(t) for t in hf_tokenizer.get_vocab()), default=1)
        self.renderer = renderer
        self.kwargs_limits = chat.KwargsLimits(
            cfg.chat_template_kwargs_max_keys, cfg.chat_template_kwargs_max_depth, cfg.chat_template_kwargs_max_bytes
        )
        if not self.segments.enabled and reuse_tokens > 0:
            log.info("model %s: token ids are not reused across requests (%s)", cfg.name, self.segments.reason)
        if renderer is not None:
            log.warning(
                "model %s: vLLM renders its chat prompts with its own %r renderer; the gateway's "
                "chat token counts for it are approximate",
                cfg.name,
                renderer,
            )

    @property
    def backend(self) -> Any:
        """The Rust tokenizer that encodes the text."""
        return self._backend

    @backend.setter
    def backend(self, value: Any) -> None:
        # Every encode goes through the segment encoder: it must wrap whatever backend is set.
        self._backend = value
        self.segments = SegmentEncoder(
            value, self._reuse_tokens, fast=self._fast, ranks_file=self._ranks_file, model=self.cfg.name
        )

    @classmethod
    def load(cls, cfg: ModelConfig) -> ModelTokenizer:
        """The model's tokenizer as vLLM loads it (transformers), kept as a ``LeanTokenizer`` when
        that reproduces every probe transformers rendered and encoded (``bundle.py``), else as
        transformers' own (a warning says why)."""
        made = bundle.make(cfg)
        tok: Any = LeanTokenizer(made)
        problem = tok.differs(made)
        if problem is not None:
            log.warning("model %s: %s; this process loads transformers to tokenize it", cfg.name, problem)
            tok = reference.load(cfg).hf
        loaded = cls(tok, cfg, made.renderer, ranks_file=made.ranks_file)
        del made, tok
        heap.trim()  # the load's freed C memory back to the system (~200 MB for Llama 3)
        return loaded

    # -- both ---------------------------------------------------------------------------------
    def prompt_ids(self, req: ParsedRequest) -> PromptIds:
        """One token list per prompt, truncated and length-checked as vLLM does (see PromptIds)."""
        body = req.body
        trunc = self._truncation(req)
        near = self._near_limit(body)
        reason = None
        if req.kind == "chat":
            rendered, media = self._render_chat(body)
            add_special = bool(body.get("add_special_tokens") or False)
            prompts = [self._text_ids(rendered, add_special, trunc, near)]
            reason = "multimodal" if media else self.renderer
        else:
            add_special = body.get("add_special_tokens") is not False
            prompts = [
                self._text_ids(p, add_special, trunc, near) if isinstance(p, str) else self._truncate(list(p), trunc)
                for p in req.prompts
            ]
            if self.renderer not in _HF_TOKENIZER_RENDERERS:
                reason = self.renderer  # vLLM tokenizes with that mode's own tokenizer
        if reason in (None, "multimodal"):
            # A model-specific renderer may count more or fewer tokens than this: let its engine judge.
            check_lengths(req, prompts, self.cfg.max_model_len)
        if reason is None and not all(prompts):
            raise bad_request(EMPTY_PROMPT)
        return PromptIds(prompts, reason)

    # -- chat ---------------------------------------------------------------------------------
    def _render_chat(self, body: dict[str, Any]) -> tuple[str, bool]:
        """The rendered prompt text, and whether the messages have media parts. The template call
        never tokenizes: the tokenizer is shared by the tokenizing threads and only ever encodes
        text (``chat.check_template_kwargs`` refuses kwargs that would configure it)."""
        cfg = self.cfg
        try:
            chat.check_template_kwargs(body.get("chat_template_kwargs"), self.kwargs_limits)
        except chat.ChatTemplateError as err:
            raise bad_request(str(err), param=err.param, code="invalid_chat_template_kwargs") from None
        self._refuse_untrusted_template(body)
        tools = body.get("tools")
        if tools is not None and body.get("tool_choice") == "none" and cfg.exclude_tools_when_tool_choice_none:
            tools = None
        merged = chat.merged_kwargs(body, chat.normalize_tools(tools), cfg.default_chat_template_kwargs)
        given = body.get("chat_template") or self.server_template or merged.get("chat_template")
        try:
            template = chat.select_template(given, self.hf.chat_template, merged.get("tools"))
            fmt = cfg.chat_template_content_format
            if fmt == "auto":
                fmt = chat.detect_content_format(template)
            conversation, media = chat.normalize_messages(body["messages"], fmt)
            conversation = chat.for_template(conversation, template)
            args = chat.render_args(merged, template)
            text: str = self.hf.apply_chat_template(
                conversation, tools=args.tools, chat_template=template, tokenize=False, **args.kwargs
            )
        except chat.ChatTemplateError as err:
            raise bad_request(str(err), param=err.param) from None
        except Exception as err:  # templates raise to reject input (e.g. bad role order); vLLM answers 400
            raise bad_request(chat.template_error_reason(err)) from None
        return text, media

    def _refuse_untrusted_template(self, body: dict[str, Any]) -> None:
        kwargs = body.get("chat_template_kwargs") or {}
        if not self.cfg.trust_request_chat_template and (
            body.get("chat_template") is not None or kwargs.get("chat_template") is not None
        ):
            raise bad_request(
                "Chat template is passed with request, but --trust-request-chat-template is not set. "
                "Refused request with untrusted chat template.",
                param="chat_template",
            )

    # -- truncation and length ----------------------------------------------------------------
    def _truncation(self, req: ParsedRequest) -> _Truncation:
        body, max_len = req.body, self.cfg.max_model_len
        keep = body.get("truncate_prompt_tokens")
        if keep is None:
            return _Truncation(None, None)
        if keep > max_len:
            raise bad_request(
                f"truncate_prompt_tokens={keep} cannot be greater than max_model_len = {max_len}. "
                "Please request a smaller truncation size.",
                param="truncate_prompt_tokens",
            )
        if keep < 0:  # -1: as much as fits, leaving room for one output token when any is asked for
            keep = max_len - 1 if _max_output(req) else max_len
        return _Truncation(keep, body.get("truncation_side"))

    def _near_limit(self, body: dict[str, Any]) -> int:
        """Token count from which a checked (not proven) fast count is redone exactly: within
        ``NEAR_LIMIT_SHARE`` of max_model_len (at least ``NEAR_LIMIT_MIN`` tokens) of where
        ``check_lengths`` refuses, counting the room min_tokens needs."""
        limit = self.cfg.max_model_len
        margin = max(NEAR_LIMIT_MIN, int(limit * NEAR_LIMIT_SHARE))
        return limit - margin - max(body.get("min_tokens") or 0, 1)

    def _encode(self, text: str, add_special: bool, near: int) -> list[int]:
        """The segment encoder's ids; the exact tokenizer's when they came from a checked fast
        encoder and reach ``near``: whether vLLM refuses the prompt is decided by exact counts."""
        checked = self.segments.fast_checked  # before: a run-time mismatch may turn it off meanwhile
        ids = self.segments.encode(text, add_special)
        if checked and len(ids) >= near:
            exact: list[int] = self.backend.encode(text, add_special_tokens=add_special).ids
            return exact
        return ids

    def _text_ids(self, text: str, add_special: bool, trunc: _Truncation, near: int) -> list[int]:
        if trunc.keep == 0:
            return []  # vLLM cuts whatever the tokenizer returned down to nothing
        limit = self.cfg.max_model_len * self.max_chars_per_token
        if len(text) > limit and self.renderer is None:  # another tokenizer may have another bound
            if trunc.keep is None:
                raise APIError(
                    400,
                    f"This model's maximum context length is {self.cfg.max_model_len} tokens. However, your "
                    f"prompt contains {len(text)} characters (more than {limit} characters, which is the upper "
                    f"bound for {self.cfg.max_model_len} input tokens). Please reduce the length of the input "
                    "prompt.",
                    param="input_text",
                    code="context_length_exceeded",
                )
            if trunc.side == "left":
                text = text[-limit:]
            elif trunc.side == "right":
                text = text[:limit]
        if trunc.keep is None or trunc.side is not None:
            return self._truncate(self._encode(text, add_special, near), trunc)
        # vLLM has the tokenizer truncate: the special tokens stay, the text is cut on its side.
        enc = self.backend.encode(text, add_special_tokens=False)
        specials = self.backend.num_special_tokens_to_add(False) if add_special else 0
        enc.truncate(max(trunc.keep - specials, 0), direction=self.default_side)
        return self._truncate(self.backend.post_process(enc, add_special_tokens=add_special).ids, trunc)

    def _truncate(self, ids: list[int], trunc: _Truncation) -> list[int]:
        keep = trunc.keep
        if keep is None or len(ids) <= keep:
            return ids
        if keep == 0:
            return []
        return ids[-keep:] if (trunc.side or self.default_side) == "left" else ids[:keep]


def _max_output(req: ParsedRequest) -> int:
    """The output budget vLLM's TokenizeParams sees (completions default max_tokens to 16)."""
    body = req.body
    if req.kind == "chat":
        value = body.get("max_completion_tokens")
        if value is None:
            value = body.get("max_tokens")
    else:
        value = body.get("max_tokens")
        if value is None:
            value = 16
    return value or 0


class Tokenizers:
    """All configured models' tokenizers plus the pool that runs them off the event loop."""

    def __init__(self, models: Sequence[ModelTokenizer], cfg: TokenizerConfig) -> None:
        self._by_name = {m.cfg.name: m for m in models}
        self._cfg = cfg
        self._pool = ThreadPoolExecutor(max_workers=cfg.workers, thread_name_prefix="tokenize")

    def get(self, model: str) -> ModelTokenizer | None:
        return self._by_name.get(model)

    async def prompt_ids(self, tok: ModelTokenizer, req: ParsedRequest) -> PromptIds:
        """``tok.prompt_ids(req)``, inline for small bodies, else on the pool.

        The body's size bounds the work: it counts everything that gets rendered or tokenized
        (text, token-id lists, tools, documents), unlike any count of prompt characters.
        """
        if req.raw_size <= self._cfg.inline_max_bytes:
            return tok.prompt_ids(req)
        return await asyncio.get_running_loop().run_in_executor(self._pool, tok.prompt_ids, req)

    async def run(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """``fn`` on the tokenizer threads: other work with a tokenizer (replaying a migrated
        answer's output) stays off the event loop too."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def close(self, *, cancel: bool = True) -> None:
        self._pool.shutdown(wait=False, cancel_futures=cancel)
