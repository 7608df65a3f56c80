"""The owner's side of the proof of the base version (paper App. B.2, ``[proof]``).

An owner answers a prepare's :class:`~dcr.protocol.proof.ProofRequest` from the committed
version it holds -- trackers and residual baseline -- with the sampled stored bits and the
fingerprints (:mod:`dcr.tensors.fingerprint`) of the canonical elements it owns; the
coordinator compares them with each receiver's proof (:mod:`dcr.apply.proof`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from dcr.delta.owner import Owner
from dcr.protocol.proof import PRIME, Proof, ProofRequest, TensorProof
from dcr.tensors.bits import bits_dtype, numpy_bits_dtype
from dcr.tensors.fingerprint import Index, hash_view, locate, sample_positions_of

__all__ = ["owner_proof"]


def _numpy_bits(t: torch.Tensor) -> npt.NDArray[np.unsignedinteger[Any]]:
    """Stored bits of any CPU tensor (copied to contiguous first when it is a strided view)."""
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(bits_dtype(t.dtype)).numpy().view(numpy_bits_dtype(t.dtype))


class _Tally:
    """Samples and fingerprint of one tensor, accumulated over blocks."""

    def __init__(self, name: str, request: ProofRequest, positions: Index) -> None:
        self.name = name
        self.request = request
        self.positions = positions
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
            self.value = (self.value + hash_view(shard, offset, stride, self.request.seed)) % PRIME

    def proof(self) -> TensorProof | None:
        if not self.samples and not self.count:
            return None
        return TensorProof(
            name=self.name, samples=tuple(self.samples), count=self.count, value=self.value
        )


def owner_proof(owner: Owner, request: ProofRequest) -> Proof:
    """Owner ``owner``'s proof of its committed version (trackers and residual baseline; with
    an FP8 rollout, its committed FP8 values and scales stand for the quantized weights)."""
    catalog = owner.plan.wire_catalog
    quantized = owner.plan.quantized
    fp8 = owner.fp8
    tallies: dict[str, _Tally] = {}
    held = [n for s in owner.shards if s.mapping is not None for n in s.mapping.names
            if n not in quantized]  # fmt: skip
    if fp8 is not None:
        held += [n for name in fp8.regions for n in (name, fp8.scheme.scale_name(name))]
    positions = sample_positions_of(
        request.seed,
        {n: catalog[n].numel for n in [*held, *owner.residual_baseline]},
        request.samples,
    )

    def tally(name: str) -> _Tally:
        if name not in tallies:
            tallies[name] = _Tally(name, request, positions[name])
        return tallies[name]

    for s in owner.shards:
        if s.mapping is None:
            continue
        canonical = {
            n: torch.empty(catalog[n].shape, dtype=catalog[n].dtype, device="meta")
            for n in s.mapping.names
        }
        for name, canon, local in s.mapping.blocks(canonical, owner.trackers[s.key]):
            if name not in quantized:
                tally(name).add_view(canon, local)
    if fp8 is not None:
        for name, region in fp8.regions.items():
            (r0, r1), (c0, c1) = region.rows, region.cols
            canon = torch.empty(region.shape, dtype=catalog[name].dtype, device="meta")
            values, scales, tiles = fp8.owned(name)
            tally(name).add_view(canon[r0:r1, c0:c1], values.contiguous())
            if scales.numel():  # a shared tile's scale: its first element's owner proves it
                scale = fp8.scheme.scale_name(name)
                grid = torch.empty(catalog[scale].shape, dtype=catalog[scale].dtype,
                                   device="meta")  # fmt: skip
                tally(scale).add_view(grid[tiles], scales.contiguous())
    for name, base in owner.residual_baseline.items():
        flat = base.reshape(-1)
        tally(name).add_view(torch.empty(flat.shape, dtype=flat.dtype, device="meta"), flat)
    tensors = tuple(p for t in tallies.values() if (p := t.proof()) is not None)
    return Proof(seed=request.seed, tensors=tensors, fingerprinted=request.fingerprint)
