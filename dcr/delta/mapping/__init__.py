"""Affine index mappings: local shard indices -> canonical coordinates (paper §4.2, App. A.1).

An affine mapping converts each source element of a training shard independently: element ``j``
of the shard (flat, C order) lands at canonical element ``(name, k)`` with the stored bits
unchanged.  Mappings are pure integer arithmetic, vectorized over index arrays, so an owner
projects only its changed elements and never assembles a canonical tensor.

Mapping classes (``docs/architecture.md``, "Data plane"): :class:`Direct`, :class:`Replicated`,
:class:`ColumnParallel` (split dim 0, optional vocabulary padding), :class:`RowParallel` (split
dim 1), :class:`GatedMLP` (Megatron ``fc1 = [gate_r; up_r]``), :class:`FusedQKV` (a per-element
permutation of Megatron's per-query-group ``[q heads..., k, v]`` rows), :class:`PerExpert`
(global expert index ``ep_rank * E / EP + local``), :class:`Tied` (one source element, several
canonical destinations) and :class:`SubTensor` (the shard is one box of the canonical tensor, as a
DTensor's ``Shard`` placements cut it, even or uneven).

The interface and the segments are in ``base``, the tensor-parallel splits in
``tensor_parallel``, the expert, tied and sub-tensor mappings in ``placement``.
"""

from __future__ import annotations

from dcr.delta.mapping.base import AffineMapping, Destination, Segment
from dcr.delta.mapping.placement import PerExpert, SubTensor, Tied
from dcr.delta.mapping.tensor_parallel import (
    ColumnParallel,
    Direct,
    FusedQKV,
    GatedMLP,
    Replicated,
    RowParallel,
)

__all__ = [
    "AffineMapping",
    "ColumnParallel",
    "Destination",
    "Segment",
    "Direct",
    "FusedQKV",
    "GatedMLP",
    "PerExpert",
    "Replicated",
    "RowParallel",
    "SubTensor",
    "Tied",
]
