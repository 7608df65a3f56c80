"""The block scan of an owner's construction: one worker task compares a block of a shard
with its tracker, gathers what the changed words' encoding sends and maps them through the
shard's affine segment; detect-only segments cover the elements no segment projects."""

from __future__ import annotations

import time
from dataclasses import dataclass

from dcr.delta.mapping import Segment
from dcr.delta.packing import Index, UInt
from dcr.errors import LayoutError
from dcr.tensors.bits import changed_values
from dcr.tensors.ordered import ulp_delta
from dcr.tensors.records import Encoding


@dataclass(frozen=True, slots=True, eq=False)
class Block:
    """One worker task: compare ``new[start:stop]`` with ``old[start:stop]`` in ``segment``."""

    key: str
    new: UInt
    old: UInt
    segment: Segment
    encodings: tuple[Encoding, ...]
    """Encoding of each of the segment's names (empty: detect only, nothing projects)."""
    start: int
    stop: int


@dataclass(frozen=True, slots=True, eq=False)
class Hits:
    """What one block found: changed positions, their canonical indices and values.

    ``positions - shift`` are the changed source (local) indices; for a segment that maps by
    a plain offset the scan produces canonical indices directly (``canonical`` is then
    ``positions`` and ``shift`` the segment's offset).
    """

    positions: Index
    shift: int
    canonical: Index | None
    values: dict[Encoding, UInt]
    detect_seconds: float
    project_seconds: float

    @property
    def count(self) -> int:
        return int(self.positions.shape[0])


_SCAN_KINDS = {Encoding.XOR: "xor", Encoding.ULP: "ulp", Encoding.OVERWRITE: "new"}


def scan_block(block: Block) -> Hits:
    """Detect, gather and project one block (runs on a worker thread).

    One pass finds the changed words and gathers what their encoding sends (XOR masks, ULP
    deltas or new words; :func:`~dcr.tensors.bits.changed_values`); a segment whose names take
    several encodings (tied tensors on different loader paths) gathers masks and new words
    and derives the rest.  A segment that maps by a plain offset gets canonical indices from
    the scan itself.
    """
    t0 = time.thread_time()
    encodings = block.encodings
    distinct = set(encodings)
    kind = _SCAN_KINDS[encodings[0]] if len(distinct) == 1 else "xor+new"
    if not encodings:
        kind = "xor"
    seg = block.segment
    shift = seg.offset if encodings and not seg.period else 0
    pos, first, second = changed_values(
        block.new[block.start : block.stop],
        block.old[block.start : block.stop],
        kind,
        offset=block.start + shift,
    )
    t1 = time.thread_time()
    canonical = None
    values: dict[Encoding, UInt] = {}
    if pos.size and encodings:
        canonical = seg.canonical(pos) if seg.period else pos
        if second is None:
            values[encodings[0]] = first
        else:
            xor, new = first, second
            for enc in distinct:
                if enc is Encoding.XOR:
                    values[enc] = xor
                elif enc is Encoding.OVERWRITE:
                    values[enc] = new
                else:
                    values[enc] = ulp_delta(new, new ^ xor)
    return Hits(pos, shift, canonical, values, t1 - t0, time.thread_time() - t1)


def cover_segments(segments: list[Segment], numel: int) -> list[Segment]:
    """``segments`` plus detect-only segments (no names) for the local elements they miss.

    Elements no segment projects (another rank's replicated copy, vocabulary padding) are
    still compared, so that commit keeps the whole tracker equal to the candidate.
    """
    out: list[Segment] = []
    at = 0
    for seg in sorted(segments, key=lambda g: g.start):
        if seg.start < at:
            raise LayoutError(f"overlapping segments at local index {seg.start}")
        if seg.start > at:
            out.append(Segment(at, seg.start, (), 0))
        if seg.stop > seg.start:
            out.append(seg)
        at = max(at, seg.stop)
    if at < numel:
        out.append(Segment(at, numel, (), 0))
    return out
