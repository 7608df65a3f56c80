"""Per-channel FP8 scales of rows that several owners share (row-parallel weights).

An owner of a row-parallel weight holds a column slice of every row, and a row's scale depends
on the whole row's ``max |w|``.  That maximum is the maximum of the owners' partial maxima,
exactly, so the owners exchange one ``float32`` per shared row -- the slots of one vector
(:class:`SharedRows`), maximised element-wise over every owner (in memory, or an
``all_reduce`` MAX across processes) -- and each quantizes its own columns with the row's scale
(:meth:`~dcr.delta.fp8.Fp8Rollout.share`).  No BF16 value crosses ranks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from dcr.delta.fp8 import Fp8Region, RegionBlock, region_values
from dcr.errors import LayoutError
from dcr.tensors.fp8 import Fp8Scheme, row_amax

__all__ = ["SharedRows", "shared_partials"]


class SharedRows:
    """The rows whose per-channel scales several owners share (row-parallel weights), as
    slots of one ``float32`` vector: ``rows`` maps each such weight to its row count, in plan
    order.  Owners fill their partial row maxima (:func:`shared_partials`) into
    :meth:`vector`; the element-wise maximum over every owner (an ``all_reduce`` MAX across
    processes) gives each shared row its ``max |w|``, which :meth:`rows` hands back to each
    owner for its region."""

    def __init__(self, rows: Mapping[str, int]) -> None:
        self.offsets: dict[str, tuple[int, int]] = {}
        size = 0
        for name, count in rows.items():
            self.offsets[name] = (size, int(count))
            size += int(count)
        self.size = size

    def __bool__(self) -> bool:
        return bool(self.offsets)

    def vector(
        self, partials: Iterable[Mapping[str, tuple[Fp8Region, torch.Tensor]]]
    ) -> torch.Tensor:
        """The slots filled with the maximum of every given owner's partial row maxima
        (zeros where no given owner holds a row)."""
        out = torch.zeros(self.size, dtype=torch.float32)
        for owner in partials:
            for name, (region, amax) in owner.items():
                start, count = self.offsets[name]
                if tuple(amax.shape) != (region.local_shape[0],) or region.shape[0] != count:
                    raise LayoutError(
                        f"partial row maxima {list(amax.shape)} do not fit the region "
                        f"{region.rows}", tensor=name, check="fp8-amax",
                    )  # fmt: skip
                dst = out[start + region.rows[0] : start + region.rows[1]]
                torch.maximum(dst, amax, out=dst)
        return out

    def rows(self, vector: torch.Tensor, regions: Iterable[Fp8Region]) -> dict[str, torch.Tensor]:
        """Each shared region's rows of ``vector`` (a copy)."""
        if tuple(vector.shape) != (self.size,) or vector.dtype != torch.float32:
            raise LayoutError(f"shared row maxima are {vector.dtype}{list(vector.shape)}, "
                              f"expected float32[{self.size}]", check="fp8-amax")  # fmt: skip
        out = {}
        for region in regions:
            if region.name in self.offsets:
                start, _ = self.offsets[region.name]
                out[region.name] = vector[start + region.rows[0] : start + region.rows[1]].clone()
        return out


def shared_partials(
    scheme: Fp8Scheme,
    regions: Mapping[str, tuple[Fp8Region, Sequence[RegionBlock]]],
    shards: Mapping[str, torch.Tensor],
) -> dict[str, tuple[Fp8Region, torch.Tensor]]:
    """Each shared region's partial row maxima (:func:`~dcr.tensors.fp8.row_amax` of its
    columns) from an owner's ``shards``."""
    out = {}
    for name, (region, blocks) in regions.items():
        if region.shares_rows(scheme):
            out[name] = (region, row_amax(region_values(region, blocks, shards)))
    return out
