"""Planned writes: the bits each intercepted copy puts into resident storage, and where.

Apply never executes the loader's dense ``copy_``.  Each intercepted copy becomes a
:class:`WritePlan` -- element positions in the destination storage and one value per position
-- computed either from the item's entries through the copy's source geometry (bit-preserving
copies, cost ~ entries) or from the placeholder-masked copy input (transforming copies).  All
plans of an item are built and checked before the first one is executed (deferred writes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from dcr.apply.call import Fail
from dcr.apply.geometry import IndexMap, enumerate_map
from dcr.apply.hook import InterceptedCopy
from dcr.apply.paths import CopyStrategy
from dcr.apply.scratch import torch_bits, torch_index
from dcr.delta.bits import bits_dtype
from dcr.delta.records import Item

__all__ = [
    "WritePlan",
    "active_mask",
    "cast_bits",
    "execute",
    "irregular",
    "plan_mapped",
    "plan_masked",
    "xor_overlap",
]


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class WritePlan:
    """Positions (elements of the destination dtype, from the storage start) and their bits.

    ``values`` are XOR masks on the XOR path and new stored bits on the overwrite path, in the
    integer type of the destination's width.
    """

    copy: InterceptedCopy
    positions: npt.NDArray[np.int64]
    values: torch.Tensor

    @property
    def count(self) -> int:
        return int(self.positions.shape[0])

    @property
    def nbytes(self) -> int:
        return self.count * self.copy.dst_geometry.itemsize


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


def plan_mapped(
    copy: InterceptedCopy, strategy: CopyStrategy, item: Item, *, xor: bool, in_place: bool
) -> WritePlan:
    """Map the item's entries through a scratch-view source straight to destinations.

    An overwrite through a cast converts the entries on their own, unless ``in_place``: then
    the copy input (scratch holding the entries) is cast as a whole in the destination's
    layout -- needed for :func:`irregular` values, and costing O(view).
    """
    imap = (
        IndexMap.build(copy.src_geometry, copy.dst_geometry)
        if strategy is CopyStrategy.SPARSE
        else None
    )
    if imap is not None:
        sel, pos = imap.map(item.indices)
    else:
        sel, pos = enumerate_map(copy.src_geometry, copy.dst_geometry, item.indices)
    g = copy.dst_geometry
    if xor or g.dtype == item.dtype:
        values = torch_bits(item.values[sel])
    elif in_place:
        cast = _cast_in_place_of(copy, copy.src)
        values = cast[torch_index(pos - g.offset, cast.device)]
    else:
        values = cast_bits(torch_bits(item.values[sel]), item.dtype, g.dtype)
    return WritePlan(copy=copy, positions=pos, values=values)


def active_mask(copy: InterceptedCopy) -> torch.Tensor:
    """Positions of the destination view whose copy input is not the NaN placeholder."""
    return ~torch.isnan(copy.src.expand(copy.dst_geometry.shape))


def plan_masked(copy: InterceptedCopy, active: torch.Tensor) -> WritePlan:
    """Overwrite the ``active`` positions (an :func:`active_mask`) with the copy input.

    The copy input holds the real values (the same call in the NaN scheme, the second pass in
    the two-pass scheme) and is cast in the destination's layout.
    """
    g = copy.dst_geometry
    where = active.nonzero()
    stride = torch.tensor(g.stride, dtype=torch.int64, device=where.device)
    rel = (where * stride).sum(dim=1)
    cast = _cast_in_place_of(copy, copy.src)
    return WritePlan(
        copy=copy,
        positions=rel.cpu().numpy() + g.offset,
        values=cast[rel.to(cast.device)],
    )


def xor_overlap(plans: list[WritePlan]) -> bool:
    """Whether two planned writes share a destination byte (the runtime XOR overlap check)."""
    if len(plans) < 2:
        return False
    big = max(p.copy.storage.nbytes for p in plans) + 1
    starts = np.concatenate(
        [p.copy.storage.index * big + p.positions * p.copy.dst_geometry.itemsize for p in plans]
    )
    ends = starts + np.concatenate(
        [np.full(p.count, p.copy.dst_geometry.itemsize, dtype=np.int64) for p in plans]
    )
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], ends[order]
    return bool(np.any(starts[1:] < np.maximum.accumulate(ends)[:-1]))


def _flat_bits(dst: torch.Tensor) -> torch.Tensor:
    """The whole storage behind ``dst`` as a 1-D integer view of ``dst``'s width."""
    n = int(dst.untyped_storage().nbytes()) // dst.element_size()
    return dst.detach().as_strided((n,), (1,), 0).view(bits_dtype(dst.dtype))


def execute(plans: list[WritePlan], *, xor: bool, check: bool, fail: Fail) -> int:
    """Perform the planned writes in order; returns how many positions were post-checked.

    With ``check`` (paper App. A.2 "Post-apply checks"): on the XOR path, XORing the mask into
    the written bits must restore the saved pre-copy bits; on the overwrite path, the written
    bits must equal the loader-transformed values.
    """
    checked = 0
    with torch.no_grad():
        for plan in plans:
            if not plan.count:
                continue
            flat = _flat_bits(plan.copy.dst)
            if flat.device.type == "cpu":
                bad = _write_numpy(flat.numpy(), plan, xor=xor, check=check)
            else:
                bad = _write_torch(flat, plan, xor=xor, check=check)
            if check:
                checked += plan.count
                if bad:
                    raise fail(
                        f"{bad} written positions of {plan.copy.storage.label!r} do not hold "
                        "the expected bits",
                        "post-apply",
                    )
    return checked


def _write_numpy(flat: npt.NDArray[np.generic], plan: WritePlan, *, xor: bool, check: bool) -> int:
    # numpy's take/put is several times faster than torch's advanced indexing on CPU.
    pos = plan.positions
    values = plan.values.cpu().numpy()
    before = np.take(flat, pos) if xor else None
    np.put(flat, pos, before ^ values if before is not None else values)
    if not check:
        return 0
    now = np.take(flat, pos)
    return int(np.count_nonzero((now ^ values) != before if before is not None else now != values))


def _write_torch(flat: torch.Tensor, plan: WritePlan, *, xor: bool, check: bool) -> int:
    pos = torch_index(plan.positions, flat.device)
    values = plan.values.to(flat.device)
    before = flat.index_select(0, pos) if xor else None
    flat.index_copy_(0, pos, torch.bitwise_xor(before, values) if before is not None else values)
    if not check:
        return 0
    now = flat.index_select(0, pos)
    wrong = torch.bitwise_xor(now, values) != before if before is not None else now != values
    return int(wrong.sum())
