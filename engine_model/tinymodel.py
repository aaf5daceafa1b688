"""Build a tiny tokenizer (and optionally a tiny Llama model) from local text.

No model hub is reachable on CI or in the demo, so the project makes its own: a byte-level
BPE trained on the Python standard library's sources, wrapped as a Hugging Face fast tokenizer
with a chat template, and (with ``--with-model``, which needs torch) a 2-layer Llama that vLLM's
CPU backend can serve. Everything is deterministic for a given Python version.
"""

from __future__ import annotations

import argparse
import os
import sys
import sysconfig
from pathlib import Path

VOCAB_SIZE = 2048
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]
# A ChatML-like template; a real model's template comes with its tokenizer_config.json.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def _corpus(limit_bytes: int = 4_000_000) -> list[str]:
    """Python's own stdlib sources: present on every machine with Python, no download."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(text)
        total += len(text)
        if total >= limit_bytes:
            break
    return texts


def build_tokenizer(out_dir: str | os.PathLike[str]) -> Path:
    """Train and save the tokenizer; returns the folder. Idempotent."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    if (out / "tokenizer.json").exists() and (out / "tokenizer_config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]  # transformers leaves its __init__ unannotated
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    return out


def build_model(out_dir: str | os.PathLike[str], seed: int = 0) -> Path:
    """Save a random-weight 2-layer Llama next to the tokenizer (needs torch)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = build_tokenizer(out_dir)
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # the CPU attention backend only takes some head sizes
        max_position_embeddings=8192,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        dtype="bfloat16",  # torch_dtype before transformers 5 (which still maps that old name to this one)
    )
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)  # type: ignore[no-untyped-call]  # unannotated __init__
    model.save_pretrained(str(out))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--with-model", action="store_true", help="also write Llama weights")
    args = parser.parse_args(argv)
    path = build_model(args.out_dir) if args.with_model else build_tokenizer(args.out_dir)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
