"""Planned writes: the bits each intercepted copy puts into resident storage, and where.

Apply never executes the loader's dense ``copy_``.  Each intercepted copy becomes a
:class:`WritePlan`: element positions in the destination storage and one value per position.
On bit-preserving copies the plan keeps the entries and the copy's :class:`IndexMap` and maps
them chunk by chunk while it writes (cost ~ entries, no position array for the whole item);
transforming copies, broadcasts and in-layout casts are planned with their positions and values
already computed (they depend on the loader's output, which the next loader call replaces).

Every plan of a payload is built and checked before the first write (deferred writes, paper
App. A.2); :func:`execute` then performs them as fused read-modify-write chunks -- a chunk's
cache lines are read and written while they are hot -- on up to ``threads`` cores.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from numpy.lib.stride_tricks import as_strided

from dcr import native
from dcr.apply.call import Fail
from dcr.apply.geometry import Box, IndexMap, byte_intervals, enumerate_map, overlapping_groups
from dcr.apply.hook import InterceptedCopy
from dcr.apply.scratch import torch_bits, torch_index
from dcr.tensors.bits import bits_dtype
from dcr.tensors.ordered import add_ordered, ordered, unordered
from dcr.tensors.parallel import default_threads as usable_cpus
from dcr.tensors.records import Encoding

__all__ = [
    "CHUNK",
    "Entries",
    "Execution",
    "FlatViews",
    "WritePlan",
    "active_mask",
    "BLOCK",
    "cast_bits",
    "copies_overlap",
    "default_threads",
    "entries_of",
    "execute",
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

    The indices are ``listed``, or, when ``listed`` is ``None``, the run ``start ..
    start+count-1`` (a dense refit's form: block writes, no index per entry).
    """

    values: Words
    dtype: torch.dtype
    listed: npt.NDArray[np.int64] | None = None
    start: int = 0

    @property
    def count(self) -> int:
        return int(self.values.shape[0])

    @property
    def run(self) -> bool:
        return self.listed is None

    @property
    def indices(self) -> npt.NDArray[np.int64]:
        """Every index (for a run, a new array: paths whose cost is O(view) anyway)."""
        return self.locate(0, self.count)

    def locate(self, lo: int, hi: int) -> npt.NDArray[np.int64]:
        """Indices of entries ``lo .. hi-1``."""
        if self.listed is not None:
            return self.listed[lo:hi]
        return np.arange(self.start + lo, self.start + hi, dtype=np.int64)

    @property
    def where(self) -> npt.NDArray[np.int64] | slice:
        """The entries' positions in a flat canonical tensor: the listed indices, or a slice."""
        if self.listed is not None:
            return self.listed
        return slice(self.start, self.start + self.count)


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


BLOCK = 1 << 20
"""Elements per block task: big enough that a task is one long copy, small enough that a
large tensor's blocks spread over every core."""


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
    boxes = imap.boxes(entries.start, entries.count)
    return _plan(
        copy,
        flats,
        values=entries.values,
        blocks=tuple(p for box in boxes for p in _pieces(box, BLOCK)),
    )


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


# -- execution ---------------------------------------------------------------------------------

_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def default_threads() -> int:
    """Cores one apply uses by default: the CPUs this process may run on (its affinity
    mask), at most 8."""
    return min(usable_cpus(), 8)


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(
                max_workers=max(1, usable_cpus() - 1), thread_name_prefix="dcr-apply"
            )
        return _POOL


Stage = Sequence[tuple[WritePlan, Encoding]]
"""Plans whose destinations are pairwise disjoint: their chunks may run in any order."""


def _ulp_add(words: Words, delta: Words) -> Words:
    """``unordered(ordered(words) + delta)`` modulo the word width (numpy)."""
    o = ordered(words)
    np.add(o, delta, out=o)  # unsigned: wraps modulo 2**w
    return unordered(o)


