"""Hashing of stored bits for the proof of the base version (owners' side).

``h(i, x)`` mixes a canonical flat index ``i`` and the stored bits ``x`` of the element there
(two rounds of the splitmix64 finalizer, salted with the proof seed): for a fixed ``i`` it is a
bijection of ``x``, so a single flipped bit always changes ``h`` and changes a fingerprint
``sum h(i, x_i) mod (2^61 - 1)`` unless two 64-bit outputs differ by a multiple of the prime
(probability about ``2^-58``).  The same functions serve the receivers
(:mod:`dcr.apply.proof`), so both sides hash identically.

An owner proves its part of the committed version from its trackers and residual baseline:
each canonical element is counted once over all owners (replicated shards only by their
owner, tied weights once per canonical name -- the mappings' ``blocks``), so the owners'
fingerprints of a tensor add up to the tensor's.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from dcr.delta.bits import bits_dtype, numpy_bits_dtype
from dcr.delta.owner import Owner
from dcr.protocol.proof import PRIME, Proof, ProofRequest, TensorProof

__all__ = [
    "element_hashes",
    "fold",
    "locate",
    "owner_proof",
    "sample_positions",
    "view_indices",
]

Index = npt.NDArray[np.int64]
UInt64 = npt.NDArray[np.uint64]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_CHUNK = 1 << 20
"""Elements hashed per block: bounds the temporaries of a fingerprint."""


def _mix(z: UInt64) -> UInt64:
    """The splitmix64 finalizer, in place (uint64 arithmetic wraps)."""
    z ^= z >> np.uint64(30)
    z *= _M1
    z ^= z >> np.uint64(27)
    z *= _M2
    z ^= z >> np.uint64(31)
    return z


def _salt(seed: int) -> np.uint64:
    return np.uint64(seed & 0xFFFFFFFFFFFFFFFF)


def element_hashes(
    indices: Index, values: npt.NDArray[np.unsignedinteger[Any]], seed: int
) -> UInt64:
    """``h(i, x)`` of every (canonical index, stored bits) pair, as uint64."""
    z = indices.astype(np.uint64) * _GOLDEN
    z += _salt(seed)
    _mix(z)
    z ^= values.astype(np.uint64, copy=False)
    return _mix(z)


def fold(h: UInt64) -> int:
    """``sum(h) mod (2^61 - 1)`` exactly (the two 32-bit halves are summed separately)."""
    total = 0
    for start in range(0, h.shape[0], 1 << 31):
        part = h[start : start + (1 << 31)]
        lo = int((part & np.uint64(0xFFFFFFFF)).sum(dtype=np.uint64))
        hi = int((part >> np.uint64(32)).sum(dtype=np.uint64))
        total += (hi << 32) + lo
    return total % PRIME


def sample_positions(seed: int, name: str, numel: int, k: int) -> Index:
    """The sorted, distinct sample positions of tensor ``name`` for ``seed`` (at most ``k``).

    Derived from the seed and the name only, so every endpoint computes the same positions;
    a tensor of at most ``k`` elements is sampled whole.
    """
    if numel <= k:
        return np.arange(numel, dtype=np.int64)
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    z = np.arange(k, dtype=np.uint64) * _GOLDEN
    z += np.uint64(int.from_bytes(digest, "little"))
    _mix(z)
    return np.unique((z % np.uint64(numel)).astype(np.int64))


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


def _numpy_bits(t: torch.Tensor) -> npt.NDArray[np.unsignedinteger[Any]]:
    """Stored bits of any CPU tensor (copied to contiguous first when it is a strided view)."""
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(bits_dtype(t.dtype)).numpy().view(numpy_bits_dtype(t.dtype))


class _Tally:
    """Samples and fingerprint of one tensor, accumulated over blocks."""

    def __init__(self, name: str, numel: int, request: ProofRequest) -> None:
        self.name = name
        self.request = request
        self.positions = (
            sample_positions(request.seed, name, numel, request.samples)
            if request.samples
            else np.empty(0, dtype=np.int64)
        )
        self.samples: list[int] = []
        self.count = 0
        self.value = 0

    def add_view(self, canon: torch.Tensor, shard: torch.Tensor) -> None:
        """A block: ``canon`` is a (meta) view of the canonical tensor, ``shard`` the values."""
        offset = int(canon.storage_offset())
        shape = tuple(int(d) for d in canon.shape)
        stride = tuple(int(d) for d in canon.stride())
        if self.positions.size:
            found = locate(self.positions, offset, shape, stride)
            if found is not None:
                hit, multi = found
                if hit.size:
                    index = tuple(torch.from_numpy(m) for m in multi)
                    values = _numpy_bits(shard[index] if index else shard.reshape(1))
                    for slot, v in zip(hit.tolist(), values.tolist(), strict=True):
                        self.samples += (slot, v)
        if self.request.fingerprint:
            self.count += math.prod(shape)
            for rows in row_chunks(shape):
                idx = view_indices(offset, shape, stride, rows)
                part = shard[rows] if shape else shard
                h = element_hashes(idx, _numpy_bits(part), self.request.seed)
                self.value = (self.value + fold(h)) % PRIME

    def proof(self) -> TensorProof | None:
        if not self.samples and not self.count:
            return None
        return TensorProof(
            name=self.name, samples=tuple(self.samples), count=self.count, value=self.value
        )


def owner_proof(owner: Owner, request: ProofRequest) -> Proof:
    """Owner ``owner``'s proof of its committed version (trackers and residual baseline)."""
    catalog = owner.plan.catalog
    tallies: dict[str, _Tally] = {}

    def tally(name: str) -> _Tally:
        if name not in tallies:
            tallies[name] = _Tally(name, catalog[name].numel, request)
        return tallies[name]

    for s in owner.shards:
        if s.mapping is None:
            continue
        canonical = {
            n: torch.empty(catalog[n].shape, dtype=catalog[n].dtype, device="meta")
            for n in s.mapping.names
        }
        for name, canon, local in s.mapping.blocks(canonical, owner.trackers[s.key]):
            tally(name).add_view(canon, local)
    for name, base in owner.residual_baseline.items():
        flat = base.reshape(-1)
        tally(name).add_view(torch.empty(flat.shape, dtype=flat.dtype, device="meta"), flat)
    tensors = tuple(p for t in tallies.values() if (p := t.proof()) is not None)
    return Proof(seed=request.seed, tensors=tensors, fingerprinted=request.fingerprint)
