"""Shared helpers of the receiver tests: updates, items and bit-level comparisons."""

from __future__ import annotations

from collections.abc import Container, Mapping
from typing import Any

import numpy as np
import torch

from dcr.adapters.loaders.sharded import ShardedServingLoader
from dcr.models.families import random_state_dict, tiny_config
from dcr.tensors.bits import bits, changed_indices
from dcr.tensors.records import Encoding, Item, TensorSpec

# Bit patterns float comparisons get wrong: ±0, NaN payloads (quiet, signalling, negative),
# ±inf, subnormals.
SPECIAL_BITS: dict[torch.dtype, list[int]] = {
    torch.bfloat16: [0x0000, 0x8000, 0x7FC0, 0x7F81, 0xFFC1, 0x7F80, 0xFF80, 0x0001, 0x8003],
    torch.float16: [0x0000, 0x8000, 0x7E00, 0x7C01, 0xFE05, 0x7C00, 0xFC00, 0x0001, 0x83FF],
    torch.float32: [
        0x00000000,
        0x80000000,
        0x7FC00000,
        0x7F800001,
        0xFFC00123,
        0x7F800000,
        0xFF800000,
        0x00000001,
        0x807FFFFF,
    ],
}

A_LOG = "model.layers.0.mixer.A_log"
DT_BIAS = "model.layers.0.mixer.dt_bias"


def tp_config(family: str, tp_size: int) -> dict[str, Any]:
    """A tiny config that shards at ``tp_size`` (kv heads replicated when fewer than tp)."""
    return tiny_config(
        family,
        num_attention_heads=12,
        num_key_value_heads=1 if tp_size == 3 else 2,
        **({"num_experts": 12} if family == "qwen3_moe" else {}),
    )


def extra_specs() -> dict[str, TensorSpec]:
    """Mamba-style extra tensors: ``A_log`` (a transforming path) and a plain bias."""
    return {
        A_LOG: TensorSpec(name=A_LOG, shape=(8,), dtype=torch.bfloat16),
        DT_BIAS: TensorSpec(name=DT_BIAS, shape=(8,), dtype=torch.bfloat16),
    }


def base_state_dict(
    config: Mapping[str, Any], family: str, *, seed: int = 0, extra: bool = True
) -> dict[str, torch.Tensor]:
    sd = random_state_dict(dict(config), family, seed=seed)
    if extra:
        gen = torch.Generator().manual_seed(seed + 1)
        for name, spec in extra_specs().items():
            sd[name] = torch.randn(spec.shape, generator=gen).to(spec.dtype)
    return sd


def catalog_of(state_dict: Mapping[str, torch.Tensor]) -> dict[str, TensorSpec]:
    return {name: TensorSpec.of(name, t) for name, t in state_dict.items()}


def plant_specials(t: torch.Tensor, rng: np.random.Generator, count: int) -> None:
    """Write ``count`` special bit patterns at random positions of ``t``, in place."""
    patterns = SPECIAL_BITS.get(t.dtype)
    if patterns is None or t.numel() == 0:
        return
    flat = bits(t).reshape(-1)
    where = rng.choice(flat.size, size=min(count, flat.size), replace=False)
    flat[where] = rng.choice(np.array(patterns, dtype=np.uint64), size=where.size).astype(
        flat.dtype
    )


def update(
    state_dict: Mapping[str, torch.Tensor],
    *,
    rate: float | str,
    seed: int,
    specials: int = 2,
) -> dict[str, torch.Tensor]:
    """A copy with about ``rate`` of each tensor's elements changed (``"one"``: one element of
    one tensor), including special bit patterns."""
    rng = np.random.default_rng(seed)
    out = {n: t.clone() for n, t in state_dict.items()}
    if rate == "one":
        name = sorted(out)[int(rng.integers(len(out)))]
        flat = bits(out[name]).reshape(-1)
        flat[int(rng.integers(flat.size))] ^= flat.dtype.type(0x0041)
        return out
    assert isinstance(rate, float)
    for t in out.values():
        flat = bits(t).reshape(-1)
        chosen = np.flatnonzero(rng.random(flat.size) < rate)
        if chosen.size:
            noise = rng.integers(1, 1 << 7, size=chosen.size).astype(flat.dtype)
            flat[chosen] ^= noise
        if rate > 0:
            plant_specials(t, rng, specials)
    return out


def make_items(
    old: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    xor_allowed: Container[str],
) -> list[Item]:
    """One item per changed tensor: XOR masks where allowed, overwrite values elsewhere."""
    items = []
    for name, t in new.items():
        b_new, b_old = bits(t).reshape(-1), bits(old[name]).reshape(-1)
        idx = changed_indices(b_new, b_old)
        if not idx.size:
            continue
        xor = name in xor_allowed
        items.append(
            Item(
                name=name,
                shape=tuple(t.shape),
                dtype=t.dtype,
                encoding=Encoding.XOR if xor else Encoding.OVERWRITE,
                indices=idx,
                values=b_new[idx] ^ b_old[idx] if xor else b_new[idx],
            )
        )
    return items


def snapshot(module: torch.nn.Module) -> dict[str, np.ndarray]:
    """Copies of the stored bits of every parameter and buffer."""
    out = {n: bits(p).copy() for n, p in module.named_parameters(remove_duplicate=False)}
    out.update((n, bits(b).copy()) for n, b in module.named_buffers(remove_duplicate=False))
    return out


def bit_diff(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> list[str]:
    """Names whose stored bits (or shapes, or presence) differ."""
    bad = sorted(set(a) ^ set(b))
    bad += [
        n
        for n in sorted(set(a) & set(b))
        if a[n].shape != b[n].shape or a[n].dtype != b[n].dtype or not np.array_equal(a[n], b[n])
    ]
    return bad


def dense_reference(
    config: Mapping[str, Any],
    family: str,
    state_dict: Mapping[str, torch.Tensor],
    tp_size: int,
    tp_rank: int,
    *,
    extra: bool = True,
) -> ShardedServingLoader:
    return ShardedServingLoader.dense(
        config,
        family,
        state_dict,
        tp_size=tp_size,
        tp_rank=tp_rank,
        extra=extra_specs() if extra else None,
    )