def _write_numpy(
    flat: Words, pos: npt.NDArray[np.int64], values: Words, encoding: Encoding, check: bool
) -> int:
    """One fused read-modify-write chunk on a CPU storage; returns post-check failures.

    numpy's take and fancy assignment cost a fraction of torch's per-op overhead on the many
    small chunks of a payload, and run at the same speed on large ones.
    """
    if encoding is Encoding.OVERWRITE:
        flat[pos] = values
        return int(np.count_nonzero(np.take(flat, pos) != values)) if check else 0
    before = np.take(flat, pos)
    flat[pos] = before ^ values if encoding is Encoding.XOR else _ulp_add(before, values)
    if not check:
        return 0
    # Paper App. A.2 "Post-apply checks": undoing the relative value restores the saved bits.
    now = np.take(flat, pos)
    undone = now ^ values if encoding is Encoding.XOR else _ulp_add(now, -values)
    return int(np.count_nonzero(undone != before))


def _write_torch(
    flat: torch.Tensor, pos: torch.Tensor, values: torch.Tensor, encoding: Encoding, check: bool
) -> int:
    """:func:`_write_numpy` with torch ops, for storages on other devices."""
    if encoding is Encoding.OVERWRITE:
        flat.scatter_(0, pos, values)
        return int((flat.index_select(0, pos) != values).sum()) if check else 0
    before = flat.index_select(0, pos)
    after = before ^ values if encoding is Encoding.XOR else add_ordered(before, values)
    flat.scatter_(0, pos, after)
    if not check:
        return 0
    now = flat.index_select(0, pos)
    undone = now ^ values if encoding is Encoding.XOR else add_ordered(now, values.neg())
    return int((undone != before).sum())


def _run_native(
    kernels: Any, plan: WritePlan, encoding: Encoding, start: int, stop: int, check: bool
) -> tuple[int, int]:
    """:func:`_run_chunk` in C: one pass maps, reads, applies, writes (and re-reads)."""
    flat = plan.words
    assert flat is not None
    if plan.entries is None:
        assert plan.positions is not None and plan.values is not None
        pos = plan.positions[start:stop]
        return int(pos.shape[0]), int(
            kernels.rmw(flat, pos, plan.values[start:stop], int(encoding), check)
        )
    imap = plan.imap
    assert imap is not None
    entries = plan.entries
    dims = np.array(imap.dims, dtype=np.int64).reshape(-1)
    indices, values = entries.listed, entries.values
    if indices is None:  # a run: this chunk's indices only
        indices, values, start, stop = (
            entries.locate(start, stop),
            values[start:stop],
            0,
            stop - start,
        )
    written, wrong = kernels.rmw_mapped(
        flat, indices, values, start, stop, imap.src_offset, imap.dst_offset, dims,
        int(encoding), check,
    )  # fmt: skip
    return int(written), int(wrong)


def _reach(offset: int, dims: tuple[tuple[int, int, int], ...], which: int) -> int:
    """The last element a block reaches: ``which`` 1 for the destination, 2 for the values."""
    return offset + sum((d[0] - 1) * d[which] for d in dims)


def _block_numpy(flat: Words, values: Words, box: Box, encoding: Encoding, check: bool) -> int:
    """One block of a run through strided views of the storage words and the run's values;
    returns post-check failures."""
    dst_off, src_off, dims = box
    if (
        dst_off < 0
        or src_off < 0
        or _reach(dst_off, dims, 1) >= flat.shape[0]
        or _reach(src_off, dims, 2) >= values.shape[0]
    ):
        raise ValueError("a block lies outside its buffers")
    dims = dims or ((1, 1, 1),)  # one element as a 1-element block: no 0-d scalars below
    shape = tuple(d[0] for d in dims)
    size = flat.itemsize
    dst = as_strided(flat[dst_off:], shape, tuple(d[1] * size for d in dims))
    src = as_strided(values[src_off:], shape, tuple(d[2] * size for d in dims), writeable=False)
    if encoding is Encoding.OVERWRITE:
        np.copyto(dst, src)
        return int(np.count_nonzero(dst != src)) if check else 0
    before = dst.copy()
    if encoding is Encoding.XOR:
        np.bitwise_xor(dst, src, out=dst)
    else:
        np.copyto(dst, _ulp_add(before, src))
    if not check:
        return 0
    now = dst.copy()
    undone = now ^ src if encoding is Encoding.XOR else _ulp_add(now, -src)
    return int(np.count_nonzero(undone != before))


