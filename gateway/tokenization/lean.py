"""A model's tokenizer without transformers: what ``ModelTokenizer`` uses of transformers' one.

``LeanTokenizer`` has the part of ``PreTrainedTokenizerFast``'s interface the gateway calls
(``backend_tokenizer``, ``truncation_side``, ``chat_template``, ``special_tokens_map``,
``get_vocab``, ``apply_chat_template(..., tokenize=False)``), built from a ``Bundle`` that
transformers made (``bundle.py``): the Rust tokenizer is transformers' own, serialized; the chat
templates render through ``templates.TemplateRenderer``. transformers' tokenizer is the reference
implementation of the same interface: ``differs`` replays the bundle's probes, and
``tests/gateway/test_lean.py`` runs one suite against both.
"""

from __future__ import annotations

import copy
from typing import Any

from tokenizers import Tokenizer

from gateway.tokenization import templates
from gateway.tokenization.bundle import PROBE_CHATS, Bundle


class LeanTokenizer:
    """transformers' tokenizer for the gateway's purposes, at a fraction of its memory."""

    def __init__(self, bundle: Bundle) -> None:
        self.backend_tokenizer = Tokenizer.from_str(bundle.tokenizer_json)
        self.chat_template = bundle.chat_template
        self.special_tokens_map = dict(bundle.special_tokens)
        self.truncation_side = bundle.truncation_side
        self._renderer = templates.TemplateRenderer()

    def __deepcopy__(self, memo: dict[int, Any]) -> LeanTokenizer:
        """A copy with its own templates: compiled ones are not copied, only recompiled."""
        twin = copy.copy(self)
        twin.backend_tokenizer = copy.deepcopy(self.backend_tokenizer, memo)
        twin.chat_template = copy.deepcopy(self.chat_template, memo)
        twin.special_tokens_map = dict(self.special_tokens_map)
        twin._renderer = templates.TemplateRenderer()
        return twin

    def get_vocab(self) -> dict[str, int]:
        vocab: dict[str, int] = self.backend_tokenizer.get_vocab(with_added_tokens=True)
        return vocab

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        tokenize: bool = True,
        **kwargs: Any,
    ) -> str:
        """The rendered text; only ``tokenize=False`` (the gateway encodes the text itself)."""
        if tokenize:
            raise ValueError("LeanTokenizer only renders: pass tokenize=False and encode the text")
        template = templates.select(self.chat_template, chat_template, tools)
        return self._renderer.render(
            template,
            conversation,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            variables={**self.special_tokens_map, **kwargs},  # kwargs win, as in transformers
        )

    def differs(self, bundle: Bundle) -> str | None:
        """The first probe this tokenizer does not reproduce, said in one line; None if all match."""
        vocab_max = max((len(t) for t in self.get_vocab()), default=1)
        if vocab_max != bundle.max_chars_per_token:
            return f"longest vocabulary entry {vocab_max} characters, transformers {bundle.max_chars_per_token}"
        for probe in bundle.texts:
            ids = self.backend_tokenizer.encode(probe.text, add_special_tokens=probe.add_special).ids
            if ids != probe.ids:
                return f"encoding {probe.text!r} gave other ids than transformers"
        for chat_probe in bundle.chats:
            chat = PROBE_CHATS[chat_probe.chat]
            named = self.chat_template if isinstance(self.chat_template, dict) else {}
            template = named.get(chat_probe.template or "", self.chat_template)
            text = error = None
            try:
                text = self.apply_chat_template(
                    chat["messages"],
                    tools=chat.get("tools"),
                    chat_template=template if isinstance(template, str) else None,
                    tokenize=False,
                    add_generation_prompt=chat.get("add_generation_prompt", False),
                    continue_final_message=chat.get("continue_final_message", False),
                )
            except Exception as err:  # compared with what transformers raised
                error = type(err).__name__
            if (text, error) != (chat_probe.text, chat_probe.error):
                which = f"template {chat_probe.template!r}" if chat_probe.template else "the chat template"
                seen = error or "a different text"
                return f"{which} on probe {chat_probe.chat}: {seen}, transformers {chat_probe.error or 'rendered'}"
        return None
