"""FP8 tiles that several owners share, and the exchange of their maxima.

An owner's shards may hold only part of a tile: a row-parallel weight's column slice of every
row under per-channel scales, or the edge of a shard that cuts block tiles.  A tile's scale
depends on its whole ``max |w|``, which is the maximum of its owners' partial maxima, exactly.
So the owners exchange one ``float32`` per shared tile: the slots of one vector
(:class:`SharedTiles`, every tile of each weight that has a shared one) which each owner fills
with its partial maxima (:func:`shared_partials`) and which is maximised element-wise over
every owner (in memory, or an ``all_reduce`` MAX across processes).  Each owner then quantizes
the values it holds with the tiles' scales (:meth:`~dcr.delta.fp8.Fp8Rollout.share`) -- no BF16
value crosses ranks -- sends the FP8 values of its own elements, and sends a tile's scale only
if it holds the tile's first element.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from dcr.delta.fp8 import Fp8Region, RegionBlock, region_values
from dcr.errors import LayoutError
from dcr.tensors.fp8 import Fp8Scheme, tile_amax

__all__ = ["SharedTiles", "shared_partials"]


class SharedTiles:
    """The tiles of every quantized weight some of whose tiles several owners share, as slots
    of one ``float32`` vector: ``grids`` maps each such weight to its tile grid
    (:meth:`Fp8Scheme.tile_grid`), in plan order; a weight's slots are its tiles in row-major
    order."""

    def __init__(self, scheme: Fp8Scheme, grids: Mapping[str, tuple[int, int]]) -> None:
        self.scheme = scheme
        self.offsets: dict[str, tuple[int, tuple[int, int]]] = {}
        size = 0
        for name, (tr, tc) in grids.items():
            self.offsets[name] = (size, (int(tr), int(tc)))
            size += int(tr) * int(tc)
        self.size = size

    def __bool__(self) -> bool:
        return bool(self.offsets)

    def _slots(self, vector: torch.Tensor, region: Fp8Region) -> torch.Tensor:
        """The view of ``vector`` at the tiles of ``region``'s frame."""
        start, (tr, tc) = self.offsets[region.name]
        (t0, t1), (u0, u1) = region.frame_tiles(self.scheme)
        return vector[start : start + tr * tc].view(tr, tc)[t0:t1, u0:u1]

    def vector(
        self, partials: Iterable[Mapping[str, tuple[Fp8Region, torch.Tensor]]]
    ) -> torch.Tensor:
        """The slots filled with the maximum of every given owner's partial tile maxima
        (zeros where no given owner holds a tile)."""
        out = torch.zeros(self.size, dtype=torch.float32)
        for owner in partials:
            for name, (region, amax) in owner.items():
                dst = self._slots(out, region)
                if amax.shape != (dst.numel(),):
                    raise LayoutError(
                        f"partial tile maxima {list(amax.shape)} do not fit the region "
                        f"{region.rows} x {region.cols}", tensor=name, check="fp8-amax",
                    )  # fmt: skip
                torch.maximum(dst, amax.view(dst.shape), out=dst)
        return out

    def tiles(self, vector: torch.Tensor, regions: Iterable[Fp8Region]) -> dict[str, torch.Tensor]:
        """Each shared region's tiles of ``vector`` (a copy, its frame's tiles row-major)."""
        if tuple(vector.shape) != (self.size,) or vector.dtype != torch.float32:
            raise LayoutError(f"shared tile maxima are {vector.dtype}{list(vector.shape)}, "
                              f"expected float32[{self.size}]", check="fp8-amax")  # fmt: skip
        return {r.name: self._slots(vector, r).reshape(-1).clone()
                for r in regions if r.name in self.offsets}  # fmt: skip


def shared_partials(
    scheme: Fp8Scheme,
    regions: Mapping[str, tuple[Fp8Region, Sequence[RegionBlock]]],
    shards: Mapping[str, torch.Tensor],
) -> dict[str, tuple[Fp8Region, torch.Tensor]]:
    """Each shared region's partial tile maxima (:func:`~dcr.tensors.fp8.tile_amax` over its
    frame, zeros where other owners hold the values) from an owner's ``shards``."""
    out = {}
    for name, (region, blocks) in regions.items():
        if not region.shares_tiles(scheme):
            continue
        (f0, f1), (g0, g1) = region.frame(scheme)
        (r0, r1), (c0, c1) = region.rows, region.cols
        frame = torch.zeros((f1 - f0, g1 - g0), dtype=torch.bfloat16)
        region_values(region, blocks, shards, out=frame[r0 - f0 : r1 - f0, c0 - g0 : c1 - g0])
        out[name] = (region, tile_amax(frame, scheme))
    return out
