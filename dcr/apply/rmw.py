"""Fused read-modify-write: one chunk or block of a planned write, applied to resident storage.

A :class:`~dcr.apply.writes.WritePlan` is executed chunk by chunk (:data:`~dcr.apply.writes.CHUNK`
entries) or block by block: each chunk reads its destination words, applies the encoding
(overwrite, XOR mask, ULP delta) and writes them back while their cache lines are hot -- in C
where the kernels are built (:mod:`dcr.native`), else with numpy (host memory) or torch (other
devices).  With ``check`` (paper App. A.2 "Post-apply checks") every written position is
re-read; each function returns the positions that do not hold the expected bits.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from numpy.lib.stride_tricks import as_strided

from dcr import native
from dcr.apply.geometry import Box
from dcr.apply.scratch import torch_bits, torch_index
from dcr.apply.writes import Words, WritePlan, _words
from dcr.tensors.ordered import add_ordered, ordered, unordered
from dcr.tensors.records import Encoding

__all__ = ["run_chunk"]


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
    """:func:`run_chunk` in C: one pass maps, reads, applies, writes (and re-reads)."""
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


def run_chunk(
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
