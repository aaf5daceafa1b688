"""The reference load: a model's tokenizer as vLLM loads it, through transformers.

vLLM loads a generative model's tokenizer with ``AutoTokenizer.from_pretrained(...,
truncation_side="left")``; what that returns (the Rust tokenizer with every added token and
post-processor transformers sets up, the chat templates, the special tokens) is what the gateway
must match. A worker does not keep transformers: ``gateway/tokenization/bundle.py`` runs this load
in a short-lived child process and hands the worker the result, checked
(docs/benchmarks.md, "Worker memory").
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.config import ModelConfig
from gateway.tokenization import fasttok, frameworks, hub

log = logging.getLogger(__name__)
_IMPORT_LOCK = threading.Lock()

# vLLM renders these models' chat prompts with its own Python code (or tokenizer) instead of the
# Jinja chat template, so the gateway's chat counts for them are approximate.
_RENDERER_ARCHITECTURES = {
    "DeepseekV32ForCausalLM": "deepseek_v32",
    "DeepseekV4ForCausalLM": "deepseek_v4",
    "DeepseekV4ForConditionalGeneration": "deepseek_v4",
    "DeepseekV41ForCausalLM": "deepseek_v41",
    "KimiK3ForConditionalGeneration": "kimi_k3",
    "MoonshotKimiaForCausalLM": "kimi_audio",
    "InklingForCausalLM": "inkling",
    "InklingForConditionalGeneration": "inkling",
}
_PLAIN_TOKENIZER_MODES = frozenset({"auto", "hf"})


@dataclass(frozen=True)
class Reference:
    """transformers' tokenizer for a model, and what the gateway reads off the model's files."""

    hf: Any  # transformers' PreTrainedTokenizerFast (or the model's own class)
    renderer: str | None  # vLLM's own chat renderer for this model (None: the Jinja template)
    ranks_file: str | None  # the model's tiktoken ranks next to its tokenizer, if any


def load(cfg: ModelConfig) -> Reference:
    """Load through transformers, as vLLM does; errors say what is missing in one line."""
    frameworks.keep_out()  # before transformers' first import: it would load torch (~700 MB)
    with _IMPORT_LOCK:  # transformers' lazy imports fail when two threads race through them
        from transformers import AutoTokenizer  # heavy import: only in the process that loads

    # A hub name: ask the hub once, fast (gateway/tokenization/hub.py), rather than through a minute of the
    # library's retries; where it cannot serve, only the local hub cache can.
    problem = None if hub.is_local(cfg.tokenizer) else hub.probe(cfg.tokenizer, cfg.tokenizer_revision)
    try:
        hf = AutoTokenizer.from_pretrained(
            cfg.tokenizer,
            revision=cfg.tokenizer_revision,
            trust_remote_code=cfg.trust_remote_code,
            truncation_side="left",
            local_files_only=problem is not None,
        )
    except OSError:
        if problem is None:
            raise
        raise problem.unavailable() from None
    except ImportError as err:
        framework = frameworks.blocked(err)
        if framework is None:
            raise
        raise frameworks.FrameworkNeeded(
            f"model {cfg.name}: its tokenizer's code imports {framework}, which the gateway keeps out of "
            "its processes (it only tokenizes); give it a tokenizer that loads without it"
        ) from None
    if problem is not None:
        log.log(
            logging.INFO if problem.chosen else logging.WARNING,
            "model %s: %s; its tokenizer comes from the local hub cache",
            cfg.name,
            problem.what,
        )
    return Reference(hf, detect_renderer(cfg), find_ranks_file(cfg))


def _model_config(cfg: ModelConfig) -> dict[str, Any]:
    """The model's config.json next to its tokenizer, if there is one (no download)."""
    from transformers.utils.hub import cached_file  # where it is defined (transformers.utils re-exports it)

    try:
        path = cached_file(
            cfg.tokenizer,
            "config.json",
            revision=cfg.tokenizer_revision,
            _raise_exceptions_for_missing_entries=False,
            local_files_only=True,
        )
        return json.loads(Path(path).read_text(encoding="utf-8")) if path else {}
    except Exception:  # no config, or one we cannot read: nothing to detect from
        return {}


def find_ranks_file(cfg: ModelConfig) -> str | None:
    """The model's own tiktoken ranks next to its tokenizer (``fasttok.RANKS_FILES``: Meta's
    ``original/tokenizer.model``), when the folder or the local hub cache has one (no download).
    Preferred where present (it must hold exactly the vocabulary's tokens and ids); without one,
    or when it is not that, ``fasttok.load_ranks`` reads the same ranks off tokenizer.json's
    vocabulary, so downloads without ``original/`` (which also holds the weights) get them too."""
    from transformers.utils.hub import cached_file  # where it is defined (transformers.utils re-exports it)

    for name in fasttok.RANKS_FILES:
        try:
            path = cached_file(
                cfg.tokenizer,
                name,
                revision=cfg.tokenizer_revision,
                _raise_exceptions_for_missing_entries=False,
                local_files_only=True,
            )
        except Exception:  # not there, or no cache to look in
            continue
        if path:
            return str(path)
    return None


def detect_renderer(cfg: ModelConfig) -> str | None:
    """Which of vLLM's own chat renderers this model gets (None: the Jinja template)."""
    if cfg.tokenizer_mode not in _PLAIN_TOKENIZER_MODES:
        return cfg.tokenizer_mode
    config = _model_config(cfg)
    if config.get("model_type") == "gpt_oss":
        return "harmony"
    for arch in config.get("architectures") or ():
        if arch in _RENDERER_ARCHITECTURES:
            return _RENDERER_ARCHITECTURES[arch]
    folder = Path(cfg.tokenizer)
    if (
        cfg.tokenizer_mode == "auto"
        and folder.is_dir()
        and any(folder.glob("consolidated*.safetensors"))
        and ((folder / "tekken.json").exists() or any(folder.glob("tokenizer.model.v*")))
    ):
        return "mistral"  # vLLM then uses mistral_common's tokenizer and renderer
    return None
