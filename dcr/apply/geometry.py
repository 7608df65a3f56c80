"""Geometry of the loader's writes: where a view's elements lie in its storage.

The receiver never interprets model structure; it only reads the geometry of the views the
native loader copies between (storage offset, sizes, strides).  From that geometry it maps an
item's flat canonical indices straight to destination positions (the sparse path of
``docs/architecture.md``, "Receiver data plane") and computes the byte footprint of every
write for the overlap rules of paper App. A.2 ("Write overlap").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

__all__ = [
    "Box",
    "IndexMap",
    "ViewGeometry",
    "byte_intervals",
    "enumerate_map",
    "overlapping_groups",
]

Int64Array = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True, kw_only=True)
class ViewGeometry:
    """Where a view's elements lie: ``storage`` label, element ``offset``, ``shape``, ``stride``.

    ``offset`` and ``stride`` count elements of ``dtype``, as ``Tensor.storage_offset()`` and
    ``Tensor.stride()`` do.  ``storage`` names the storage (a protected tensor's name,
    ``"scratch"``, or ``"other"`` for a loader temporary).
    """

    storage: str
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, t: torch.Tensor, storage: str) -> ViewGeometry:
        return cls(
            storage=storage,
            offset=int(t.storage_offset()),
            shape=tuple(t.shape),
            stride=t.stride(),
            dtype=t.dtype,
        )

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return int(self.dtype.itemsize)

    def broadcast_to(self, shape: tuple[int, ...]) -> ViewGeometry:
        """The geometry ``copy_`` reads when it broadcasts this source to ``shape``."""
        if shape == self.shape:
            return self
        lead = len(shape) - len(self.shape)
        sizes = (1,) * lead + self.shape
        strides = (0,) * lead + self.stride
        out = tuple(
            0 if size == 1 and want != 1 else stride
            for size, stride, want in zip(sizes, strides, shape, strict=True)
        )
        return ViewGeometry(
            storage=self.storage, offset=self.offset, shape=shape, stride=out, dtype=self.dtype
        )

    def element_span(self) -> tuple[int, int] | None:
        """Smallest and largest element offset the view touches, or ``None`` when empty."""
        if self.numel == 0:
            return None
        top = sum((s - 1) * t for s, t in zip(self.shape, self.stride, strict=True))
        return self.offset, self.offset + top

    def positions(self) -> Int64Array:
        """Element offset of every view element, in C order (``numel`` entries)."""
        pos = np.full(self.shape, self.offset, dtype=np.int64)
        for dim, (size, stride) in enumerate(zip(self.shape, self.stride, strict=True)):
            shape = [1] * len(self.shape)
            shape[dim] = size
            pos += (np.arange(size, dtype=np.int64) * stride).reshape(shape)
        return pos.reshape(-1)


def _sorted_dims(shape: tuple[int, ...], stride: tuple[int, ...]) -> list[tuple[int, int]]:
    """``(stride, size)`` of the dimensions of size > 1, outermost (largest stride) first."""
    dims = [(t, s) for s, t in zip(shape, stride, strict=True) if s > 1]
    dims.sort(key=lambda d: -d[0])
    return dims


def byte_intervals(g: ViewGeometry) -> tuple[Int64Array, Int64Array]:
    """Half-open byte ranges ``[start, end)`` covering the view's elements in its storage.

    Dimensions that are contiguous in memory are merged, so a contiguous slice is one range and
    a column slice of a matrix is one range per row.
    """
    if g.numel == 0:
        empty = np.empty(0, dtype=np.int64)
        return empty, empty
    dims = _sorted_dims(g.shape, g.stride)
    merged: list[tuple[int, int]] = []
    for stride, size in reversed(dims):
        if merged and stride == merged[-1][0] * merged[-1][1]:
            inner_stride, inner_size = merged[-1]
            merged[-1] = (inner_stride, inner_size * size)
        else:
            merged.append((stride, size))
    run = 1
    if merged and merged[0][0] == 1:
        run = merged.pop(0)[1]
    starts = np.array([g.offset], dtype=np.int64)
    for stride, size in merged:
        starts = (starts[:, None] + np.arange(size, dtype=np.int64)[None, :] * stride).reshape(-1)
    starts *= g.itemsize
    return starts, starts + run * g.itemsize


def overlapping_groups(
    starts: Int64Array, ends: Int64Array, labels: Int64Array
) -> list[npt.NDArray[np.int64]]:
    """Labels of every connected group of overlapping intervals that holds two or more intervals.

    In a connected group of intervals with two or more distinct labels, every label overlaps some
    interval of another label, so callers can mark all labels of such a group.
    """
    keep = ends > starts
    starts, ends, labels = starts[keep], ends[keep], labels[keep]
    if starts.size < 2:
        return []
    order = np.argsort(starts, kind="stable")
    s, e, lab = starts[order], ends[order], labels[order]
    reach = np.maximum.accumulate(e)
    new_group = np.ones(s.shape, dtype=bool)
    new_group[1:] = s[1:] >= reach[:-1]
    group = np.cumsum(new_group) - 1
    sizes = np.bincount(group)
    return [lab[group == g] for g in np.flatnonzero(sizes > 1)]


@dataclass(frozen=True, slots=True)
class IndexMap:
    """Maps canonical flat indices through one copy's source view to destination positions.

    Built for a copy whose source is a view of the scratch region of an item (so a flat canonical
    index equals the element offset in scratch) and whose geometry is *nested*: sorted by stride,
    each stride exceeds the span of all smaller-stride dimensions.  Then every offset has at most
    one multi-index, found by a mixed-radix decomposition; an index without one lies outside the
    view (e.g. another tensor-parallel rank's rows).  Cost scales with the number of indices.
    """

    src_offset: int
    src_span: int
    dst_offset: int
    dims: tuple[tuple[int, int, int], ...]  # (source stride, size, destination stride)

    @classmethod
    def build(cls, src: ViewGeometry, dst: ViewGeometry) -> IndexMap | None:
        """The map for ``src`` (already broadcast to ``dst.shape``) or ``None`` if not nested."""
        triples = [
            (t, s, d) for s, t, d in zip(src.shape, src.stride, dst.stride, strict=True) if s > 1
        ]
        triples.sort(key=lambda x: -x[0])
        span = 0
        for t, s, _ in reversed(triples):
            if t <= span:
                return None
            span += (s - 1) * t
        merged: list[tuple[int, int, int]] = []
        for t, s, d in reversed(triples):
            if merged:
                it, isz, idst = merged[-1]
                if t == it * isz and d == idst * isz:
                    merged[-1] = (it, isz * s, idst)
                    continue
            merged.append((t, s, d))
        merged.reverse()
        return cls(src_offset=src.offset, src_span=span, dst_offset=dst.offset, dims=tuple(merged))

    def map(self, indices: Int64Array) -> tuple[Int64Array, Int64Array]:
        """``(entry numbers, destination element offsets)`` of the sorted ``indices`` in view."""
        sel, pos = self.select(indices)
        if isinstance(sel, slice):
            return np.arange(sel.start, sel.stop, dtype=np.int64), pos
        return sel, pos

    def select(self, indices: Int64Array) -> tuple[slice | Int64Array, Int64Array]:
        """Like :meth:`map`, but a run of consecutive entries comes back as a ``slice``.

        One run of consecutive elements (a row block, a whole tensor) costs one pass over the
        entries, or none when source and destination offsets agree (a view of ``indices``).
        """
        lo = int(np.searchsorted(indices, self.src_offset, side="left"))
        hi = int(np.searchsorted(indices, self.src_offset + self.src_span, side="right"))
        if len(self.dims) == 1 and self.dims[0][0] == 1:
            # One run of consecutive elements: every index in the span is in the view.
            step = self.dims[0][2]
            if step == 1 and self.src_offset == self.dst_offset:
                return slice(lo, hi), indices[lo:hi]
            shifted = indices[lo:hi] - self.src_offset
            if step != 1:
                shifted *= step
            if self.dst_offset:
                shifted += self.dst_offset
            return slice(lo, hi), shifted
        rest: Int64Array | None = indices[lo:hi] - self.src_offset
        count = hi - lo
        pos: Int64Array | None = None
        inside: npt.NDArray[np.bool_] | None = None
        for n, (stride, size, dst_stride) in enumerate(self.dims):
            assert rest is not None
            if stride == 1:
                digit, rest = rest, None
            else:
                digit, rest = np.divmod(rest, stride)
            if n:  # the span filter already bounds the outermost digit
                ok = digit < size
                inside = ok if inside is None else np.logical_and(inside, ok, out=inside)
            term = digit * dst_stride if dst_stride != 1 else digit
            pos = term + self.dst_offset if pos is None else np.add(pos, term, out=pos)
        if rest is not None:  # offsets between the innermost view elements
            ok = rest == 0
            inside = ok if inside is None else np.logical_and(inside, ok, out=inside)
        if pos is None:  # a single-element view
            pos = np.full(count, self.dst_offset, dtype=np.int64)
        if inside is None:
            return slice(lo, hi), pos
        hit = np.flatnonzero(inside)
        if hit.size == count:
            return slice(lo, hi), pos
        return hit + lo, pos[hit]

    def _below(self, x: int) -> int:
        """View elements whose source offset (relative to ``src_offset``) is below ``x``.

        Nested dimensions enumerate the view in increasing offset order, so this is a
        mixed-radix count, outermost digit first.
        """
        if not self.dims:
            return int(x > 0)
        n, inner = 0, math.prod(size for _, size, _ in self.dims)
        last = len(self.dims) - 1
        for i, (stride, size, _) in enumerate(self.dims):
            if x <= 0:
                return n
            inner //= size
            if i == last:
                return n + min(size, -(-x // stride))
            q = x // stride
            if q >= size:
                return n + size * inner
            n += q * inner
            x -= q * stride
        return n

    def boxes(self, start: int, count: int) -> list[Box]:
        """The view elements whose source offset lies in the run ``start .. start+count-1``,
        as blocks whose values are ``values[offset ...]`` of the run's values.

        Nested dimensions enumerate the view in increasing offset order, so the run is one
        flat range of the enumeration, at most two blocks per dimension plus one: the run's
        writes become block copies without an index per entry.
        """
        lo = self._below(start - self.src_offset)
        hi = self._below(start + count - self.src_offset)
        sizes = tuple(size for _, size, _ in self.dims)
        if not sizes:
            return [(self.dst_offset, self.src_offset - start, ())] if hi > lo else []
        out: list[Box] = []
        for first, shape in _flat_boxes(lo, hi, sizes):
            dst = self.dst_offset + sum(
                m * d for m, (_, _, d) in zip(first, self.dims, strict=True)
            )
            src = self.src_offset - start
            src += sum(m * t for m, (t, _, _) in zip(first, self.dims, strict=True))
            dims = tuple((n, d, t) for n, (t, _, d) in zip(shape, self.dims, strict=True) if n > 1)
            out.append((dst, src, dims))
        return out


Box = tuple[int, int, tuple[tuple[int, int, int], ...]]
"""A block of a copy: ``(destination offset, value offset, dims)``, ``dims`` the block's
``(size, destination stride, source stride)`` per dimension, outermost first (sizes above 1;
no dims: one element).  Element ``i`` (a multi-index) is destination
``offset + sum(i_d * destination stride_d)`` and value ``value offset + sum(i_d * source
stride_d)``."""


def _flat_boxes(
    lo: int, hi: int, sizes: tuple[int, ...]
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The C-order flat range ``[lo, hi)`` of an array of ``sizes`` as hyper-rectangles
    ``(first multi-index, shape)``: at most two per dimension plus one."""
    if lo >= hi:
        return []
    if len(sizes) == 1:
        return [((lo,), (hi - lo,))]
    inner = math.prod(sizes[1:])
    rest = sizes[1:]
    qa, ra = divmod(lo, inner)
    qb, rb = divmod(hi, inner)
    if qa == qb:
        return [((qa, *m), (1, *sh)) for m, sh in _flat_boxes(ra, rb, rest)]
    out = []
    if ra:
        out += [((qa, *m), (1, *sh)) for m, sh in _flat_boxes(ra, inner, rest)]
        qa += 1
    if qb > qa:
        out.append(((qa, *(0,) * len(rest)), (qb - qa, *rest)))
    if rb:
        out += [((qb, *m), (1, *sh)) for m, sh in _flat_boxes(0, rb, rest)]
    return out


def enumerate_map(
    src: ViewGeometry, dst: ViewGeometry, indices: Int64Array
) -> tuple[Int64Array, Int64Array]:
    """Like :meth:`IndexMap.map` for any source geometry (broadcasts, overlapping windows).

    Enumerates the view, so it costs O(view size); used only when :meth:`IndexMap.build`
    returns ``None``.  An entry may reach several destinations (a broadcast source).
    """
    canon = src.positions()
    pos = dst.positions()
    if indices.size == 0 or canon.size == 0:
        empty = np.empty(0, dtype=np.int64)
        return empty, empty
    k = np.searchsorted(indices, canon)
    k_clip = np.minimum(k, indices.size - 1)
    hit = indices[k_clip] == canon
    return k_clip[hit], pos[hit]
