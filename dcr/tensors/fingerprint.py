"""Hashing of stored bits for the proof of the base version (both sides).

``h(i, x)`` mixes a canonical flat index ``i`` and the stored bits ``x`` of the element there
(:func:`h_reference` is the definition): the key ``G*i + s`` (``s`` from the proof seed) is
XORed with the bits, then two multiply/xorshift rounds run on 60 bits.  For a fixed ``i`` it
is injective in ``x`` with values below ``2^60 < p``, so a single flipped bit always changes
a fingerprint ``sum h(i, x_i) mod (2^61 - 1)``; other differences go unseen with probability
about ``2^-61``.  :func:`hash_view` sums ``h`` over any strided view in blocks on worker
threads, the key computed from the view's geometry (no index arrays): one pass of the C
kernel ``hash_plane`` per block where :mod:`dcr.native` has it, else numpy in cache.  The same
functions serve the receivers (:mod:`dcr.apply.proof`), so both sides hash identically.

An owner proves its part of the committed version from its trackers and residual baseline
(:mod:`dcr.delta.proof`): each canonical element is counted once over all owners (replicated
shards only by their owner, tied weights once per canonical name -- the mappings'
``blocks``), so the owners' fingerprints of a tensor add up to the tensor's.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from dcr import native
from dcr.protocol.proof import PRIME
from dcr.tensors.bits import bits_dtype, numpy_bits_dtype
from dcr.tensors.parallel import default_threads

__all__ = [
    "element_hashes",
    "fold",
    "h_reference",
    "hash_view",
    "locate",
    "salt",
    "sample_positions",
    "sample_positions_of",
    "view_indices",
]

Index = npt.NDArray[np.int64]
UInt64 = npt.NDArray[np.uint64]
UInt = npt.NDArray[np.unsignedinteger[Any]]

_U64 = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_MASK60 = np.uint64((1 << 60) - 1)
_S1 = np.uint64(29)
_S2 = np.uint64(32)
_CHUNK = 1 << 20
"""Elements per block of the index-based paths (sample positions, intra-rank copies)."""
_BLOCK = 1 << 18
"""Elements hashed per block by :func:`hash_view`: its two uint64 temporaries (4 MiB per
thread) stay in cache and are reused."""
_MAX_WORKERS = 4
_scratch = threading.local()
_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def salt(seed: int) -> int:
    """The 64-bit salt ``s`` of ``h`` for ``seed`` (the splitmix64 output of the seed)."""
    z = (seed + 0x9E3779B97F4A7C15) & _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    return z ^ (z >> 31)


def h_reference(i: int, x: int, seed: int, width: int = 16) -> int:
    """``h(i, x)`` for one element, in plain integers: the definition the kernels implement.

    For ``width <= 32`` bits: ``u = ((G*i + s) mod 2^64) xor x``, ``u = u*M1 mod 2^60``,
    ``u ^= u >> 29``, ``u = u*M2 mod 2^60``, ``h = u ^ (u >> 32)``.  Every step is a bijection
    of ``[0, 2^60)`` (``x < 2^32``), so ``h(i, .)`` is injective with values below
    ``2^60 < p``.  A 64-bit element is hashed as its two 32-bit halves at indices ``2i``
    (low) and ``2i + 1`` (high).
    """
    if width > 32:
        lo, hi = x & 0xFFFFFFFF, x >> 32
        return h_reference(2 * i, lo, seed) + h_reference(2 * i + 1, hi, seed)
    m = (1 << 60) - 1
    u = ((0x9E3779B97F4A7C15 * i + salt(seed)) & _U64) ^ x
    u = (u * 0xBF58476D1CE4E5B9) & m
    u ^= u >> 29
    u = (u * 0x94D049BB133111EB) & m
    return u ^ (u >> 32)


def _mix60(z: UInt64, t: UInt64) -> None:
    """``z <- h`` from ``z = (G*i + s) xor x`` in place; ``t`` (same shape) ends as ``z >> 32``."""
    np.multiply(z, _M1, out=z)
    np.bitwise_and(z, _MASK60, out=z)
    np.right_shift(z, _S1, out=t)
    np.bitwise_xor(z, t, out=z)
    np.multiply(z, _M2, out=z)
    np.bitwise_and(z, _MASK60, out=z)
    np.right_shift(z, _S2, out=t)
    np.bitwise_xor(z, t, out=z)


def element_hashes(indices: Index, values: UInt, seed: int) -> UInt64:
    """``h(i, x)`` of every (canonical index, stored bits) pair, as uint64 (``< 2^61``)."""
    if values.dtype.itemsize == 8:
        v = values.astype(np.uint64, copy=False)
        lo = element_hashes(2 * indices, (v & np.uint64(0xFFFFFFFF)).astype(np.uint32), seed)
        hi = element_hashes(2 * indices + 1, (v >> np.uint64(32)).astype(np.uint32), seed)
        return lo + hi
    z = indices.astype(np.uint64) * _GOLDEN
    z += np.uint64(salt(seed))
    z ^= values.astype(np.uint64)
    t = np.empty_like(z)
    _mix60(z, t)
    return z


def _scratch_pair() -> tuple[UInt64, UInt64]:
    pair: tuple[UInt64, UInt64] | None = getattr(_scratch, "pair", None)
    if pair is None or pair[0].size < _BLOCK:
        pair = (np.empty(_BLOCK, dtype=np.uint64), np.empty(_BLOCK, dtype=np.uint64))
        _scratch.pair = pair
    return pair


def _executor() -> ThreadPoolExecutor | None:
    global _pool
    workers = min(_MAX_WORKERS, default_threads())
    if workers < 2:
        return None
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dcr-fingerprint")
        return _pool


class _Plane:
    """A 2-D block of values: row ``r``, column ``j`` is canonical index ``rows[r] + step*j``."""

    def __init__(self, values: UInt, rows: Index, step: int, s: int) -> None:
        self.values = values
        self.rowkey = rows.astype(np.uint64) * _GOLDEN + np.uint64(s)
        self.colkey = (0x9E3779B97F4A7C15 * step) & _U64
        cols = min(values.shape[1], _BLOCK)
        self.inner = np.arange(cols, dtype=np.uint64) * np.uint64(self.colkey)

    def units(self) -> Iterator[tuple[int, int, int, int]]:
        n_rows, n_cols = self.values.shape
        if n_cols >= _BLOCK:
            for r in range(n_rows):
                for c in range(0, n_cols, _BLOCK):
                    yield r, r + 1, c, min(c + _BLOCK, n_cols)
        else:
            step = _BLOCK // n_cols
            for r in range(0, n_rows, step):
                yield r, min(r + step, n_rows), 0, n_cols

    def hash(self, unit: tuple[int, int, int, int]) -> int:
        """The exact integer sum of ``h`` over one unit (no modular reduction yet)."""
        r0, r1, c0, c1 = unit
        k = native.kernels
        if k is not None:
            # One pass over the values in C (the numpy path below makes about ten).
            high, low = k.hash_plane(self.values, self.rowkey, self.colkey, r0, r1, c0, c1)
            return int((high << 64) + low)
        n = (r1 - r0) * (c1 - c0)
        zf, tf = _scratch_pair()
        z = zf[:n].reshape(r1 - r0, c1 - c0)
        t = tf[:n].reshape(r1 - r0, c1 - c0)
        key = self.rowkey[r0:r1]
        if c0:
            key = key + np.uint64((self.colkey * c0) & _U64)
        np.add(self.inner[None, : c1 - c0], key[:, None], out=z)
        np.copyto(t, self.values[r0:r1, c0:c1])
        np.bitwise_xor(z, t, out=z)
        _mix60(z, t)
        # h < 2^60: the high words sum exactly in uint64 (t = h >> 32 after the mix) and the
        # wrapped total gives the low words' sum, which is below n * 2^32 < 2^64.
        high = int(tf[:n].sum(dtype=np.uint64))
        low = (int(zf[:n].sum(dtype=np.uint64)) - (high << 32)) & _U64
        return (high << 32) + low


def _planes(values: UInt, offset: int, stride: Sequence[int], s: int) -> Iterator[_Plane]:
    """Split a strided view into 2-D planes (size-1 dims dropped, mergeable dims merged)."""
    item = values.itemsize
    dims = [
        (int(n), int(vs) // item, int(cs))
        for n, vs, cs in zip(values.shape, values.strides, stride, strict=True)
        if n != 1
    ]
    merged: list[tuple[int, int, int]] = []
    for n, vs, cs in dims:
        if merged and merged[-1][1] == vs * n and merged[-1][2] == cs * n:
            n0 = merged[-1][0]
            merged[-1] = (n0 * n, vs, cs)
        else:
            merged.append((n, vs, cs))
    shape = tuple(d[0] for d in merged) or (1,)
    vstrides = tuple(d[1] * item for d in merged) or (item,)
    cstrides = tuple(d[2] for d in merged) or (1,)
    flat = np.lib.stride_tricks.as_strided(values, shape=shape, strides=vstrides)
    if len(shape) == 1:
        flat = flat.reshape(1, shape[0])
        shape, cstrides = (1, shape[0]), (0, cstrides[0])
    outer = shape[:-2]
    for idx in np.ndindex(*outer):
        base = offset + sum(i * cs for i, cs in zip(idx, cstrides, strict=False))
        rows = base + np.arange(shape[-2], dtype=np.int64) * cstrides[-2]
        yield _Plane(flat[idx], rows, cstrides[-1], s)


def hash_view(values: torch.Tensor, offset: int, stride: Sequence[int], seed: int) -> int:
    """``sum h(i, bits(x))`` (exact, not reduced) over a view: the element at multi-index ``m``
    of ``values`` is canonical position ``offset + sum(m[d] * stride[d])``.

    ``values`` may have any strides and lie on any device (non-CPU tensors are copied to the
    host a block of rows at a time); blocks of :data:`_BLOCK` elements are hashed in cache
    on worker threads (numpy releases the GIL), without index arrays.
    """
    values = values.detach()
    shape = tuple(int(d) for d in values.shape)
    if math.prod(shape) == 0:
        return 0
    if values.device.type != "cpu":
        total = 0
        for rows in row_chunks(shape):
            part = values[rows] if shape else values
            start = offset + (rows.start * int(stride[0]) if shape else 0)
            total += hash_view(part.cpu(), start, stride, seed)
        return total
    if values.dtype == torch.bool:
        values = values.view(torch.uint8)
    if values.element_size() == 8:
        # Two 32-bit halves (little-endian) at canonical indices 2i and 2i + 1.
        halves = torch.empty(0, dtype=torch.int32)
        halves.set_(
            values.untyped_storage(),
            2 * int(values.storage_offset()),
            (*shape, 2),
            (*(2 * int(d) for d in values.stride()), 1),
        )
        return hash_view(halves, 2 * offset, (*(2 * int(d) for d in stride), 1), seed)
    array = values.view(bits_dtype(values.dtype)).numpy().view(numpy_bits_dtype(values.dtype))
    s = salt(seed)
    work = [(plane, unit) for plane in _planes(array, offset, stride, s) for unit in plane.units()]
    pool = _executor() if len(work) > 1 else None
    if pool is None:
        return sum(plane.hash(unit) for plane, unit in work)
    return sum(pool.map(lambda w: w[0].hash(w[1]), work))


def fold(h: UInt64) -> int:
    """``sum(h) mod (2^61 - 1)`` exactly (the two 32-bit halves are summed separately)."""
    total = 0
    for start in range(0, h.shape[0], 1 << 31):
        part = h[start : start + (1 << 31)]
        lo = int((part & np.uint64(0xFFFFFFFF)).sum(dtype=np.uint64))
        hi = int((part >> np.uint64(32)).sum(dtype=np.uint64))
        total += (hi << 32) + lo
    return total % PRIME


def _mix(z: UInt64) -> UInt64:
    """The splitmix64 finalizer, in place (uint64 arithmetic wraps): sample positions."""
    z ^= z >> np.uint64(30)
    z *= _M1
    z ^= z >> np.uint64(27)
    z *= _M2
    z ^= z >> np.uint64(31)
    return z


def _sample_start(seed: int, name: str) -> int:
    """Where tensor ``name``'s sample sequence for ``seed`` starts (64 bits of a hash)."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def sample_positions(seed: int, name: str, numel: int, k: int) -> Index:
    """The sorted, distinct sample positions of tensor ``name`` for ``seed`` (at most ``k``).

    Derived from the seed and the name only, so every endpoint computes the same positions;
    a tensor of at most ``k`` elements is sampled whole.  Element ``j`` of the sequence is
    ``mix(start + j * golden) % numel``, ``start`` a 64-bit hash of seed and name.
    """
    return sample_positions_of(seed, {name: numel}, k)[name]


