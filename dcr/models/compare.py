"""Bit-level comparison of modules and state dicts (never float equality)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import torch

from dcr.tensors.bits import bits

__all__ = ["bit_mismatches", "module_bit_mismatches"]


def _pairs(module: torch.nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


def bit_mismatches(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ in keys, shape, dtype or any stored bit."""
    bad = sorted(set(a) ^ set(b))
    for name in sorted(set(a) & set(b)):
        x, y = a[name].detach().cpu(), b[name].detach().cpu()
        if (
            x.shape != y.shape
            or x.dtype != y.dtype
            or not np.array_equal(bits(x.contiguous()), bits(y.contiguous()))
        ):
            bad.append(name)
    return bad


def module_bit_mismatches(a: torch.nn.Module, b: torch.nn.Module) -> list[str]:
    """Parameters and buffers of two modules that differ in any stored bit."""
    return bit_mismatches(dict(_pairs(a)), dict(_pairs(b)))
