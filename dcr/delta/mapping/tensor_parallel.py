"""Affine mappings of Megatron's tensor-parallel splits: :class:`Direct`, :class:`Replicated`,
:class:`ColumnParallel` (split dim 0, optional vocabulary padding), :class:`RowParallel` (split
dim 1), :class:`GatedMLP` (``fc1 = [gate_r; up_r]``) and :class:`FusedQKV` (a per-element
permutation of the per-query-group ``[q heads..., k, v]`` rows)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from dcr.delta.mapping.base import (
    AffineMapping,
    Blocks,
    Canonical,
    Destination,
    Index,
    Segment,
    _cols,
    _divide,
)
from dcr.errors import LayoutError


@dataclass(frozen=True, slots=True)
class Direct(AffineMapping):
    """The shard is the whole canonical tensor (``tp = 1`` or an unsharded parameter)."""

    name: str
    shape: tuple[int, ...]

    @property
    def source_shape(self) -> tuple[int, ...]:
        return self.shape

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name,)

    def project(self, local: Index) -> list[Destination]:
        return [Destination(name=self.name, indices=local)]

    def segments(self) -> list[Segment]:
        return [Segment(0, self.numel, (self.name,), 0)]

    def blocks(self, canonical: Canonical, shard: torch.Tensor) -> Blocks:
        return [(self.name, canonical[self.name], shard)]


@dataclass(frozen=True, slots=True)
class Replicated(Direct):
    """Every tensor-parallel rank holds a full copy; only the elected owner's copy projects.

    The index math is :class:`Direct`'s; the difference is the replica group (all TP ranks
    hold bitwise-identical copies), which ownership election uses.
    """


@dataclass(frozen=True, slots=True)
class ColumnParallel(AffineMapping):
    """Split along dim 0: local row ``i`` of rank ``r`` is canonical row ``r * rows_local + i``.

    ``padded_rows`` (>= the canonical row count) models a padded vocabulary: the padded
    tensor is split evenly and rows at or beyond the canonical row count are dropped.
    """

    name: str
    canonical_shape: tuple[int, ...]
    tp_rank: int
    tp_size: int
    padded_rows: int | None = None
    _rows_local: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        rows = self.padded_rows if self.padded_rows is not None else self.canonical_shape[0]
        if rows < self.canonical_shape[0]:
            raise LayoutError("padded_rows smaller than the tensor", tensor=self.name)
        object.__setattr__(self, "_rows_local", _divide(rows, self.tp_size, self.name))

    @property
    def source_shape(self) -> tuple[int, ...]:
        return (self._rows_local, *self.canonical_shape[1:])

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name,)

    def project(self, local: Index) -> list[Destination]:
        cols = _cols(self.canonical_shape)
        start = self.tp_rank * self._rows_local * cols
        canon = local + start
        limit = self.canonical_shape[0] * cols
        if start + self._rows_local * cols <= limit:
            return [Destination(name=self.name, indices=canon)]
        keep = np.flatnonzero(canon < limit)
        if keep.size == 0:
            return []
        return [Destination(name=self.name, indices=canon[keep], select=keep)]

    def segments(self) -> list[Segment]:
        cols = _cols(self.canonical_shape)
        first = self.tp_rank * self._rows_local
        rows = min(self._rows_local, self.canonical_shape[0] - first)
        if rows <= 0:
            return []
        return [Segment(0, rows * cols, (self.name,), first * cols)]

    def blocks(self, canonical: Canonical, shard: torch.Tensor) -> Blocks:
        start = self.tp_rank * self._rows_local
        stop = min(start + self._rows_local, self.canonical_shape[0])
        if stop <= start:
            return []
        return [(self.name, canonical[self.name][start:stop], shard[: stop - start])]


@dataclass(frozen=True, slots=True)
class RowParallel(AffineMapping):
    """Split along dim 1: local ``(i, j)`` of rank ``r`` is canonical ``(i, r*cols_local + j)``."""

    name: str
    canonical_shape: tuple[int, int]
    tp_rank: int
    tp_size: int

    @property
    def source_shape(self) -> tuple[int, ...]:
        rows, cols = self.canonical_shape
        return (rows, _divide(cols, self.tp_size, self.name))

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name,)

    def project(self, local: Index) -> list[Destination]:
        cols = self.canonical_shape[1]
        cols_local = self.source_shape[1]
        i, j = np.divmod(local, cols_local)
        return [Destination(name=self.name, indices=i * cols + self.tp_rank * cols_local + j)]

    def segments(self) -> list[Segment]:
        cols = self.canonical_shape[1]
        cl = self.source_shape[1]
        if cl == cols:
            return [Segment(0, self.numel, (self.name,), 0)]
        return [Segment(0, self.numel, (self.name,), self.tp_rank * cl, period=cl, gap=cols - cl)]

    def blocks(self, canonical: Canonical, shard: torch.Tensor) -> Blocks:
        cl = self.source_shape[1]
        cols = slice(self.tp_rank * cl, (self.tp_rank + 1) * cl)
        return [(self.name, canonical[self.name][:, cols], shard)]


@dataclass(frozen=True, slots=True)
class GatedMLP(AffineMapping):
    """Megatron ``linear_fc1 = [gate_r; up_r]`` on rank ``r`` -> ``gate_proj`` and ``up_proj``.

    Local rows ``[0, f)`` are gate rows ``r * f + i``; rows ``[f, 2f)`` are up rows
    ``r * f + i - f``, with ``f`` the per-rank intermediate size.
    """

    gate_name: str
    up_name: str
    canonical_shape: tuple[int, ...]
    tp_rank: int
    tp_size: int

    @property
    def source_shape(self) -> tuple[int, ...]:
        f = _divide(self.canonical_shape[0], self.tp_size, self.gate_name)
        return (2 * f, *self.canonical_shape[1:])

    @property
    def names(self) -> tuple[str, ...]:
        return (self.gate_name, self.up_name)

    def project(self, local: Index) -> list[Destination]:
        cols = _cols(self.canonical_shape)
        half = self.source_shape[0] // 2 * cols
        offset = self.tp_rank * half
        up = local >= half
        if not up.any():
            return [Destination(name=self.gate_name, indices=local + offset)]
        if up.all():
            return [Destination(name=self.up_name, indices=local - half + offset)]
        g = np.flatnonzero(~up)
        u = np.flatnonzero(up)
        return [
            Destination(name=self.gate_name, indices=local[g] + offset, select=g),
            Destination(name=self.up_name, indices=local[u] - half + offset, select=u),
        ]

    def segments(self) -> list[Segment]:
        cols = _cols(self.canonical_shape)
        half = self.source_shape[0] // 2 * cols
        offset = self.tp_rank * half
        return [
            Segment(0, half, (self.gate_name,), offset),
            Segment(half, 2 * half, (self.up_name,), offset - half),
        ]

    def blocks(self, canonical: Canonical, shard: torch.Tensor) -> Blocks:
        f = self.source_shape[0] // 2
        rows = slice(self.tp_rank * f, (self.tp_rank + 1) * f)
        return [
            (self.gate_name, canonical[self.gate_name][rows], shard[:f]),
            (self.up_name, canonical[self.up_name][rows], shard[f:]),
        ]


@dataclass(frozen=True, slots=True)
class FusedQKV(AffineMapping):
    """Megatron's fused ``linear_qkv`` as a per-element permutation into q/k/v projections.

    With ``G`` query groups (= key/value heads) and ``G >= tp``, rank ``r`` holds groups
    ``[r*G/tp, (r+1)*G/tp)``, each stored as ``[q heads of the group; k; v]`` rows of
    ``head_dim`` each.  With ``G < tp`` each rank holds ``heads/tp`` query heads followed by the
    one key/value head of its group, which ``tp/G`` ranks replicate; only the first rank of
    each such group projects the key/value rows (the others drop them).  Every element maps to
    exactly one canonical row, so QKV needs no residual conversion.  ``inner`` is the shape of
    one row (``(hidden,)`` for weights, ``()`` for biases).
    """

    q_name: str
    k_name: str
    v_name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    inner: tuple[int, ...]
    tp_rank: int
    tp_size: int

    def __post_init__(self) -> None:
        _divide(self.num_heads, self.num_kv_heads, f"{self.q_name}: heads per group")
        if self.num_kv_heads >= self.tp_size:
            _divide(self.num_kv_heads, self.tp_size, f"{self.q_name}: query groups per rank")
        else:
            _divide(self.tp_size, self.num_kv_heads, f"{self.q_name}: ranks per group")
            _divide(self.num_heads, self.tp_size, f"{self.q_name}: heads per rank")

    @property
    def _rows_local(self) -> int:
        if self.num_kv_heads >= self.tp_size:
            groups = self.num_kv_heads // self.tp_size
            return groups * (self.num_heads // self.num_kv_heads + 2) * self.head_dim
        return (self.num_heads // self.tp_size + 2) * self.head_dim

    @property
    def source_shape(self) -> tuple[int, ...]:
        return (self._rows_local, *self.inner)

    @property
    def names(self) -> tuple[str, ...]:
        return (self.q_name, self.k_name, self.v_name)

    def project(self, local: Index) -> list[Destination]:
        d = self.head_dim
        cols = math.prod(self.inner)
        row, col = np.divmod(local, cols)
        q_base: Index | int
        kv_base: Index | int
        if self.num_kv_heads >= self.tp_size:
            q_rows = self.num_heads // self.num_kv_heads * d  # query rows per group
            groups_local = self.num_kv_heads // self.tp_size
            gl, w = np.divmod(row, q_rows + 2 * d)
            g = self.tp_rank * groups_local + gl
            q_base, kv_base, emit_kv = g * q_rows, g * d, True
        else:
            q_rows = self.num_heads // self.tp_size * d  # query rows on this rank
            ranks_per_group = self.tp_size // self.num_kv_heads
            w = row
            q_base = self.tp_rank * q_rows
            kv_base = self.tp_rank // ranks_per_group * d
            emit_kv = self.tp_rank % ranks_per_group == 0
        is_q = w < q_rows
        is_k = (w >= q_rows) & (w < q_rows + d)
        parts = [(self.q_name, is_q, q_base + w)]
        if emit_kv:
            parts.append((self.k_name, is_k, kv_base + w - q_rows))
            parts.append((self.v_name, ~is_q & ~is_k, kv_base + w - q_rows - d))
        out = []
        for name, mask, canon_row in parts:
            sel = np.flatnonzero(mask)
            if sel.size:
                out.append(
                    Destination(name=name, indices=canon_row[sel] * cols + col[sel], select=sel)
                )
        return out

    def segments(self) -> list[Segment]:
        d = self.head_dim
        cols = math.prod(self.inner)
        out = []
        if self.num_kv_heads >= self.tp_size:
            q_rows = self.num_heads // self.num_kv_heads * d
            groups_local = self.num_kv_heads // self.tp_size
            for gl in range(groups_local):
                g = self.tp_rank * groups_local + gl
                row = gl * (q_rows + 2 * d)
                out.append(
                    Segment(
                        row * cols, (row + q_rows) * cols, (self.q_name,), (g * q_rows - row) * cols
                    )
                )
                row += q_rows
                out.append(
                    Segment(row * cols, (row + d) * cols, (self.k_name,), (g * d - row) * cols)
                )
                row += d
                out.append(
                    Segment(row * cols, (row + d) * cols, (self.v_name,), (g * d - row) * cols)
                )
            return out
        q_rows = self.num_heads // self.tp_size * d
        ranks_per_group = self.tp_size // self.num_kv_heads
        out.append(Segment(0, q_rows * cols, (self.q_name,), self.tp_rank * q_rows * cols))
        if self.tp_rank % ranks_per_group == 0:
            kv = self.tp_rank // ranks_per_group * d
            out.append(
                Segment(q_rows * cols, (q_rows + d) * cols, (self.k_name,), (kv - q_rows) * cols)
            )
            out.append(
                Segment(
                    (q_rows + d) * cols,
                    (q_rows + 2 * d) * cols,
                    (self.v_name,),
                    (kv - q_rows - d) * cols,
                )
            )
        return out

    def _blocks(self, canonical: Canonical, shard: torch.Tensor, *, kv: bool) -> Blocks:
        d = self.head_dim
        q, k, v = canonical[self.q_name], canonical[self.k_name], canonical[self.v_name]
        if self.num_kv_heads >= self.tp_size:
            groups = self.num_kv_heads
            qg = self.num_heads // groups * d
            local = groups // self.tp_size
            g0 = self.tp_rank * local
            s = shard.view(local, qg + 2 * d, *self.inner)
            return [
                (self.q_name, q.view(groups, qg, *self.inner)[g0 : g0 + local], s[:, :qg]),
                (self.k_name, k.view(groups, d, *self.inner)[g0 : g0 + local], s[:, qg : qg + d]),
                (self.v_name, v.view(groups, d, *self.inner)[g0 : g0 + local], s[:, qg + d :]),
            ]
        qr = self.num_heads // self.tp_size * d
        out = [(self.q_name, q[self.tp_rank * qr : (self.tp_rank + 1) * qr], shard[:qr])]
        if kv:
            g = self.tp_rank // (self.tp_size // self.num_kv_heads)
            out.append((self.k_name, k[g * d : (g + 1) * d], shard[qr : qr + d]))
            out.append((self.v_name, v[g * d : (g + 1) * d], shard[qr + d :]))
        return out

    def blocks(self, canonical: Canonical, shard: torch.Tensor) -> Blocks:
        owns_kv = (
            self.num_kv_heads >= self.tp_size
            or self.tp_rank % (self.tp_size // self.num_kv_heads) == 0
        )
        return self._blocks(canonical, shard, kv=owns_kv)

    def source_blocks(self, canonical: Canonical, shard: torch.Tensor) -> Blocks:
        return self._blocks(canonical, shard, kv=True)
