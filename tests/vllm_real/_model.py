"""Tiny model configurations for ``vllm serve --load-format dummy`` (no weights, no tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

VOCAB_SIZE = 512
MAX_MODEL_LEN = 256

_COMMON: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": MAX_MODEL_LEN,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}

MOE_CONFIG: dict[str, Any] = {
    **_COMMON,
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "router_aux_loss_coef": 0.0,
    "output_router_logits": False,
}
"""Mixtral-style MoE: 2 layers, hidden size 128, 4 experts, top-2, a 512-token vocabulary.
vLLM coordinates waves for it with DP > 1 (lock-step ranks)."""

DENSE_CONFIG: dict[str, Any] = {
    **_COMMON,
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
}
"""The same shape without experts: vLLM's coordinator only balances load (no waves)."""


def write_model(directory: Path, config: dict[str, Any]) -> Path:
    """Write ``config.json`` (all ``--load-format dummy`` needs) into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory


def dense_config(*, hidden: int, layers: int, max_len: int) -> dict[str, Any]:
    """A Llama-style dense model of ``layers`` layers of width ``hidden`` (head size 32,
    four query heads per KV head, an MLP of 4x the width), for prompts up to ``max_len``."""
    return {
        **DENSE_CONFIG,
        "hidden_size": hidden,
        "intermediate_size": 4 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": hidden // 32,
        "num_key_value_heads": max(1, hidden // 128),
        "head_dim": 32,
        "max_position_embeddings": max_len,
    }


PREFILL_CONFIG: dict[str, Any] = dense_config(hidden=256, layers=4, max_len=4224)
"""A dense model whose prefill takes a real share of a step on the CPU (a routing
benchmark's: ``benchmarks/sections/routing_real.py``): 4 layers of width 256, prompts up to 4k."""
