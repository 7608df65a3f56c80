"""Location coding of an item's flat indices (paper App. D, Fig. D.3).

An item's sorted, unique flat indices travel either as a contiguous *run* (only the start index;
the entry count gives the length, so nothing goes into the location buffer) or as *gaps* in the
smallest unsigned type that holds the largest gap.  Gaps follow the paper's rule: start at -1 and
add each gap plus one, so gaps ``2, 2, 2`` give positions ``2, 5, 8``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from dcr.errors import ConfigError, PayloadRejected
from dcr.tensors.records import Span

__all__ = [
    "GAP_WIDTHS",
    "V1_KINDS",
    "V2_KINDS",
    "V3_KINDS",
    "LocationKind",
    "Locations",
    "check_run",
    "decode_gaps",
    "decode_run",
    "encode_locations",
    "encode_span",
    "gap_kind",
]


class LocationKind(enum.IntEnum):
    """How an item's indices are stored.  Values are wire codes: never renumber."""

    RUN = 0
    """One contiguous run ``start, start+1, ...``; the entry count is its length."""
    GAPS_U8 = 1
    GAPS_U16 = 2
    GAPS_U32 = 3
    GAPS_U64 = 4
    RICE = 5
    """Format versions 2 and 3: the first index in the record, then ``count - 1`` gaps
    Rice-split into byte symbols and remainders (:mod:`dcr.wire.split`)."""
    ROWS = 6
    """Format version 3: rows of ``period`` consecutive elements, ``period + gap`` apart (a
    :class:`~dcr.tensors.records.Span` with a gap); entry ``j`` lies at ``start + j + (j //
    period) * gap``.  Only the record's fields: nothing in the location streams."""


V1_KINDS = frozenset(
    {
        int(LocationKind.RUN),
        int(LocationKind.GAPS_U8),
        int(LocationKind.GAPS_U16),
        int(LocationKind.GAPS_U32),
        int(LocationKind.GAPS_U64),
    }
)
"""Location kinds of format version 1 (RUN and the four gap widths)."""
V2_KINDS = frozenset({int(LocationKind.RUN), int(LocationKind.RICE)})
"""Location kinds of format version 2."""
V3_KINDS = frozenset({int(LocationKind.RUN), int(LocationKind.RICE), int(LocationKind.ROWS)})
"""Location kinds of format version 3."""


GAP_WIDTHS: dict[LocationKind, int] = {
    LocationKind.GAPS_U8: 1,
    LocationKind.GAPS_U16: 2,
    LocationKind.GAPS_U32: 4,
    LocationKind.GAPS_U64: 8,
}
"""Bytes per gap of each gap kind."""

_GAP_DTYPES: dict[LocationKind, np.dtype[np.unsignedinteger[Any]]] = {
    LocationKind.GAPS_U8: np.dtype("<u1"),
    LocationKind.GAPS_U16: np.dtype("<u2"),
    LocationKind.GAPS_U32: np.dtype("<u4"),
    LocationKind.GAPS_U64: np.dtype("<u8"),
}

_INT64_LIMIT = 1 << 63


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Locations:
    """Encoded locations of one item: a run start, or little-endian gap words."""

    kind: LocationKind
    start: int
    """First index of a run (0 for an empty item); 0 for gap kinds."""
    gaps: npt.NDArray[np.unsignedinteger[Any]]
    """Gap words of a gap kind (empty for a run)."""


def gap_kind(max_gap: int) -> LocationKind:
    """The gap kind with the smallest unsigned type that holds ``max_gap``."""
    if max_gap < 0:
        raise ConfigError(f"gap {max_gap} is negative", check="bounds")
    for kind, width in GAP_WIDTHS.items():
        if max_gap < 1 << (8 * width):
            return kind
    raise ConfigError(f"gap {max_gap} does not fit in 64 bits", check="bounds")


