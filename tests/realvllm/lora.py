"""A tiny LoRA adapter for the suite's tiny model, written as vLLM 0.32 loads one: an
``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``; ``vllm/lora/peft_helper.py``)
and ``adapter_model.safetensors`` with PEFT's tensor names,
``base_model.model.model.layers.N.<module>.lora_A.weight`` shaped ``[r, in]`` and ``lora_B``
shaped ``[out, r]`` (``vllm/lora/lora_model.py``). No ``peft`` package needed: numpy and
safetensors (which transformers brings) write it. B is not zero, so the adapter changes answers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

RANK = 8


def make_adapter(model_dir: Path, out: Path, seed: int) -> Path:
    """An adapter of the model in ``model_dir`` (its config.json's sizes), in ``out``."""
    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * head_dim
    shapes = {  # module -> (in, out)
        "self_attn.q_proj": (hidden, cfg["num_attention_heads"] * head_dim),
        "self_attn.k_proj": (hidden, kv),
        "self_attn.v_proj": (hidden, kv),
        "self_attn.o_proj": (cfg["num_attention_heads"] * head_dim, hidden),
        "mlp.gate_proj": (hidden, inter),
        "mlp.up_proj": (hidden, inter),
        "mlp.down_proj": (inter, hidden),
    }
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module, (fin, fout) in shapes.items():
            name = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{name}.lora_A.weight"] = (rng.standard_normal((RANK, fin)) * 0.5).astype(np.float32)
            tensors[f"{name}.lora_B.weight"] = (rng.standard_normal((fout, RANK)) * 0.5).astype(np.float32)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": RANK,
        "lora_alpha": 2 * RANK,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": [m.split(".")[1] for m in shapes],
    }
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out