def _block_torch(
    flat: torch.Tensor, values: Words, box: Box, encoding: Encoding, check: bool
) -> int:
    """:func:`_block_numpy` with torch ops, for storages on other devices."""
    dst_off, src_off, dims = box
    top = _reach(src_off, dims, 2)
    if dst_off < 0 or src_off < 0 or _reach(dst_off, dims, 1) >= flat.shape[0]:
        raise ValueError("a block lies outside its buffers")
    dims = dims or ((1, 1, 1),)
    shape = tuple(d[0] for d in dims)
    dst = flat.as_strided(shape, tuple(d[1] for d in dims), dst_off)
    part = torch_bits(values[src_off : top + 1], flat.device)
    src = part.as_strided(shape, tuple(d[2] for d in dims), 0)
    if encoding is Encoding.OVERWRITE:
        dst.copy_(src)
        return int((dst != src).sum()) if check else 0
    before = dst.clone()
    dst.copy_(before ^ src if encoding is Encoding.XOR else add_ordered(before, src))
    if not check:
        return 0
    undone = dst ^ src if encoding is Encoding.XOR else add_ordered(dst, src.neg())
    return int((undone != before).sum())


def _run_blocks(
    plan: WritePlan, encoding: Encoding, start: int, stop: int, check: bool
) -> tuple[int, int]:
    """Blocks ``start .. stop-1`` of a block plan: in C where built, else numpy or torch."""
    assert plan.blocks is not None and plan.values is not None
    kernels = native.kernels
    written = wrong = 0
    for box in plan.blocks[start:stop]:
        if plan.words is None:
            wrong += _block_torch(plan.flat, plan.values, box, encoding, check)
        elif kernels is not None:
            dims = np.array(box[2], dtype=np.int64).reshape(-1)
            wrong += int(
                kernels.write_block(
                    plan.words, box[0], plan.values, box[1], dims, int(encoding), check
                )[1]
            )
        else:
            wrong += _block_numpy(plan.words, plan.values, box, encoding, check)
        written += math.prod(d[0] for d in box[2])
    return written, wrong


def _run_chunk(
    plan: WritePlan, encoding: Encoding, start: int, stop: int, check: bool
) -> tuple[int, int]:
    if plan.blocks is not None:
        return _run_blocks(plan, encoding, start, stop, check)
    kernels = native.kernels
    if kernels is not None and plan.cast is None and plan.words is not None:
        return _run_native(kernels, plan, encoding, start, stop, check)
    pos, values = plan.chunk(start, stop)
    if not pos.size:
        return 0, 0
    flat = plan.flat
    if flat.device.type == "cpu":
        return int(pos.size), _write_numpy(_words(flat), pos, values, encoding, check)
    device = flat.device
    return int(pos.size), _write_torch(
        flat, torch_index(pos, device), torch_bits(values, device), encoding, check
    )


Task = tuple[WritePlan, Encoding, int, int]

_HANDOVER_S = 0.002
"""How long a new :class:`Execution` waits for a pool worker to take up its chunks."""