def encode_locations(indices: npt.NDArray[np.int64]) -> Locations:
    """Encode sorted, strictly increasing, non-negative flat ``indices``.

    A contiguous index set (including the empty one) becomes a run; anything else becomes gaps
    in the smallest type that fits.  The caller guarantees ordering (``Item.validate``).
    """
    n = int(indices.shape[0])
    empty = np.empty(0, dtype=np.uint8)
    if n == 0:
        return Locations(kind=LocationKind.RUN, start=0, gaps=empty)
    first = int(indices[0])
    if int(indices[-1]) - first == n - 1:
        return Locations(kind=LocationKind.RUN, start=first, gaps=empty)
    gaps = np.empty(n, dtype=np.int64)
    gaps[0] = first
    np.subtract(indices[1:], indices[:-1], out=gaps[1:])
    gaps[1:] -= 1
    kind = gap_kind(int(gaps.max()))
    return Locations(kind=kind, start=0, gaps=gaps.astype(_GAP_DTYPES[kind]))


def encode_span(span: Span, count: int) -> Locations:
    """:func:`encode_locations` of the ``count`` indices a :class:`Span` implies, without
    listing them: a run, or the gap words of its rows (``0`` inside a row, ``gap`` between
    rows)."""
    if count == 0:
        return Locations(kind=LocationKind.RUN, start=0, gaps=np.empty(0, dtype=np.uint8))
    if span.is_run or count <= span.period:
        return Locations(kind=LocationKind.RUN, start=span.start, gaps=np.empty(0, np.uint8))
    kind = gap_kind(max(span.start, span.gap))
    gaps = np.zeros(count, dtype=_GAP_DTYPES[kind])
    gaps[0] = span.start
    gaps[span.period :: span.period] = span.gap
    return Locations(kind=kind, start=0, gaps=gaps)


def check_run(
    start: int,
    count: int,
    numel: int,
    *,
    attempt: int | None = None,
    tensor: str | None = None,
) -> None:
    """Check that the run ``start .. start+count-1`` lies in ``[0, numel)``; an empty run
    must start at 0.  Raises :class:`PayloadRejected` (``check="bounds"``)."""
    if start < 0 or count < 0 or start + count > numel:
        raise PayloadRejected(
            f"run of {count} entries at {start} exceeds {numel} elements",
            attempt=attempt,
            tensor=tensor,
            check="bounds",
        )
    if count == 0 and start != 0:
        raise PayloadRejected(
            f"empty run must start at 0, not {start}",
            attempt=attempt,
            tensor=tensor,
            check="bounds",
        )


def decode_run(
    start: int,
    count: int,
    numel: int,
    *,
    attempt: int | None = None,
    tensor: str | None = None,
) -> npt.NDArray[np.int64]:
    """Indices ``start .. start+count-1`` after :func:`check_run`."""
    check_run(start, count, numel, attempt=attempt, tensor=tensor)
    return np.arange(start, start + count, dtype=np.int64)


def decode_gaps(
    gaps: npt.NDArray[np.unsignedinteger[Any]],
    numel: int,
    *,
    attempt: int | None = None,
    tensor: str | None = None,
) -> npt.NDArray[np.int64]:
    """Positions from gap words: strictly increasing, each ``< numel``, no int64 overflow.

    Raises :class:`PayloadRejected` (``check="bounds"``) when a position would leave the tensor.
    """

    def reject(message: str) -> PayloadRejected:
        return PayloadRejected(message, attempt=attempt, tensor=tensor, check="bounds")

    n = int(gaps.shape[0])
    if n == 0:
        return np.empty(0, dtype=np.int64)
    if n > numel:
        raise reject(f"{n} positions cannot fit in {numel} elements")
    max_gap = int(gaps.max())
    if max_gap >= numel:
        raise reject(f"gap {max_gap} reaches past {numel} elements")
    # Every step (gap + 1) lies in [1, numel], so positions increase strictly unless the running
    # sum wraps around int64; that is only possible when n * (max_gap + 1) reaches 2**63.
    pos = gaps.astype(np.int64)
    pos += 1
    np.cumsum(pos, out=pos)
    pos -= 1
    if n * (max_gap + 1) >= _INT64_LIMIT and not bool(np.all(pos[1:] > pos[:-1])):
        raise reject("gap sum overflows int64")
    if int(pos[-1]) >= numel:
        raise reject(f"position {int(pos[-1])} is out of range for {numel} elements")
    return pos
