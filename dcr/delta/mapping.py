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
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch

from dcr import native
from dcr.errors import LayoutError

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

Index = npt.NDArray[np.int64]
Canonical = Mapping[str, torch.Tensor]
Blocks = list[tuple[str, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Destination:
    """Where a subset of projected source elements lands.

    ``select`` picks positions of the input index array (``None``: all of them, in order);
    ``indices`` are the canonical flat indices of the selected elements, in the same order.
    """

    name: str
    indices: Index
    select: Index | None = None


@dataclass(frozen=True, slots=True)
class Segment:
    """A range of local flat indices that maps to canonical coordinates by one affine formula.

    Local ``j`` in ``[start, stop)`` lands at canonical ``j + offset`` when ``period`` is 0,
    else at ``j + (j // period) * gap + offset`` (row-parallel splits: rows of ``period``
    local elements spread ``period + gap`` apart); the same index lands in every tensor of
    ``names``.  Both formulas are strictly increasing in ``j``, so sorted local indices give
    sorted canonical ones.  :meth:`AffineMapping.segments` covers every projected element
    once and nothing else; construction scans segments block by block instead of projecting
    index arrays through :meth:`AffineMapping.project`.
    """

    start: int
    stop: int
    names: tuple[str, ...]
    offset: int
    period: int = 0
    gap: int = 0

    def canonical(self, local: Index) -> Index:
        """Canonical flat indices of local flat indices in this segment (a new array; one
        pass in C when :mod:`dcr.native` has its kernels)."""
        if not self.period:
            return local + self.offset
        k = native.kernels
        if k is not None and local.dtype == np.int64 and local.flags.c_contiguous:
            spread = np.empty(local.shape[0], dtype=np.int64)
            k.spread_rows(local, self.period, self.gap, self.offset, spread)
            return spread
        out = local // self.period
        out *= self.gap
        out += local
        out += self.offset
        return out

    def renamed(self, names: tuple[str, ...]) -> Segment:
        return Segment(self.start, self.stop, names, self.offset, self.period, self.gap)


def _divide(a: int, b: int, what: str) -> int:
    if b <= 0 or a % b:
        raise LayoutError(f"{what}: {a} is not divisible by {b}", check="divisibility")
    return a // b


def _cols(shape: tuple[int, ...]) -> int:
    """Elements per row (1 for 1-D tensors)."""
    return math.prod(shape[1:]) if len(shape) > 1 else 1


class AffineMapping(ABC):
    """A fixed map from one source shard's local flat indices to canonical coordinates."""

    @property
    @abstractmethod
    def source_shape(self) -> tuple[int, ...]:
        """Shape of the local source shard."""

    @property
    @abstractmethod
    def names(self) -> tuple[str, ...]:
        """Canonical tensors this mapping writes."""

    @abstractmethod
    def project(self, local: Index) -> list[Destination]:
        """Canonical destinations of the local flat indices ``local`` (int64, any order).

        Elements with no destination (vocabulary padding, replicated copies another rank
        projects) are dropped.
        """

    @abstractmethod
    def segments(self) -> list[Segment]:
        """The projected local elements as affine segments, in increasing local order.

        Equivalent to :meth:`project` (tests check one against the other); elements that
        :meth:`project` drops lie in no segment.
        """

    @abstractmethod
    def blocks(self, canonical: Canonical, shard: torch.Tensor) -> Blocks:
        """Triples ``(name, canonical view, shard view)`` covering exactly the projected elements.

        This is the dense counterpart of :meth:`project` (strided views instead of index
        arithmetic): full conversion copies shard views into canonical views with it, and
        tests check :meth:`project` against it.
        """

    def source_blocks(self, canonical: Canonical, shard: torch.Tensor) -> Blocks:
        """Triples covering every shard element that has a canonical source.

        Differs from :meth:`blocks` where a shard holds copies that another rank projects
        (key/value rows replicated across tensor-parallel ranks) or one element has several
        destinations (tied weights, where only the first is the source).
        """
        return self.blocks(canonical, shard)

    @property
    def numel(self) -> int:
        return math.prod(self.source_shape)


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
