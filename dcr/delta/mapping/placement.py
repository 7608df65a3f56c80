"""Affine mappings of where a shard sits beyond a tensor-parallel split: :class:`PerExpert`
(global expert index ``ep_rank * E / EP + local``), :class:`Tied` (one source element, several
canonical destinations) and :class:`SubTensor` (one box of the canonical tensor, as a
DTensor's ``Shard`` placements cut it, even or uneven)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from dcr.delta.mapping.base import (
    AffineMapping,
    Blocks,
    Canonical,
    Destination,
    Index,
    Segment,
    _divide,
)
from dcr.errors import LayoutError


@dataclass(frozen=True, slots=True)
class PerExpert(AffineMapping):
    """A routed expert's shard: local expert ``local_index`` of EP rank ``ep_rank``.

    Its global index is ``ep_rank * num_experts / ep_size + local_index``; ``inner`` is the
    mapping of the expert's own tensors (already named with the global index), e.g.
    :class:`GatedMLP` for ``fc1`` or :class:`RowParallel` for ``fc2`` under expert TP.
    """

    inner: AffineMapping
    ep_rank: int
    ep_size: int
    num_experts: int
    local_index: int

    @staticmethod
    def global_index(ep_rank: int, ep_size: int, num_experts: int, local_index: int) -> int:
        per_rank = _divide(num_experts, ep_size, "experts per EP rank")
        if not 0 <= local_index < per_rank:
            raise LayoutError(f"local expert {local_index} out of range [0, {per_rank})")
        return ep_rank * per_rank + local_index

    @property
    def expert(self) -> int:
        return self.global_index(self.ep_rank, self.ep_size, self.num_experts, self.local_index)

    @property
    def source_shape(self) -> tuple[int, ...]:
        return self.inner.source_shape

    @property
    def names(self) -> tuple[str, ...]:
        return self.inner.names

    def project(self, local: Index) -> list[Destination]:
        return self.inner.project(local)

    def segments(self) -> list[Segment]:
        return self.inner.segments()

    def blocks(self, canonical: Canonical, shard: torch.Tensor) -> Blocks:
        return self.inner.blocks(canonical, shard)

    def source_blocks(self, canonical: Canonical, shard: torch.Tensor) -> Blocks:
        return self.inner.source_blocks(canonical, shard)


@dataclass(frozen=True, slots=True)
class Tied(AffineMapping):
    """One source shard with several canonical destinations (tied embedding / output head).

    Every destination of ``inner`` is emitted once more under each name in ``also``.
    """

    inner: AffineMapping
    also: tuple[str, ...]
    """Additional canonical names that hold a copy of the inner mapping's one tensor."""

    def __post_init__(self) -> None:
        if len(self.inner.names) != 1:
            raise LayoutError("Tied needs an inner mapping with one canonical tensor")

    @property
    def source_shape(self) -> tuple[int, ...]:
        return self.inner.source_shape

    @property
    def names(self) -> tuple[str, ...]:
        return (*self.inner.names, *self.also)

    def project(self, local: Index) -> list[Destination]:
        base = self.inner.project(local)
        out = list(base)
        for extra in self.also:
            out.extend(Destination(name=extra, indices=d.indices, select=d.select) for d in base)
        return out

    def segments(self) -> list[Segment]:
        return [seg.renamed((*seg.names, *self.also)) for seg in self.inner.segments()]

    def blocks(self, canonical: Canonical, shard: torch.Tensor) -> Blocks:
        (name,) = self.inner.names
        out = self.inner.blocks(canonical, shard)
        for extra in self.also:
            out.extend(
                (extra, c, s) for _, c, s in self.inner.blocks({name: canonical[extra]}, shard)
            )
        return out

    def source_blocks(self, canonical: Canonical, shard: torch.Tensor) -> Blocks:
        return self.inner.source_blocks(canonical, shard)


@dataclass(frozen=True, slots=True)
class SubTensor(AffineMapping):
    """The shard is the box ``canonical[offset[0] : offset[0] + shape[0], ...]`` of one tensor.

    This is what ``Shard(d)`` placements of a DTensor give each rank (one or several mesh
    dimensions, even or uneven chunks, possibly empty): local multi-index ``i`` is canonical
    multi-index ``offset + i``.  Segments: the dimensions after the last sharded one are
    contiguous, the sharded rows are spread ``gap`` apart, and one segment covers every run of
    rows whose stride is uniform (one segment for tensors sharded along one dimension).
    """

    name: str
    canonical_shape: tuple[int, ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        dims = len(self.canonical_shape)
        if len(self.offset) != dims or len(self.shape) != dims:
            raise LayoutError(
                "offset and shape must have one entry per dimension", tensor=self.name
            )
        for o, n, c in zip(self.offset, self.shape, self.canonical_shape, strict=True):
            if o < 0 or n < 0 or o + n > c:
                raise LayoutError(
                    f"box at {list(self.offset)} of {list(self.shape)} is outside "
                    f"{list(self.canonical_shape)}",
                    tensor=self.name,
                )

    @property
    def source_shape(self) -> tuple[int, ...]:
        return self.shape

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name,)

    def project(self, local: Index) -> list[Destination]:
        if not self.shape:
            return [Destination(name=self.name, indices=local)]
        multi = np.unravel_index(local, self.shape)
        moved = tuple(m + o for m, o in zip(multi, self.offset, strict=True))
        canon = np.ravel_multi_index(moved, self.canonical_shape).astype(np.int64, copy=False)
        return [Destination(name=self.name, indices=canon)]

    def segments(self) -> list[Segment]:
        if not self.numel:
            return []
        dims = zip(self.shape, self.canonical_shape, strict=True)
        sharded = [d for d, (n, c) in enumerate(dims) if n != c]
        if not sharded:
            return [Segment(0, self.numel, (self.name,), 0)]
        k = sharded[-1]
        inner = math.prod(self.canonical_shape[k + 1 :])
        below = [d for d in sharded if d < k]
        if k == 0:
            return [Segment(0, self.numel, (self.name,), self.offset[0] * inner)]
        # Rows are the dims [p, k): uniform canonical stride, as those after p are whole.
        p = below[-1] if below else 0
        period = self.shape[k] * inner
        gap = (self.canonical_shape[k] - self.shape[k]) * inner
        rows = math.prod(self.shape[p:k])
        row_offset = self.offset[p] * math.prod(self.canonical_shape[p + 1 : k])
        out = []
        for outer in np.ndindex(*self.shape[:p]):
            moved = tuple(a + o for a, o in zip(outer, self.offset[:p], strict=True))
            flat = _flat(moved, self.canonical_shape[:p])
            start = _flat(outer, self.shape[:p]) * rows * period
            canon = (
                (flat * math.prod(self.canonical_shape[p:k]) + row_offset) * self.canonical_shape[k]
                + self.offset[k]
            ) * inner
            if gap:
                out.append(
                    Segment(
                        start,
                        start + rows * period,
                        (self.name,),
                        canon - start - (start // period) * gap,
                        period=period,
                        gap=gap,
                    )
                )
            else:
                out.append(Segment(start, start + rows * period, (self.name,), canon - start))
        return out

    def blocks(self, canonical: Canonical, shard: torch.Tensor) -> Blocks:
        box = tuple(slice(o, o + n) for o, n in zip(self.offset, self.shape, strict=True))
        return [(self.name, canonical[self.name][box], shard)]


def _flat(index: tuple[int, ...], shape: tuple[int, ...]) -> int:
    """Row-major flat position of multi-index ``index`` in ``shape``."""
    out = 0
    for i, n in zip(index, shape, strict=True):
        out = out * n + i
    return out
