"""Token ids of a request's prompt, computed the way the engine computes them.

Loading uses transformers' AutoTokenizer (a local folder or a hub name). Tokenizing a long prompt
takes milliseconds, so it runs on a small thread pool (the Rust tokenizer releases the GIL) and
never on the event loop; prompts below ``inline_max_chars`` are cheaper to tokenize in place than
to hand to a thread (see the README's benchmark figures).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from . import chat
from .config import ModelConfig, TokenizerConfig
from .errors import bad_request
from .protocol import ParsedRequest, check_lengths

log = logging.getLogger(__name__)


class ModelTokenizer:
    """One model's tokenizer and chat template, with vLLM's prompt rules."""

    def __init__(self, hf_tokenizer: Any, cfg: ModelConfig) -> None:
        self.hf = hf_tokenizer
        # The Rust tokenizer underneath: encoding through it directly gives the same ids as the
        # transformers wrapper (which calls it) at well under half the cost per request.
        self.backend = hf_tokenizer.backend_tokenizer
        self.vocab_size = len(hf_tokenizer)  # added tokens included
        self.cfg = cfg
        self.default_template: str | None = None
        if cfg.chat_template:
            self.default_template = Path(cfg.chat_template).read_text(encoding="utf-8")
        elif isinstance(getattr(hf_tokenizer, "chat_template", None), str):
            self.default_template = hf_tokenizer.chat_template

    @classmethod
    def load(cls, cfg: ModelConfig) -> ModelTokenizer:
        from transformers import AutoTokenizer  # heavy import: only when a gateway starts

        hf = AutoTokenizer.from_pretrained(
            cfg.tokenizer, revision=cfg.tokenizer_revision, trust_remote_code=cfg.trust_remote_code
        )
        return cls(hf, cfg)

    # -- chat -------------------------------------------------------------------------------
    def chat_ids(self, body: dict[str, Any]) -> list[int]:
        if body.get("chat_template") is not None:
            # vLLM refuses request templates unless started with --trust-request-chat-template.
            raise bad_request(
                "Chat template is passed with request, but --trust-request-chat-template is not set. "
                "Refused request with untrusted chat template.",
                param="chat_template",
            )
        template = self.default_template
        if template is None:
            raise bad_request("This model has no chat template; use /v1/completions.", param="messages")
        fmt = chat.detect_content_format(template)
        conversation = chat.normalize_messages(body["messages"], fmt, template)
        try:
            kwargs = chat.template_kwargs(body, template)
            # vLLM asks for tokenize=True, which renders and then encodes without special tokens.
            text = self.hf.apply_chat_template(
                conversation,
                tools=chat.normalize_tools(body.get("tools")),
                chat_template=template,
                tokenize=False,
                **kwargs,
            )
        except chat.ChatTemplateError as err:
            raise bad_request(str(err), param="chat_template_kwargs") from None
        except Exception as err:  # templates raise to reject input (e.g. bad role order)
            raise bad_request(f"The chat template rejected the request: {err}", param="messages") from None
        return self.backend.encode(text, add_special_tokens=False).ids

    # -- completions ------------------------------------------------------------------------
    def completion_ids(self, prompt: str | list[int], add_special_tokens: bool) -> list[int]:
        if isinstance(prompt, str):
            return self.backend.encode(prompt, add_special_tokens=add_special_tokens).ids
        vocab = self.vocab_size
        bad = next((t for t in prompt if t >= vocab), None)
        if bad is not None:
            raise bad_request(f"Token id {bad} is out of vocabulary (size {vocab}).", param="prompt")
        return list(prompt)

    # -- both ---------------------------------------------------------------------------------
    def prompt_ids(self, req: ParsedRequest) -> list[list[int]]:
        """One token list per prompt (chat has one), truncated and length-checked as vLLM does."""
        body = req.body
        if req.kind == "chat":
            prompts = [self.chat_ids(body)]
        else:
            add_special = body.get("add_special_tokens", True)
            prompts = [self.completion_ids(p, add_special) for p in req.prompts]
        keep = body.get("truncate_prompt_tokens")
        if keep is not None:
            prompts = [self._truncate(ids, keep, body.get("truncation_side")) for ids in prompts]
        check_lengths(req, prompts, self.cfg.max_model_len)
        return prompts

    def _truncate(self, ids: list[int], keep: int, side: str | None) -> list[int]:
        if keep == -1:
            keep = self.cfg.max_model_len - 1
        if keep > self.cfg.max_model_len:
            raise bad_request(
                f"truncate_prompt_tokens={keep} cannot be greater than max_model_len = "
                f"{self.cfg.max_model_len}. Please request a smaller truncation size.",
                param="truncate_prompt_tokens",
            )
        if len(ids) <= keep:
            return ids
        side = side or getattr(self.hf, "truncation_side", "right")
        return ids[-keep:] if side == "left" else ids[:keep]


def _prompt_chars(req: ParsedRequest) -> int:
    if req.kind == "chat":
        total = 0
        for m in req.body["messages"]:
            content = m.get("content")
            if isinstance(content, str):
                total += len(content)
            elif isinstance(content, list):
                total += sum(len(p.get("text", "")) if isinstance(p, dict) else len(p) for p in content)
        return total + 64 * len(req.body.get("tools") or ())
    return sum(len(p) if isinstance(p, str) else 0 for p in req.prompts)


class Tokenizers:
    """All configured models' tokenizers plus the pool that runs them off the event loop."""

    def __init__(self, models: Sequence[ModelTokenizer], cfg: TokenizerConfig) -> None:
        self._by_name = {m.cfg.name: m for m in models}
        self._cfg = cfg
        self._pool = ThreadPoolExecutor(max_workers=cfg.workers, thread_name_prefix="tokenize")

    def get(self, model: str) -> ModelTokenizer | None:
        return self._by_name.get(model)

    async def prompt_ids(self, tok: ModelTokenizer, req: ParsedRequest) -> list[list[int]]:
        if _prompt_chars(req) <= self._cfg.inline_max_chars:
            return tok.prompt_ids(req)
        return await asyncio.get_running_loop().run_in_executor(self._pool, tok.prompt_ids, req)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
