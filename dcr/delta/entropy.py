"""The order-0 entropy floor of the paper's representation: gap-coded positions + XOR masks.

The paper's payloads carry, per item, the gaps between successive changed positions and the
XOR mask of each changed element.  Their empirical order-0 entropy -- ``H0`` of the multiset
of all gaps plus ``H0`` of the multiset of all masks, each times its count -- is the least any
coder that models symbols independently needs for that representation; payloads below it
need a better model of the data (e.g. ULP deltas instead of XOR masks).

Positions: within each item, ``gap = index - previous index - 1`` and the first gap is the
first index.  Masks: ``new bits ^ old bits`` as ``w``-bit symbols, one alphabet per word
width.  Everything here is exact integer counting plus one floating-point sum.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from dcr.errors import ConfigError
from dcr.tensors.ordered import ordered, unordered
from dcr.tensors.records import Encoding, Item

__all__ = ["floor_of_items", "gap_xor_floor_bytes", "item_gaps", "order0_bits", "xor_masks"]

UInt = npt.NDArray[np.unsignedinteger[Any]]
Index = npt.NDArray[np.int64]

_BINCOUNT_LIMIT = 1 << 24
"""Symbols below this are counted with ``bincount``; larger ones with ``unique``."""


def _counts(symbols: npt.NDArray[Any]) -> npt.NDArray[np.int64]:
    if symbols.size == 0:
        return np.empty(0, dtype=np.int64)
    if symbols.dtype.kind in "iu":
        lo, hi = int(symbols.min()), int(symbols.max())
        if lo >= 0 and hi < _BINCOUNT_LIMIT:
            c = np.bincount(symbols.astype(np.int64, copy=False), minlength=1)
            return c[c > 0]
    return np.unique(symbols, return_counts=True)[1].astype(np.int64)


def _bits_of_counts(counts: npt.NDArray[np.int64]) -> float:
    """``sum_s -c_s log2(c_s / N)`` = ``N log2 N - sum_s c_s log2 c_s``."""
    n = int(counts.sum())
    if n == 0:
        return 0.0
    c = counts.astype(np.float64)
    return float(n * np.log2(n) - np.dot(c, np.log2(c)))


def order0_bits(symbols: npt.NDArray[Any]) -> float:
    """Empirical order-0 entropy of ``symbols`` in bits, times their count (total bits)."""
    return _bits_of_counts(_counts(np.asarray(symbols).reshape(-1)))


def item_gaps(indices: Index) -> Index:
    """Gap code of one item's sorted indices: first index, then ``index - previous - 1``."""
    if indices.size == 0:
        return np.empty(0, dtype=np.int64)
    gaps = np.empty(indices.shape[0], dtype=np.int64)
    gaps[0] = indices[0]
    np.subtract(indices[1:], indices[:-1], out=gaps[1:])
    gaps[1:] -= 1
    if indices.size > 1 and int(gaps[1:].min()) < 0:
        raise ConfigError("item indices must be strictly increasing", check="gaps")
    return gaps


def xor_masks(item: Item, base: UInt) -> UInt:
    """``new bits ^ old bits`` of every entry of ``item``, whatever its encoding.

    ``base`` is the flat stored-bit view (:func:`~dcr.tensors.bits.bits`) of the canonical
    tensor the item applies to; it is only read.
    """
    if base.dtype != item.values.dtype:
        raise ConfigError(
            f"base is {base.dtype}, item values are {item.values.dtype}", tensor=item.name
        )
    if item.encoding is Encoding.XOR:
        return item.values
    old = base.reshape(-1)[item.indices]
    if item.encoding is Encoding.OVERWRITE:
        return item.values ^ old
    with np.errstate(over="ignore"):  # ULP: new = unordered(ordered(old) + delta) mod 2**w
        new = unordered(ordered(old) + item.values)
    return new ^ old


def gap_xor_floor_bytes(entries: Iterable[tuple[Index, UInt]]) -> float:
    """Order-0 floor in bytes of gap-coded positions plus XOR masks of ``entries``.

    ``entries`` yields, per item, its strictly increasing indices and the XOR masks of the
    same entries (:func:`xor_masks`).  Gaps of all items form one multiset; masks form one
    multiset per word width.  Returns ``(H0(gaps) * count + sum_w H0(masks_w) * count_w) / 8``.
    """
    gaps: list[Index] = []
    masks: dict[int, list[UInt]] = {}
    for indices, values in entries:
        if indices.shape != values.shape:
            raise ConfigError("indices and masks must have one entry each", check="shape")
        if indices.size:
            gaps.append(item_gaps(indices))
            masks.setdefault(values.dtype.itemsize, []).append(values)
    total = _bits_of_counts(_counts(np.concatenate(gaps))) if gaps else 0.0
    for parts in masks.values():
        total += _bits_of_counts(_counts(np.concatenate(parts)))
    return total / 8.0


def floor_of_items(items: Iterable[Item], base: Mapping[str, UInt]) -> float:
    """:func:`gap_xor_floor_bytes` of ``items`` against the canonical base bits ``base``."""
    return gap_xor_floor_bytes((i.indices, xor_masks(i, base[i.name])) for i in items)