def sample_positions_of(seed: int, tensors: Mapping[str, int], k: int) -> dict[str, Index]:
    """:func:`sample_positions` of every tensor of ``tensors`` (name -> element count), the
    same arrays computed for all of them at once: one pass of array arithmetic instead of one
    per tensor (a prepare proves every tensor an endpoint holds)."""
    out: dict[str, Index] = {}
    big = [(name, numel) for name, numel in tensors.items() if numel > k]
    for name, numel in tensors.items():
        if numel <= k:
            out[name] = np.arange(numel, dtype=np.int64)
    if not big or k <= 0:
        out.update((name, np.empty(0, dtype=np.int64)) for name, _ in big)
        return out
    starts = np.array([_sample_start(seed, name) for name, _ in big], dtype=np.uint64)
    z = np.arange(k, dtype=np.uint64)[None, :] * _GOLDEN
    z = z + starts[:, None]
    _mix(z)
    numels = np.array([numel for _, numel in big], dtype=np.uint64)
    pos = np.sort((z % numels[:, None]).astype(np.int64), axis=1)
    fresh = np.ones(pos.shape, dtype=bool)
    fresh[:, 1:] = pos[:, 1:] != pos[:, :-1]
    for row, (name, _) in enumerate(big):
        out[name] = pos[row][fresh[row]]
    return out


