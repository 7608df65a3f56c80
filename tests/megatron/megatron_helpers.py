"""Tiny Megatron-Core models on CPU (gloo), built through Megatron-Bridge, for the oracle tests.

The Hugging Face configs are written locally (no hub access); models are constructed on the CPU
with the local (non-Transformer-Engine) layer spec.  Updates are deterministic per parameter
copy: every replica of a parameter (tensor-parallel copies of replicated parameters,
data-parallel copies) draws the same update, as an optimizer step keeps them identical.
"""

from __future__ import annotations

import hashlib
import logging
import os
import warnings
from pathlib import Path
from typing import Any

import torch

FAMILIES = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


def write_config(family: str, directory: str | Path, *, vocab: int = 1000) -> str:
    """A tiny Hugging Face config of ``family`` saved in ``directory``."""
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        torch_dtype="bfloat16",
    )
    if family == "llama":
        cfg = transformers.LlamaConfig(intermediate_size=128, tie_word_embeddings=False, **common)
    elif family == "qwen3":
        cfg = transformers.Qwen3Config(
            intermediate_size=128, head_dim=32, tie_word_embeddings=True, **common
        )
    else:
        cfg = transformers.Qwen3MoeConfig(
            intermediate_size=128,
            moe_intermediate_size=32,
            head_dim=32,
            num_experts=4,
            num_experts_per_tok=2,
            tie_word_embeddings=False,
            **common,
        )
    cfg.architectures = [FAMILIES[family]]
    cfg.save_pretrained(str(directory))
    return str(directory)


def quiet() -> None:
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    os.environ["HF_HUB_OFFLINE"] = "1"


def build(config_dir: str, *, tp: int, ep: int = 1, pad: bool = False) -> tuple[Any, list[Any]]:
    """``(bridge, model chunks)`` of this rank: a bf16 GPTModel on CPU, TP ``tp``, EP ``ep``."""
    quiet()
    from megatron.bridge import AutoBridge
    from megatron.bridge.models.gpt_provider import local_layer_spec
    from megatron.core import parallel_state
    from transformers import AutoConfig

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep
    )
    bridge = AutoBridge.from_hf_config(AutoConfig.from_pretrained(config_dir))
    provider = bridge.to_megatron_provider(load_weights=False)
    provider.tensor_model_parallel_size = tp
    provider.expert_model_parallel_size = ep
    provider.transformer_layer_spec = local_layer_spec
    provider.apply_rope_fusion = False
    provider.persist_layer_norm = False
    provider.moe_permute_fusion = False
    provider.moe_token_dispatcher_type = "allgather"
    provider.moe_grouped_gemm = False
    provider.should_pad_vocab = pad
    provider.params_dtype = torch.bfloat16
    provider.bf16 = True
    provider.finalize()
    torch.manual_seed(1234)  # the same initial weights on every data-parallel replica
    chunks = provider.provide_distributed_model(
        wrap_with_ddp=False, use_cpu_initialization=True, mixed_precision_wrapper=None, bf16=True
    )
    return bridge, chunks


def export(bridge: Any, chunks: list[Any], vocab: int) -> dict[str, torch.Tensor]:
    """The Bridge's export of the model (collective); tensors with the model's padded
    vocabulary rows are cut to the checkpoint's ``vocab`` rows."""
    padded = chunks[0].vocab_size
    out = {}
    for name, t in bridge.export_hf_weights(chunks, cpu=True, show_progress=False):
        t = t.detach().clone()
        if padded > vocab and t.dim() and t.shape[0] == padded:
            t = t[:vocab].clone()
        out[name] = t
    return out


def _seed(*parts: object) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")


def step(chunks: list[Any], version: int, *, rate: float = 0.03) -> None:
    """A deterministic update of about ``rate`` of each parameter's elements, in place.

    A tensor-parallel shard draws per TP rank, an expert per EP rank; replicas draw alike.
    """
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_rank()
    ep = parallel_state.get_expert_model_parallel_rank()
    with torch.no_grad():
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                split = tp if getattr(p, "tensor_model_parallel", False) else -1
                expert = ep if not getattr(p, "allreduce", True) else -1
                gen = torch.Generator().manual_seed(_seed(name, version, split, expert) % 2**63)
                pick = torch.rand(p.shape, generator=gen) < rate
                noise = torch.randn(p.shape, generator=gen) * 0.05 + 0.01
                new = (p.float() * (1 + noise)).to(p.dtype)
                p.copy_(torch.where(pick, new, p))
