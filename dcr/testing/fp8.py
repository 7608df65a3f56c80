"""Helpers of the FP8 rollout tests: versions whose tile scales move, and the items a BF16
trainer's owners send an FP8 receiver for one version step (:mod:`dcr.delta.fp8`)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from dcr.delta.fp8 import Fp8Rollout, Fp8Stats, overwrite_item
from dcr.tensors.bits import bits
from dcr.tensors.fp8 import quantized_names
from dcr.tensors.records import Item

__all__ = ["grow_first_row_max", "refit_items"]


def grow_first_row_max(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Scale the largest weight of each quantized weight's first row by 1.25, in place: its
    row's scale (and often its tile's) changes, and with it the FP8 bits of weights that did
    not change.  Returns ``sd``."""
    for name in quantized_names({n: tuple(t.shape) for n, t in sd.items()}):
        row = sd[name][0]
        j = int(row.to(torch.float32).abs().argmax())
        row[j] = (row[j].to(torch.float32) * 1.25).to(torch.bfloat16)
    return sd


def refit_items(
    old: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    rollout: Fp8Rollout,
    stats: Fp8Stats | None = None,
) -> list[Item]:
    """What owners send from ``old`` to ``new``: the FP8 overwrites ``rollout`` stages for its
    quantized weights (left staged), BF16 overwrites of the changed elements elsewhere."""
    items = []
    for name, t in new.items():
        new_bits = bits(t).reshape(-1)
        changed = np.flatnonzero(bits(old[name]).reshape(-1) != new_bits)
        if name in rollout.mirror:
            items += rollout.stage(name, changed, new_bits[changed], stats)
        elif changed.shape[0]:
            items.append(overwrite_item(name, t, changed, new_bits[changed]))
    return items
