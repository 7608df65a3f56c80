"""Rice splitting of a version 2 or 3 payload's words into streams (paper App. D): the gaps between
each Rice item's sorted indices and the zigzagged ULP values, each split into a byte symbol
(or a nibble, for values) per word, a remainder stream per Rice parameter and escape words.

The C kernels split every item's words straight into the shared streams when they are built;
NumPy does the same otherwise.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from dcr import native
from dcr.errors import ConfigError
from dcr.tensors.records import Item
from dcr.wire.split import (
    GAP_CAP,
    VALUE_CAP,
    pack_bits,
    pack_nibbles,
    remainder_bytes,
    split,
    zigzag,
)

__all__ = ["Job", "Streams", "split_streams"]


@dataclass(slots=True)
class Streams:
    """Rice-split streams of one kind (locations or ULP values) of a payload: the symbol
    stream, one remainder stream per parameter (ascending) and the escapes in item order."""

    symbols: npt.NDArray[np.uint8]
    remainders: list[npt.NDArray[np.uint8]]
    escapes: list[npt.NDArray[np.uint64]]

    @property
    def escape_count(self) -> int:
        return sum(int(a.shape[0]) for a in self.escapes)


Job = tuple[str, int, Item | npt.NDArray[Any]]
"""One item's words to split: tensor name (for errors), Rice parameter, and the item (whose
sorted indices give the gaps) or its ULP deltas."""

_PIECE = 1 << 20
"""Gaps of a span item split at once: its indices are generated piece by piece, never
listed whole."""


def _pieces(source: Item | npt.NDArray[Any]) -> Iterator[npt.NDArray[Any]]:
    """The arrays a job splits, in order: an item's indices (listed, or a span's in pieces
    that overlap by one index, so that every gap lies in one piece), or the ULP deltas."""
    if not isinstance(source, Item):
        yield source
    elif source.listed is not None:
        yield source.listed
    else:
        gaps = source.count - 1
        for lo in range(0, gaps, _PIECE):
            yield source.locate(lo, min(lo + _PIECE, gaps) + 1)


def _split_numpy(jobs: list[Job], gaps: bool, attempt: int) -> Streams:
    cap = GAP_CAP if gaps else VALUE_CAP
    symbols: list[npt.NDArray[np.uint8]] = []
    remainders: dict[int, list[npt.NDArray[np.unsignedinteger[Any]]]] = {}
    escapes: list[npt.NDArray[np.uint64]] = []
    for name, k, source in jobs:
        for array in _pieces(source):
            if gaps:
                words = np.subtract(array[1:], array[:-1])
                if int(words.min()) < 1:
                    raise ConfigError(
                        "indices must be strictly increasing", attempt=attempt, tensor=name
                    )
                words = words.view(np.uint64)
                words -= np.uint64(1)
            else:
                words = zigzag(array)
            sym, esc, rem = split(words, k, cap)
            symbols.append(sym)
            if esc.shape[0]:
                escapes.append(esc)
            if k:
                remainders.setdefault(k, []).append(rem)
    packed = _concat(symbols)
    return Streams(
        symbols=packed if gaps else pack_nibbles(packed),
        remainders=[pack_bits(_concat(remainders[k]), k) for k in sorted(remainders)],
        escapes=escapes,
    )


def _job_size(source: Item | npt.NDArray[Any]) -> int:
    """Words a job splits: an item's gaps, or its ULP deltas."""
    return source.count - 1 if isinstance(source, Item) else int(source.shape[0])


def _split_native(jobs: list[Job], gaps: bool, attempt: int, kernels: Any) -> Streams:
    """:func:`_split_numpy` in C: every item's words go straight into the shared streams."""
    cap = GAP_CAP if gaps else VALUE_CAP
    per_k: dict[int, int] = {}
    for _, k, source in jobs:
        if k:
            per_k[k] = per_k.get(k, 0) + _job_size(source)
    total = sum(_job_size(source) for _, _, source in jobs)
    symbols = np.empty(total, np.uint8) if gaps else np.zeros((total + 1) // 2, np.uint8)
    streams = {k: np.zeros(remainder_bytes(n, k), np.uint8) for k, n in sorted(per_k.items())}
    empty = np.empty(0, np.uint8)
    split_fn = kernels.split_gaps if gaps else kernels.split_ulp
    escapes: list[npt.NDArray[np.uint64]] = []
    at_sym = 0
    at_rem = dict.fromkeys(per_k, 0)
    for name, k, source in jobs:
        for array in _pieces(source):
            n = int(array.shape[0]) - 1 if gaps else int(array.shape[0])
            esc = np.empty(n, np.uint64)
            n_esc = split_fn(
                array, k, cap, symbols, at_sym, streams.get(k, empty), per_k.get(k, 0),
                at_rem.get(k, 0), esc,
            )  # fmt: skip
            if n_esc < 0:
                raise ConfigError(
                    "indices must be strictly increasing", attempt=attempt, tensor=name
                )
            if n_esc:
                escapes.append(esc[:n_esc].copy())
            at_sym += n
            if k:
                at_rem[k] += n
    return Streams(symbols=symbols, remainders=list(streams.values()), escapes=escapes)


def split_streams(jobs: list[Job], *, gaps: bool, attempt: int) -> Streams:
    """The streams of ``jobs`` (gaps of sorted indices, or ULP deltas), in C when built."""
    kernels = native.kernels
    if kernels is None:
        return _split_numpy(jobs, gaps, attempt)
    return _split_native(jobs, gaps, attempt, kernels)


def _concat(parts: list[npt.NDArray[Any]]) -> npt.NDArray[Any]:
    if not parts:
        return np.empty(0, dtype=np.uint8)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)