def locate(
    positions: Index, offset: int, shape: Sequence[int], stride: Sequence[int]
) -> tuple[Index, tuple[Index, ...]] | None:
    """Which of the sorted ``positions`` a strided view selects, and their view indices.

    Returns ``(hit, multi)``: ``positions[hit]`` lie in the view at multi-index ``multi``
    (one array per dimension).  ``None`` when the view is not nested (a broadcast or
    overlapping windows, where a position may have several view indices).
    """
    dims = sorted(
        ((t, s, d) for d, (s, t) in enumerate(zip(shape, stride, strict=True)) if s > 1),
        key=lambda x: -x[0],
    )
    span = 0
    for t, s, _ in reversed(dims):
        if t <= span:
            return None
        span += (s - 1) * t
    rest = positions - offset
    inside = (rest >= 0) & (rest <= span)
    multi = [np.zeros(positions.shape, dtype=np.int64) for _ in shape]
    for t, s, d in dims:
        digit = rest // t
        inside &= digit < s
        multi[d] = digit
        rest = rest - digit * t
    inside &= rest == 0
    hit = np.flatnonzero(inside)
    return hit, tuple(m[hit] for m in multi)


def view_indices(offset: int, shape: Sequence[int], stride: Sequence[int], rows: slice) -> Index:
    """Element offsets (C order) of rows ``rows`` of dimension 0 of a strided view."""
    if not shape:
        return np.array([offset], dtype=np.int64)
    start, stop, _ = rows.indices(shape[0])
    pos = np.full((stop - start, *shape[1:]), offset + start * stride[0], dtype=np.int64)
    for dim, (size, step) in enumerate(zip(shape, stride, strict=True)):
        n = stop - start if dim == 0 else size
        axis = [1] * len(shape)
        axis[dim] = n
        pos += (np.arange(n, dtype=np.int64) * step).reshape(axis)
    return pos.reshape(-1)


def row_chunks(shape: Sequence[int]) -> Iterator[slice]:
    """Slices of dimension 0 holding about :data:`_CHUNK` elements each."""
    if not shape:
        yield slice(0, 1)
        return
    per_row = max(1, math.prod(shape[1:]))
    step = max(1, _CHUNK // per_row)
    for start in range(0, shape[0], step):
        yield slice(start, min(start + step, shape[0]))
