"""Planned writes: the bits each intercepted copy puts into resident storage, and where.

Apply never executes the loader's dense ``copy_``.  Each intercepted copy becomes a
:class:`WritePlan`: element positions in the destination storage and one value per position.
On bit-preserving copies the plan keeps the entries and the copy's :class:`IndexMap` and maps
them chunk by chunk while it writes (cost ~ entries, no position array for the whole item);
transforming copies, broadcasts and in-layout casts are planned with their positions and values
already computed (they depend on the loader's output, which the next loader call replaces).

Every plan of a payload is built and checked before the first write (deferred writes, paper
App. A.2); :func:`~dcr.apply.execution.execute` then performs them as fused read-modify-write
chunks (:mod:`dcr.apply.rmw`) -- a chunk's cache lines are read and written while they are
hot -- on up to ``threads`` cores.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from dcr.apply.geometry import Box, IndexMap, byte_intervals, enumerate_map, overlapping_groups
from dcr.apply.hook import InterceptedCopy
from dcr.apply.scratch import torch_bits, torch_index
from dcr.tensors.bits import bits_dtype
from dcr.tensors.records import Span

__all__ = [
    "CHUNK",
    "Entries",
    "FlatViews",
    "WritePlan",
    "Words",
    "active_mask",
    "BLOCK",
    "cast_bits",
    "copies_overlap",
    "entries_of",
    "irregular",
    "plan_enumerated",
    "plan_in_layout",
    "plan_block",
    "plan_masked",
    "plan_sparse",
]

_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}

CHUNK = 1 << 16
"""Entries per read-modify-write chunk: big enough to amortize the per-op cost (~1 ns per
entry), small enough that the chunk's destination cache lines stay in cache between the read
and the write."""


Words = npt.NDArray[np.unsignedinteger[Any]]


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Entries:
    """A group's sorted flat canonical indices and their value bits (the item dtype's width).

    The indices are ``listed``, or, when ``listed`` is ``None``, implied: the run ``start ..
    start+count-1`` (a dense refit's form: block writes, no index per entry), or with
    ``period`` rows of ``period`` elements ``period + gap`` apart (a
    :class:`~dcr.tensors.records.Span`: a row-parallel training rank's columns sent whole).
    """

    values: Words
    dtype: torch.dtype
    listed: npt.NDArray[np.int64] | None = None
    start: int = 0
    period: int = 0
    gap: int = 0

    @property
    def count(self) -> int:
        return int(self.values.shape[0])

    @property
    def run(self) -> bool:
        """Whether the entries are one run of consecutive elements, not listed."""
        return self.listed is None and not self.gap

    @property
    def strided(self) -> bool:
        """Whether the entries are implied rows spread ``period + gap`` apart."""
        return self.listed is None and bool(self.gap)

    @property
    def indices(self) -> npt.NDArray[np.int64]:
        """Every index (for a run, a new array: paths whose cost is O(view) anyway)."""
        return self.locate(0, self.count)

    def locate(self, lo: int, hi: int) -> npt.NDArray[np.int64]:
        """Indices of entries ``lo .. hi-1``."""
        if self.listed is not None:
            return self.listed[lo:hi]
        if self.gap:
            return Span(self.start, self.period, self.gap).locate(lo, hi)
        return np.arange(self.start + lo, self.start + hi, dtype=np.int64)

    @property
    def where(self) -> npt.NDArray[np.int64] | slice:
        """The entries' positions in a flat canonical tensor: the listed indices, or a slice."""
        if self.listed is not None or self.gap:
            return self.locate(0, self.count)
        return slice(self.start, self.start + self.count)

    def as_listed(self) -> Entries:
        """The same entries with their indices listed (strided rows for paths that need an
        index per entry)."""
        if not self.strided:
            return self
        return Entries(values=self.values, dtype=self.dtype, listed=self.indices)


def _flat_bits(dst: torch.Tensor) -> torch.Tensor:
    """The whole storage behind ``dst`` as a 1-D integer view of ``dst``'s width."""
    n = int(dst.untyped_storage().nbytes()) // dst.element_size()
    return dst.detach().as_strided((n,), (1,), 0).view(bits_dtype(dst.dtype))


class FlatViews:
    """Flat integer views of resident storages, built once per storage and dtype.

    Keyed by storage pointer: the receiver's storage guard proves resident storages never move
    while it applies, and a cached view keeps its storage alive, so a key is never reused.
    """

    def __init__(self) -> None:
        self._views: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self._words: dict[tuple[int, torch.dtype], Words] = {}

    def of(self, dst: torch.Tensor) -> torch.Tensor:
        key = (int(dst.untyped_storage().data_ptr()), dst.dtype)
        flat = self._views.get(key)
        if flat is None:
            flat = self._views[key] = _flat_bits(dst)
        return flat

    def words_of(self, dst: torch.Tensor) -> Words | None:
        """The flat view of :meth:`of` as numpy words, for CPU storages (else ``None``)."""
        if dst.device.type != "cpu":
            return None
        key = (int(dst.untyped_storage().data_ptr()), dst.dtype)
        words = self._words.get(key)
        if words is None:
            words = self._words[key] = _words(self.of(dst))
        return words


def _words(t: torch.Tensor) -> Words:
    """A torch integer bit view (any device) as numpy unsigned words of the same width."""
    out: Words = t.detach().cpu().numpy().view(_UNSIGNED[t.element_size()])
    return out


def _torch_words(words: Words, device: torch.device) -> torch.Tensor:
    return torch_bits(words, device)


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class WritePlan:
    """The writes of one intercepted copy into one resident storage.

    Either *mapped* (``imap`` and ``entries``: positions are computed per chunk at execution;
    ``cast`` converts overwrite values to the destination dtype) or *materialized*
    (``positions`` and ``values``).  ``values`` are XOR masks, ULP deltas or new stored bits,
    in the integer type of the destination's width.
    """

    label: str
    flat: torch.Tensor
    itemsize: int
    words: Words | None = None
    """``flat`` as numpy words (CPU storages)."""
    imap: IndexMap | None = None
    entries: Entries | None = None
    cast: torch.dtype | None = None
    positions: npt.NDArray[np.int64] | None = None
    values: Words | None = None
    blocks: tuple[Box, ...] | None = None
    """*Block* plans (a run of entries through a nested view, no cast): the blocks of
    :meth:`IndexMap.boxes`, cut into pieces of at most :data:`BLOCK` elements; ``values``
    are the run's values."""

    @property
    def size(self) -> int:
        """Entries (mapped), positions (materialized) or blocks the plan iterates over."""
        if self.blocks is not None:
            return len(self.blocks)
        if self.entries is not None:
            return self.entries.count
        assert self.positions is not None
        return int(self.positions.shape[0])

    @property
    def step(self) -> int:
        """What one task of :func:`execute` takes: :data:`CHUNK` entries, or one block."""
        return 1 if self.blocks is not None else CHUNK

    def chunk(self, start: int, stop: int) -> tuple[npt.NDArray[np.int64], Words]:
        """Destination positions (storage elements) and their values for one chunk."""
        if self.entries is None:
            assert self.positions is not None and self.values is not None
            return self.positions[start:stop], self.values[start:stop]
        assert self.imap is not None
        sel, where = self.imap.select(self.entries.locate(start, stop))
        values = self.entries.values[start:stop][sel]  # a slice for a run of entries: no copy
        if self.cast is not None:
            values = _words(cast_bits(torch_bits(values), self.entries.dtype, self.cast))
        return where, values


def _plan(
    copy: InterceptedCopy,
    flats: FlatViews,
    *,
    imap: IndexMap | None = None,
    entries: Entries | None = None,
    cast: torch.dtype | None = None,
    positions: npt.NDArray[np.int64] | None = None,
    values: Words | None = None,
    blocks: tuple[Box, ...] | None = None,
) -> WritePlan:
    return WritePlan(
        label=copy.storage.label,
        flat=flats.of(copy.dst),
        itemsize=copy.dst_geometry.itemsize,
        words=flats.words_of(copy.dst),
        imap=imap,
        entries=entries,
        cast=cast,
        positions=positions,
        values=values,
        blocks=blocks,
    )


def cast_bits(values: torch.Tensor, src: torch.dtype, dst: torch.dtype) -> torch.Tensor:
    """Bits of ``src`` values cast to ``dst`` exactly as ``copy_`` casts them."""
    if src == dst:
        return values
    out = torch.empty(values.shape, dtype=dst, device=values.device)
    out.copy_(values.view(src))
    return out.view(bits_dtype(dst))


def irregular(values: npt.NDArray[np.generic], dtype: torch.dtype) -> bool:
    """Whether any value (bits of ``dtype``) is a NaN or a subnormal.

    torch casts such values differently in its vectorized and scalar loops (seen on CPU:
    float16 -> float32 NaN payloads, float32 -> bfloat16 NaNs), so their cast depends on the
    element's position in the copy, not on the value alone.
    """
    if not dtype.is_floating_point or values.size == 0:
        return False
    mantissa = round(-math.log2(torch.finfo(dtype).eps))
    width = torch.finfo(dtype).bits
    top = (1 << (width - 1 - mantissa)) - 1
    v = values.astype(np.uint64, copy=False)
    exponent = (v >> np.uint64(mantissa)) & np.uint64(top)
    fraction = v & np.uint64((1 << mantissa) - 1)
    odd = ((exponent == 0) | (exponent == top)) & (fraction != 0)
    return bool(odd.any())


def _cast_in_place_of(copy: InterceptedCopy, src: torch.Tensor) -> torch.Tensor:
    """``src`` cast by a ``copy_`` into a tensor laid out exactly like the destination view.

    Same sizes and strides give the cast the same loop structure as the loader's own copy, so
    every element is converted exactly as a dense load converts it.  Returns the 1-D bits of the
    new tensor's storage, indexed like the destination storage minus its offset.
    """
    g = copy.dst_geometry
    out = torch.empty_strided(g.shape, g.stride, dtype=g.dtype, device=src.device)
    out.copy_(src)
    n = int(out.untyped_storage().nbytes()) // out.element_size()
    return out.as_strided((n,), (1,), 0).view(bits_dtype(g.dtype))


def plan_sparse(
    copy: InterceptedCopy, flats: FlatViews, imap: IndexMap, entries: Entries, *, relative: bool
) -> WritePlan:
    """A mapped plan: the entries go through ``imap`` straight to destinations at execution.

    Relative values (XOR masks, ULP deltas) are written as they are (the path preserves the
    dtype); overwrite values through a cast are converted on their own, entry by entry.
    """
    dst = copy.dst_geometry.dtype
    cast = None if relative or dst == entries.dtype else dst
    return _plan(copy, flats, imap=imap, entries=entries, cast=cast)


BLOCK = 1 << 24
"""Elements per block task: big enough that a task is one long copy whose Python hand-off is
negligible (a dense 1.16 GB refit applied in 0.86-0.91x a dense load with 16 M, 0.92-0.97x
with 4 M and 1.02x with 1 M elements per task, on two cores), small enough that a large
tensor's blocks spread over every core."""


def _pieces(box: Box, limit: int) -> list[Box]:
    """``box`` cut along its outer dimensions into blocks of at most ``limit`` elements
    (a one-dimensional box into slices)."""
    dst, src, dims = box
    total = math.prod(n for n, _, _ in dims)
    if total <= limit:
        return [box]
    size, dst_stride, src_stride = dims[0]
    inner = total // size
    if inner > limit:
        return [
            piece
            for i in range(size)
            for piece in _pieces((dst + i * dst_stride, src + i * src_stride, dims[1:]), limit)
        ]
    step = max(1, limit // inner)
    return [
        (
            dst + i * dst_stride,
            src + i * src_stride,
            ((min(step, size - i), *dims[0][1:]), *dims[1:]),
        )
        for i in range(0, size, step)
    ]


def plan_block(
    copy: InterceptedCopy, flats: FlatViews, imap: IndexMap, entries: Entries
) -> WritePlan:
    """A block plan: a run of entries through a nested view of the same dtype.

    The run is one flat range of the view's elements (:meth:`IndexMap.boxes`), so its writes
    are block copies (overwrite) or block read-modify-writes (XOR, ULP) straight from the
    run's values: no index per entry, near memory-copy speed.
    """
    boxes = (
        _strided_boxes(imap, entries)
        if entries.strided
        else imap.boxes(entries.start, entries.count)
    )
    return _plan(
        copy,
        flats,
        values=entries.values,
        blocks=tuple(p for box in boxes for p in _pieces(box, BLOCK)),
    )


def block_mappable(imap: IndexMap, entries: Entries) -> bool:
    """Whether ``entries`` go through ``imap`` as blocks: a run always; strided rows when
    the view is one run of consecutive source elements holding every row (an unsharded
    destination), or when one row step is one step of the view's outermost dimension and no
    row crosses it (a sliced or fused view of whole rows: every row lands as the same blocks,
    shifted)."""
    if entries.run:
        return True
    if not entries.strided or not imap.dims:
        return False
    if _one_run(imap):
        last = int(entries.locate(entries.count - 1, entries.count)[0])
        return imap.src_offset <= entries.start and last <= imap.src_offset + imap.src_span
    pitch = entries.period + entries.gap
    return imap.dims[0][0] == pitch and (entries.start - imap.src_offset) % pitch + (
        entries.period) <= pitch  # fmt: skip


def _one_run(imap: IndexMap) -> bool:
    return len(imap.dims) == 1 and imap.dims[0][0] == 1


def _strided_boxes(imap: IndexMap, entries: Entries) -> list[Box]:
    """Blocks of strided rows (:func:`block_mappable`): through a one-run view, the whole
    rows as one two-dimensional block and a last partial row as another; through a view
    whose outermost step is a row, the blocks of one row with the rows inside the view as an
    outer dimension."""
    period, pitch = entries.period, entries.period + entries.gap
    rows, rest = divmod(entries.count, period)
    out: list[Box] = []
    if _one_run(imap):
        step = imap.dims[0][2]

        def dst(c: int) -> int:
            return imap.dst_offset + (c - imap.src_offset) * step

        if rows:
            dims = ((rows, pitch * step, period), (period, step, 1))
            out.append((dst(entries.start), 0, tuple(d for d in dims if d[0] > 1)))
        if rest:
            at = entries.start + rows * pitch
            out.append((dst(at), rows * period, ((rest, step, 1),) if rest > 1 else ()))
        return out
    # Row r's outermost digit is q + r; its lower digits are the same for every row.
    _, size, dst_stride = imap.dims[0]
    q = (entries.start - imap.src_offset) // pitch
    lo, hi = max(0, -q), min(rows + (1 if rest else 0), size - q)
    whole = min(rows, hi)
    if whole > lo:
        n = whole - lo
        outer = ((n, dst_stride, period),) if n > 1 else ()
        for at, src, inner in imap.boxes(entries.start + lo * pitch, period):
            out.append((at, src + lo * period, outer + inner))
    if rest and lo <= rows < hi:
        tail = imap.boxes(entries.start + rows * pitch, rest)
        out.extend((at, src + rows * period, inner) for at, src, inner in tail)
    return out


def plan_enumerated(
    copy: InterceptedCopy, flats: FlatViews, entries: Entries, *, relative: bool
) -> WritePlan:
    """A materialized plan for a scratch source of another geometry (a broadcast): O(view)."""
    sel, pos = enumerate_map(copy.src_geometry, copy.dst_geometry, entries.indices)
    values = entries.values[sel]
    if not relative and copy.dst_geometry.dtype != entries.dtype:
        values = _words(cast_bits(torch_bits(values), entries.dtype, copy.dst_geometry.dtype))
    return _plan(copy, flats, positions=pos, values=values)


def plan_in_layout(
    copy: InterceptedCopy, flats: FlatViews, imap: IndexMap | None, entries: Entries
) -> WritePlan:
    """Overwrite values cast as a whole in the destination's layout (scratch holds them).

    Needed for :func:`irregular` values through a cast; costs O(view).  Materialized now,
    while the copy input still holds this item's values.
    """
    if imap is not None:
        _, pos = imap.map(entries.indices)
    else:
        _, pos = enumerate_map(copy.src_geometry, copy.dst_geometry, entries.indices)
    cast = _cast_in_place_of(copy, copy.src)
    values = _words(cast[torch_index(pos - copy.dst_geometry.offset, cast.device)])
    return _plan(copy, flats, positions=pos, values=values)


def active_mask(copy: InterceptedCopy) -> torch.Tensor:
    """Positions of the destination view whose copy input is not the NaN placeholder."""
    return ~torch.isnan(copy.src.expand(copy.dst_geometry.shape))


def plan_masked(copy: InterceptedCopy, flats: FlatViews, active: torch.Tensor) -> WritePlan:
    """Overwrite the ``active`` positions (an :func:`active_mask`) with the copy input.

    The copy input holds the real values (the same call in the NaN scheme, the second pass in
    the two-pass scheme) and is cast in the destination's layout.
    """
    g = copy.dst_geometry
    where = active.nonzero()
    stride = torch.tensor(g.stride, dtype=torch.int64, device=where.device)
    rel = (where * stride).sum(dim=1)
    cast = _cast_in_place_of(copy, copy.src)
    return _plan(
        copy,
        flats,
        positions=rel.cpu().numpy() + g.offset,
        values=_words(cast[rel.to(cast.device)]),
    )


def copies_overlap(copies: Sequence[InterceptedCopy]) -> bool:
    """Whether two of the copies' destination views share a byte (from geometry alone)."""
    if len(copies) < 2:
        return False
    big = max(c.storage.nbytes for c in copies) + 1
    starts, ends = [], []
    for c in copies:
        s, e = byte_intervals(c.dst_geometry)
        starts.append(s + c.storage.index * big)
        ends.append(e + c.storage.index * big)
    start, end = np.concatenate(starts), np.concatenate(ends)
    return bool(overlapping_groups(start, end, np.zeros(start.shape, dtype=np.int64)))


def entries_of(indices: npt.NDArray[np.int64] | int, values: Words, dtype: torch.dtype) -> Entries:
    """:class:`Entries` from an item's (or a merged group's) numpy arrays; an int is the
    start of a run of ``len(values)`` entries."""
    if isinstance(indices, int):
        return Entries(values=values, dtype=dtype, start=indices)
    return Entries(values=values, dtype=dtype, listed=indices)
