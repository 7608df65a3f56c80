"""A receiver's proof of the base version: read canonical positions back from its storage.

Prewarm recorded, for every canonical name, the loader's copies into resident storage with
their geometry: the source is a view of the canonical tensor (its element offsets *are*
canonical flat indices) and the destination a view of a parameter or buffer storage.  The
same multi-index selects an element in both, so a canonical position maps to its stored
bits without running the loader (:func:`receiver_proof`).

* **Sample proof**: the stored bits of the seeded sample positions the rank holds, one pair
  per copy (every copy is compared with the owners' bits).
* **Fingerprint**: per tensor the sum of ``h(i, bits)`` over the positions the rank holds; a
  position held by ``m`` copies on this rank counts each copy with weight ``1/m`` mod p, so
  every copy is verified and the position counts once.  ``count`` and ``coverage`` (a hash
  of the set of positions) let the coordinator group replicas and add up shards
  (:func:`dcr.protocol.proof.judge`).
* **Transforming paths** (a cast or a computed source) do not store canonical bits: such
  names are listed in :attr:`~dcr.protocol.proof.Proof.excluded` and not checked on this
  receiver.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from dcr.apply.applier import Applier
from dcr.apply.geometry import ViewGeometry
from dcr.apply.hook import SourceKind, storage_ptr
from dcr.apply.paths import CopyRecord, PathKind
from dcr.errors import ConfigError
from dcr.protocol.proof import (
    PRIME,
    Proof,
    ProofRequest,
    TensorProof,
    coverage_base,
    run_coverage,
    view_coverage,
)
from dcr.tensors.bits import bits_dtype, numpy_bits_dtype
from dcr.tensors.fingerprint import (
    element_hashes,
    fold,
    hash_view,
    locate,
    row_chunks,
    sample_positions_of,
    view_indices,
)

__all__ = ["StorageReader", "readable", "receiver_proof"]

Index = npt.NDArray[np.int64]


def readable(copy: CopyRecord) -> bool:
    """Whether ``copy`` stores canonical bits unchanged (a same-dtype copy from scratch)."""
    return copy.source is SourceKind.SCRATCH and copy.preserving


class StorageReader:
    """Stored bits of a receiver's resident storages, by the labels prewarm gave them."""

    def __init__(self, receiver: Applier) -> None:
        self._tensors: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, t in receiver.loader.storage_tensors():
            ptr = storage_ptr(t)
            if ptr is None or ptr in seen or t.untyped_storage().nbytes() == 0:
                continue
            seen.add(ptr)
            self._tensors[name] = t
        self._flat: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def flat(self, storage: str, dtype: torch.dtype) -> torch.Tensor:
        """The whole storage ``storage`` as a 1-D integer view of ``dtype``'s width."""
        key = (storage, dtype)
        out = self._flat.get(key)
        if out is None:
            t = self._tensors.get(storage)
            if t is None:
                raise ConfigError(
                    f"storage {storage!r} recorded at prewarm is gone", check="storage-replaced"
                )
            itemsize = dtype.itemsize
            n = int(t.untyped_storage().nbytes()) // itemsize
            view = torch.empty(0, dtype=dtype, device=t.device)
            view.set_(t.untyped_storage(), 0, (n,), (1,))
            out = self._flat[key] = view.view(bits_dtype(dtype))
        return out

    def view(self, dst: ViewGeometry) -> torch.Tensor:
        """The stored elements ``dst`` selects, as a strided integer view (no copy)."""
        flat = self.flat(dst.storage, dst.dtype)
        return flat.as_strided(dst.shape, dst.stride, dst.offset)

    def read(self, dst: ViewGeometry, positions: Index) -> npt.NDArray[np.unsignedinteger[Any]]:
        """Stored bits at element ``positions`` of ``dst``'s storage, as unsigned numpy."""
        flat = self.flat(dst.storage, dst.dtype)
        index = torch.from_numpy(np.ascontiguousarray(positions)).to(flat.device)
        values = flat.index_select(0, index).cpu().numpy()
        return values.view(numpy_bits_dtype(dst.dtype))


def _chunks(copy: CopyRecord) -> Iterator[tuple[Index, Index]]:
    """``(canonical indices, destination positions)`` of a copy, a block of rows at a time."""
    src, dst = copy.src, copy.dst
    for rows in row_chunks(src.shape):
        yield (
            view_indices(src.offset, src.shape, src.stride, rows),
            view_indices(dst.offset, dst.shape, dst.stride, rows),
        )


