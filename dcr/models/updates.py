"""Synthetic policy updates and a canonical-space sharded receiver.

:func:`perturb` makes the benchmark's update (paper §8.1 "Element change rates"): a chosen
fraction of elements is updated as ``bf16(w * (1 + 0.01 * eps))``, ``eps`` standard normal, so
some chosen elements keep their stored bits, as in BF16 training.  :func:`special_patterns`
plants bit patterns that float comparisons get wrong.  :func:`apply_to_state_dict` applies items
directly to canonical tensors, the simplest receiver there is.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import torch

from dcr.tensors.bits import bits
from dcr.tensors.ordered import ordered, unordered
from dcr.tensors.records import Encoding, Item

__all__ = ["apply_to_state_dict", "perturb", "special_patterns"]


def perturb(
    state_dict: Mapping[str, torch.Tensor],
    *,
    rate: float,
    seed: int,
    relative: float = 0.01,
    names: Iterable[str] | None = None,
) -> dict[str, torch.Tensor]:
    """A copy of ``state_dict`` with about ``rate`` of the elements of each tensor updated.

    Each element is chosen independently with probability ``rate``; chosen elements become
    ``cast(w * (1 + relative * eps))`` computed in float32; unchosen elements keep their bits.
    ``names`` limits the update to some tensors.
    """
    gen = torch.Generator().manual_seed(seed)
    chosen_names = set(state_dict) if names is None else set(names)
    out = {}
    for name, t in state_dict.items():
        if name not in chosen_names or t.numel() == 0 or not t.is_floating_point():
            out[name] = t.clone()
            continue
        new = t.clone().reshape(-1)
        idx = (torch.rand(new.numel(), generator=gen) < rate).nonzero().squeeze(1)
        if idx.numel():
            eps = torch.randn(idx.numel(), generator=gen, dtype=torch.float32)
            new[idx] = (new[idx].to(torch.float32) * (1.0 + relative * eps)).to(t.dtype)
        out[name] = new.reshape(t.shape)
    return out


def special_patterns(state_dict: Mapping[str, torch.Tensor], *, seed: int = 0) -> None:
    """Plant ``+0 -> -0``, NaN payloads, ±inf and subnormals in floating tensors, in place.

    Each floating tensor with at least 8 elements gets its first few elements rewritten with
    patterns chosen by ``seed``, so two calls with different seeds change their stored bits.
    """
    rng = np.random.default_rng(seed)
    for t in state_dict.values():
        if not t.is_floating_point() or t.numel() < 8:
            continue
        b = bits(t).reshape(-1)
        width = b.dtype.itemsize * 8
        sign = np.uint64(1) << np.uint64(width - 1)
        exp_bits = {16: 5 if t.dtype == torch.float16 else 8, 32: 8, 64: 11}.get(width, 4)
        mant = width - 1 - exp_bits
        exp_all = ((np.uint64(1) << np.uint64(exp_bits)) - np.uint64(1)) << np.uint64(mant)
        choices = [
            np.uint64(0),  # +0
            sign,  # -0
            exp_all | np.uint64(1),  # signalling-NaN payload
            exp_all | (np.uint64(1) << np.uint64(mant - 1)) | np.uint64(rng.integers(1, 4)),
            exp_all,  # +inf
            exp_all | sign,  # -inf
            np.uint64(1),  # smallest subnormal
            sign | np.uint64(rng.integers(1, 1 << min(mant, 20))),  # negative subnormal
        ]
        picks = rng.permutation(len(choices))
        b[: len(choices)] = np.array([choices[i] for i in picks], dtype=np.uint64).astype(b.dtype)


def apply_to_state_dict(state_dict: Mapping[str, torch.Tensor], items: Iterable[Item]) -> None:
    """Apply items in place to canonical tensors (XOR into, add ULP deltas to, or overwrite
    their stored bits)."""
    for item in items:
        flat = bits(state_dict[item.name]).reshape(-1)
        if item.encoding is Encoding.XOR:
            flat[item.indices] ^= item.values
        elif item.encoding is Encoding.ULP:
            with np.errstate(over="ignore"):
                flat[item.indices] = unordered(ordered(flat[item.indices]) + item.values)
        else:
            flat[item.indices] = item.values
