"""Tiny canonical (Hugging Face layout) models built locally, for tests and demos.

:func:`tiny_config` returns an HF-style config dict of the ``llama``, ``qwen3`` or ``qwen3_moe``
family and :func:`random_state_dict` fills the matching checkpoint tensors with seeded random
values, using exactly the tensor names the Hugging Face checkpoints of these families use.
"""

from __future__ import annotations

from typing import Any

import torch

from dcr.errors import ConfigError

__all__ = ["FAMILIES", "canonical_shapes", "head_dim", "random_state_dict", "tiny_config"]

FAMILIES = ("llama", "qwen3", "qwen3_moe")

_BASE: dict[str, dict[str, Any]] = {
    "llama": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 250,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 256,
        "rope_theta": 10000.0,
    },
    "qwen3": {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": 250,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 256,
        "rope_theta": 1000000.0,
    },
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": 250,
        "hidden_size": 64,
        "intermediate_size": 96,
        "moe_intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 256,
        "rope_theta": 1000000.0,
    },
}


def tiny_config(family: str, **overrides: Any) -> dict[str, Any]:
    """A small HF-style config dict of ``family``; keyword arguments override its fields."""
    if family not in _BASE:
        raise ConfigError(f"unknown family {family!r}; expected one of {FAMILIES}")
    cfg = dict(_BASE[family])
    cfg.update(overrides)
    return cfg


def head_dim(config: dict[str, Any]) -> int:
    """Attention head size: ``head_dim`` when given, else ``hidden_size // heads``."""
    hd = config.get("head_dim")
    return int(hd) if hd else int(config["hidden_size"]) // int(config["num_attention_heads"])


def _is_moe_layer(config: dict[str, Any], layer: int) -> bool:
    if not config.get("num_experts"):
        return False
    step = int(config.get("decoder_sparse_step", 1))
    return layer not in config.get("mlp_only_layers", []) and (layer + 1) % step == 0


def canonical_shapes(config: dict[str, Any], family: str) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor names and shapes of ``family`` under ``config``, in checkpoint order.

    A tied-embedding config (``tie_word_embeddings``) has no ``lm_head.weight``, as its
    checkpoints do not.
    """
    if family not in _BASE:
        raise ConfigError(f"unknown family {family!r}; expected one of {FAMILIES}")
    h = int(config["hidden_size"])
    v = int(config["vocab_size"])
    nq = int(config["num_attention_heads"])
    nkv = int(config.get("num_key_value_heads", nq))
    hd = head_dim(config)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for i in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (nq * hd, h)
        shapes[p + "self_attn.k_proj.weight"] = (nkv * hd, h)
        shapes[p + "self_attn.v_proj.weight"] = (nkv * hd, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, nq * hd)
        if family in ("qwen3", "qwen3_moe"):
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if family == "qwen3_moe" and _is_moe_layer(config, i):
            e = int(config["num_experts"])
            f = int(config["moe_intermediate_size"])
            shapes[p + "mlp.gate.weight"] = (e, h)
            for j in range(e):
                shapes[p + f"mlp.experts.{j}.gate_proj.weight"] = (f, h)
                shapes[p + f"mlp.experts.{j}.up_proj.weight"] = (f, h)
                shapes[p + f"mlp.experts.{j}.down_proj.weight"] = (h, f)
        else:
            f = int(config["intermediate_size"])
            shapes[p + "mlp.gate_proj.weight"] = (f, h)
            shapes[p + "mlp.up_proj.weight"] = (f, h)
            shapes[p + "mlp.down_proj.weight"] = (h, f)
    shapes["model.norm.weight"] = (h,)
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (v, h)
    return shapes


def random_state_dict(
    config: dict[str, Any],
    family: str,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    std: float = 0.02,
) -> dict[str, torch.Tensor]:
    """Seeded random checkpoint of ``family``: weights ~ N(0, std), norm weights ~ 1 + N(0, std)."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in canonical_shapes(config, family).items():
        t = torch.randn(shape, generator=gen, dtype=torch.float32) * std
        if name.endswith("norm.weight"):
            t += 1.0
        out[name] = t.to(dtype)
    return out