def _samples(reader: StorageReader, copies: list[CopyRecord], positions: Index) -> list[int]:
    out: list[int] = []
    for c in copies:
        found = locate(positions, c.src.offset, c.src.shape, c.src.stride)
        if found is not None:
            hit, multi = found
            pos = np.full(hit.shape, c.dst.offset, dtype=np.int64)
            for m, step in zip(multi, c.dst.stride, strict=True):
                pos += m * step
        else:
            canon, dpos = c.src.positions(), c.dst.positions()
            k = np.minimum(np.searchsorted(positions, canon), positions.size - 1)
            inside = positions[k] == canon
            hit, pos = k[inside], dpos[inside]
        if hit.size:
            values = reader.read(c.dst, pos)
            for slot, v in zip(hit.tolist(), values.tolist(), strict=True):
                out += (slot, v)
    return out


def _runs_coverage(r: int, positions: Index) -> int:
    """Coverage hash of sorted distinct ``positions``, one closed form per run."""
    if positions.size == 0:
        return 0
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [positions.size]])
    total = 0
    for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
        total += run_coverage(r, int(positions[a]), b - a)
    return total % PRIME


def _fingerprint(
    reader: StorageReader, numel: int, copies: list[CopyRecord], seed: int
) -> tuple[int, int, int]:
    """``(count, coverage, value)`` of the positions ``copies`` hold."""
    r = coverage_base(seed)
    first = copies[0].src
    nested = locate(np.empty(0, dtype=np.int64), first.offset, first.shape, first.stride)
    same = all(
        (c.src.offset, c.src.shape, c.src.stride) == (first.offset, first.shape, first.stride)
        for c in copies
    )
    if nested is not None and same:
        # Every copy holds the same positions once each (one copy, or e.g. tied weights
        # loaded twice): hash the stored views in place, each copy weighted 1/m.
        value = 0
        for c in copies:
            value += hash_view(reader.view(c.dst), c.src.offset, c.src.stride, seed)
        if len(copies) > 1:
            value = value % PRIME * pow(len(copies), PRIME - 2, PRIME)
        cover = view_coverage(r, first.offset, first.shape, first.stride)
        return first.numel, cover, value % PRIME
    # Several copies (or a broadcast) may hold a position more than once on this rank.
    counts = np.zeros(numel, dtype=np.int32)
    for c in copies:
        for idx, _ in _chunks(c):
            np.add.at(counts, idx, 1)
    sums: dict[int, int] = {}
    for c in copies:
        for idx, pos in _chunks(c):
            h = element_hashes(idx, reader.read(c.dst, pos), seed)
            m = counts[idx]
            for k in np.unique(m).tolist():
                sums[k] = sums.get(k, 0) + fold(h[m == k])
    value = sum(s * pow(k, PRIME - 2, PRIME) for k, s in sums.items()) % PRIME
    held = np.flatnonzero(counts)
    return int(held.size), _runs_coverage(r, held), value


def receiver_proof(receiver: Applier, request: ProofRequest) -> Proof:
    """This receiver's proof of the version its storage holds, for ``request``.

    Reads only what the request needs: the sample positions (O(samples) per copy) and, with
    a fingerprint, every position the rank holds once.
    """
    paths = receiver.paths
    if not paths:
        raise ConfigError("call Applier.prewarm() before proving the base version", check="prewarm")
    reader = StorageReader(receiver)
    tensors: list[TensorProof] = []
    excluded: list[str] = []
    proved = {
        name: receiver.catalog[name].numel
        for name, path in paths.items()
        if path.kind is not PathKind.SKIP and path.copies
    }
    positions = sample_positions_of(request.seed, proved, request.samples)
    with torch.no_grad():
        for name, path in paths.items():
            copies = list(path.copies)
            if path.kind is PathKind.SKIP or not copies:
                continue
            if not all(readable(c) for c in copies):
                excluded.append(name)
                continue
            spec = receiver.catalog[name]
            samples: list[int] = []
            if request.samples:
                samples = _samples(reader, copies, positions[name])
            count = cover = value = 0
            if request.fingerprint:
                count, cover, value = _fingerprint(reader, spec.numel, copies, request.seed)
            tensors.append(
                TensorProof(
                    name=name, samples=tuple(samples), count=count, coverage=cover, value=value
                )
            )
    return Proof(
        seed=request.seed,
        tensors=tuple(tensors),
        fingerprinted=request.fingerprint,
        excluded=tuple(excluded),
    )