def _native_args(plan: WritePlan) -> tuple[tuple[Any, ...], int, int] | None:
    """The plan as one of :func:`rmw_tasks`'s plans with the range of its entries that may
    land, or ``None`` when it needs Python.

    A mapped plan's entries outside the span of its source view (another tensor-parallel
    rank's rows, say) land nowhere: they are left out by two binary searches instead of being
    mapped one by one in the kernel.
    """
    if plan.blocks is not None or plan.cast is not None or plan.words is None:
        return None
    if plan.entries is None:
        return (plan.words, plan.positions, plan.values, 0, 0, None), 0, plan.size
    listed = plan.entries.listed
    if listed is None or plan.imap is None:
        return None
    imap = plan.imap
    lo = int(np.searchsorted(listed, imap.src_offset, side="left"))
    hi = int(np.searchsorted(listed, imap.src_offset + imap.src_span, side="right"))
    dims = np.array(imap.dims, dtype=np.int64).reshape(-1)
    args = (plan.words, listed, plan.entries.values, imap.src_offset, imap.dst_offset, dims)
    return args, lo, max(lo, hi)


class _Stage:
    """One stage's chunks: a task list the C kernels share out without the GIL (where the
    kernels are built and the storage is in host memory), and the rest as Python tasks."""

    def __init__(self, stage: Stage) -> None:
        kernels = native.kernels
        self.tasks: deque[Task] = deque()
        self.native: list[tuple[Any, ...]] = []
        self.owners: list[WritePlan] = []
        firsts: list[int] = []
        ends: list[int] = []
        codes: list[int] = []
        for plan, encoding in stage:
            native_plan = _native_args(plan) if kernels is not None else None
            if native_plan is not None:
                args, first, end = native_plan
                self.native.append(args)
                self.owners.append(plan)
                firsts.append(first)
                ends.append(end)
                codes.append(int(encoding))
            else:
                self.tasks.extend(
                    (plan, encoding, a, min(a + plan.step, plan.size))
                    for a in range(0, plan.size, plan.step)
                )
        # Native plans are mapped or materialized: CHUNK entries per task, over the entries
        # that may land.
        begin = np.array(firsts, dtype=np.int64)
        end_of = np.array(ends, dtype=np.int64)
        counts = -(-(end_of - begin) // CHUNK)
        plan_of = np.repeat(np.arange(len(firsts), dtype=np.int64), counts)
        nth = np.arange(plan_of.size, dtype=np.int64) - np.repeat(
            np.cumsum(counts) - counts, counts
        )
        lo = begin[plan_of] + nth * CHUNK
        hi = np.minimum(lo + CHUNK, end_of[plan_of])
        self.rows = np.stack([plan_of, lo, hi, np.array(codes, dtype=np.int64)[plan_of]], axis=1)
        self.state = np.zeros(2 + 2 * len(self.native), dtype=np.int64)

    def __len__(self) -> int:
        return len(self.rows) + len(self.tasks)

    @property
    def shared(self) -> bool:
        """Whether the C task list may still have chunks to hand out."""
        return bool(len(self.rows)) and int(self.state[0]) < len(self.rows) and not self.state[1]

    def run_shared(self, check: bool) -> None:
        kernels = native.kernels
        assert kernels is not None
        kernels.rmw_tasks(self.native, self.rows, self.state, check)


class Execution:
    """Planned writes of one payload, under way on pool threads while the caller goes on.

    Stages run one after the other; the chunks of one stage are spread over ``threads``
    cores: ``threads - 1`` pool workers start at once, and the caller joins them in
    :meth:`finish`.  The chunks of C-kernel plans are shared out inside the kernels, without
    the GIL, so the workers keep writing while the caller checks and plans the next payload
    in Python.  With ``check`` (paper App. A.2 "Post-apply checks") every written position is
    re-read: undoing the XOR mask or ULP delta must restore the saved pre-write bits, and an
    overwrite must hold the planned bits.  A failed check stops before the next stage;
    :meth:`finish` raises ``fail(..., "post-apply")``.
    """

    def __init__(
        self, stages: Sequence[Stage], *, check: bool, fail: Fail, threads: int | None = None
    ) -> None:
        self._check = check
        self._fail = fail
        self._stages: deque[_Stage] = deque(_Stage(stage) for stage in stages)
        self.written: dict[WritePlan, int] = {plan: 0 for stage in stages for plan, _ in stage}
        self._bad: dict[str, int] = {}
        self._busy = 0
        self._stop = False
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._joined = threading.Event()
        tasks = max((len(stage) for stage in self._stages), default=0)
        helpers = min(threads or default_threads(), tasks) - 1
        self._helpers: list[Future[None]] = [_pool().submit(self._work) for _ in range(helpers)]
        if self._helpers:
            # Hand the GIL over until a worker is inside the kernels (or briefly, when the
            # pool is busy elsewhere): a caller that goes on in Python would hold it for up to
            # the interpreter's switch interval.
            self._joined.wait(_HANDOVER_S)

    def _next(self) -> _Stage | Task | None:
        """What to do next: the current stage's shared C tasks, one Python chunk, or ``None``
        when every stage is done (or stopped)."""
        with self._cond:
            while not self._stop:
                stage = self._stages[0] if self._stages else None
                if stage is None:
                    return None
                if stage.shared:
                    self._busy += 1
                    return stage
                if stage.tasks:
                    self._busy += 1
                    return stage.tasks.popleft()
                if self._busy:  # the stage's last chunks are still being written
                    self._cond.wait()
                    continue
                self._close(self._stages.popleft())
                self._cond.notify_all()
            return None

    def _close(self, stage: _Stage) -> None:
        """Count a finished stage's C-kernel writes; a failed check stops the next stages."""
        n = len(stage.owners)
        for i, plan in enumerate(stage.owners):
            self.written[plan] += int(stage.state[2 + i])
            wrong = int(stage.state[2 + n + i])
            if wrong:
                self._bad[plan.label] = self._bad.get(plan.label, 0) + wrong
        self._stop = bool(self._bad)

    def _work(self) -> None:
        with torch.no_grad():
            while (job := self._next()) is not None:
                n = wrong = 0
                self._joined.set()
                try:
                    if isinstance(job, _Stage):
                        job.run_shared(self._check)
                    else:
                        plan, encoding, a, b = job
                        n, wrong = _run_chunk(plan, encoding, a, b, self._check)
                except BaseException as exc:
                    with self._cond:
                        self._error = self._error or exc
                        self._stop = True
                        self._busy -= 1
                        self._cond.notify_all()
                    return
                with self._cond:
                    self._busy -= 1
                    if not isinstance(job, _Stage):
                        self.written[job[0]] += n
                        if wrong:
                            self._bad[job[0].label] = self._bad.get(job[0].label, 0) + wrong
                    self._cond.notify_all()

    def finish(self) -> dict[WritePlan, int]:
        """Join the workers until every write has landed; returns the positions written per
        plan (raises the first failure)."""
        try:
            self._work()
        finally:
            for f in self._helpers:
                f.result()
        if self._error is not None:
            raise self._error
        if self._bad:
            label, count = next(iter(self._bad.items()))
            raise self._fail(
                f"{count} written positions of {label!r} do not hold the expected bits",
                "post-apply",
            )
        return self.written


def execute(
    stages: Sequence[Stage], *, check: bool, fail: Fail, threads: int | None = None
) -> dict[WritePlan, int]:
    """Perform the planned writes now (:class:`Execution`); returns the positions written per
    plan."""
    return Execution(stages, check=check, fail=fail, threads=threads).finish()


def entries_of(indices: npt.NDArray[np.int64] | int, values: Words, dtype: torch.dtype) -> Entries:
    """:class:`Entries` from an item's (or a merged group's) numpy arrays; an int is the
    start of a run of ``len(values)`` entries."""
    if isinstance(indices, int):
        return Entries(values=values, dtype=dtype, start=indices)
    return Entries(values=values, dtype=dtype, listed=indices)
