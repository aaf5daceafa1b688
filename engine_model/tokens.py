"""Prompt tokenization and the simulator's deterministic output text.

With ``--tokenizer DIR`` the engine loads the Hugging Face tokenizer in DIR the way vLLM
does (``AutoTokenizer``): completion strings are encoded with ``add_special_tokens=True``
(vLLM's default), chat messages go through the tokenizer's chat template with
``add_generation_prompt=True`` by default and are encoded without extra special tokens.

Without a tokenizer the engine counts **one token per 4 bytes of UTF-8**
(``ceil(len(text.encode()) / 4)``); each token id is the little-endian value of its
4-byte slice, and chat messages are laid out with a small built-in ChatML-like template
(the one ``engine_model.tinymodel`` gives its tokenizer). Token-id prompts are used as given.

Output text is a function of the prompt, as greedy decoding is: every output token is one
"word piece" (a leading space and a short lowercase word) chosen from a running digest of
the prompt's token ids and every output id so far (``OutputContext``). So a prompt that is
another request's prompt plus its first k output ids goes on exactly as that request did
(what a migrated stream's continuation relies on). With a tokenizer the pieces are real
vocabulary entries, so output token ids decode to the output text.
"""

from __future__ import annotations

import hashlib
import re
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

_WORDS_TEXT = (
    "the of and to in is was for on are with as his they be at one have this from "
    "or had by hot word but what some we can out other were all there when up use your "
    "how said an each she which do their time if will way about many then them write "
    "would like so these her long make thing see him two has look more day could go come "
    "did number sound no most people my over know water than call first who may down side "
    "been now find any new work part take get place made live where after back little only "
    "round man year came show every good me give our under name very through just form "
    "sentence great think say help low line differ turn cause much mean before move right "
    "boy old too same tell does set three want air well also play small end put home read "
    "hand port large spell add even land here must big high such follow act why ask men "
    "change went light kind off need house picture try us again animal point mother world "
    "near build self earth father head stand own page should country found answer school "
    "grow study still learn plant cover food sun four between state keep eye never last "
    "let thought city tree cross farm hard start might story saw far sea draw left late run"
)
_WORDS = tuple(_WORDS_TEXT.split())

_PIECE_RE = re.compile(r" [a-z]{2,10}")


class OutputVocab:
    """The word pieces generated text is made of, with their token ids."""

    def __init__(self, ids: Sequence[int], pieces: Sequence[str]) -> None:
        if not ids or len(ids) != len(pieces):
            raise ValueError("output vocabulary must be non-empty, ids and pieces aligned")
        self.ids = list(ids)
        self.pieces = list(pieces)
        self.size = len(self.ids)


class OutputContext:
    """The context the next output token is chosen from: a digest of an optional salt, the
    prompt's ids and each output id appended since. Digests chain, so the context after prompt P
    and outputs G equals the context of prompt P + G: the choices go on the same."""

    __slots__ = ("_h",)

    def __init__(self, prompt_ids: Sequence[int], salt: bytes = b"") -> None:
        self._h = hashlib.blake2b(digest_size=8)
        self._h.update(salt)
        self._h.update(array("Q", prompt_ids).tobytes())

    def choice(self) -> int:
        """A 64-bit number for the next output choice."""
        return int.from_bytes(self._h.copy().digest(), "little")

    def append(self, token_id: int) -> None:
        self._h.update(token_id.to_bytes(8, "little"))


def block_chain(token_ids: Sequence[int], block_size: int, n_blocks: int | None = None, salt: bytes = b"") -> list[str]:
    """One tag per KV block: a digest of every token up to the end of that block (like vLLM's
    chained block hashes). Two blocks hold the same KV iff their tags are equal. ``salt``: what
    else the KV depends on (a LoRA adapter's weights; b"" for the base model)."""
    n = len(token_ids)
    count = -(-n // block_size) if n_blocks is None else min(n_blocks, -(-n // block_size))
    h = hashlib.blake2b(digest_size=12)
    h.update(salt)
    out = []
    for i in range(count):
        h.update(array("Q", token_ids[i * block_size : (i + 1) * block_size]).tobytes())
        h.update(b"|")
        out.append(h.copy().hexdigest())
    return out


class ByteTokenizer:
    """No tokenizer given: 4 UTF-8 bytes per token."""

    kind = "bytes"
    max_token_id: int | None = None  # no vocabulary: token-id prompts are not range-checked
    max_chars_per_token: int | None = None

    def __init__(self) -> None:
        self.output_vocab = OutputVocab(range(len(_WORDS)), [" " + w for w in _WORDS])

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        data = text.encode("utf-8")
        pad = (-len(data)) % 4
        if pad:
            data += b"\0" * pad
        arr = array("I")
        arr.frombytes(data)
        if arr.itemsize != 4:  # pragma: no cover - every supported platform has 4-byte "I"
            raise RuntimeError("array('I') is not 4 bytes wide here")
        return arr.tolist()

    def apply_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **_: Any,
    ) -> list[int]:
        parts = ["<s>"]
        for i, msg in enumerate(messages):
            parts.append(f"<|{msg['role']}|>\n")
            parts.append(msg["content"])
            if not (continue_final_message and i == len(messages) - 1):
                parts.append("</s>\n")
        if add_generation_prompt:
            parts.append("<|assistant|>\n")
        return self.encode("".join(parts), add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        raw = array("I", ids).tobytes().rstrip(b"\0")
        return raw.decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer folder, used the way vLLM uses it."""

    kind = "hf"

    def __init__(self, path: str | Path) -> None:
        from transformers import AutoTokenizer  # heavy import: only when asked for

        self.tok = AutoTokenizer.from_pretrained(str(path))
        vocab = self.tok.get_vocab()
        self.max_token_id = max(vocab.values()) if vocab else 0
        self.max_chars_per_token = max((len(t) for t in vocab), default=1)
        self.output_vocab = self._build_output_vocab()

    def _build_output_vocab(self) -> OutputVocab:
        ids: list[int] = []
        pieces: list[str] = []
        special = set(self.tok.all_special_ids)
        for tid in range(min(self.max_token_id + 1, 50_000)):
            if tid in special:
                continue
            piece = self.decode([tid])
            if _PIECE_RE.fullmatch(piece):
                ids.append(tid)
                pieces.append(piece)
                if len(ids) >= 512:
                    break
        if len(ids) < 16:  # an exotic vocabulary: fall back to plain words
            return OutputVocab(range(len(_WORDS)), [" " + w for w in _WORDS])
        return OutputVocab(ids, pieces)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=add_special_tokens))

    def apply_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> list[int]:
        # transformers annotates the union of every mode's result; this mode's is the ids (or, in
        # some versions, a BatchEncoding holding them), told apart at run time below
        out: Any = self.tok.apply_chat_template(
            messages,
            tokenize=True,
            return_dict=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **kwargs,
        )
        if isinstance(out, dict) or hasattr(out, "keys"):  # transformers returning a BatchEncoding
            out = out["input_ids"]
        return [int(t) for t in out]

    def decode(self, ids: Sequence[int]) -> str:
        # transformers annotates str | list[str] (a batch decodes to a list); one sequence is a str
        return cast(str, self.tok.decode(list(ids)))


def load_tokenizer(path: str | None) -> ByteTokenizer | HFTokenizer:
    return HFTokenizer(path) if path else ByteTokenizer()
