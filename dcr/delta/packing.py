"""Packing an owner's records into items (paper §7.2): records are collected per canonical
tensor and encoding and turned into sorted items of listed indices or :class:`Span` runs; a
dense build's shard segments become spans of canonical elements."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from dcr.delta.build import BuildStats
from dcr.delta.mapping import Segment
from dcr.errors import LayoutError
from dcr.tensors.records import Encoding, Item, Span, TensorSpec

UInt = npt.NDArray[np.unsignedinteger[Any]]
Index = npt.NDArray[np.int64]


class Packer:
    """Collects records per (canonical name, encoding) and turns them into sorted items.

    A part holds listed indices (a delta build's changed elements) or a :class:`Span` (a
    dense build's whole projections); parts whose spans continue each other become one span
    item, so a dense build never lists an index.
    """

    def __init__(self, catalog: Mapping[str, TensorSpec]) -> None:
        self.catalog = catalog
        self.parts: dict[tuple[str, Encoding], list[tuple[Index | Span, UInt]]] = {}

    def add(self, name: str, encoding: Encoding, indices: Index | Span, values: UInt) -> None:
        if not values.size:
            return
        self.parts.setdefault((name, encoding), []).append((indices, values))

    def __bool__(self) -> bool:
        return bool(self.parts)

    def items(self, stats: BuildStats) -> list[Item]:
        out = []
        for (name, enc), chunks in self.parts.items():
            spec = self.catalog[name]
            item = _span_item(spec, enc, chunks)
            if item is None:
                item = _listed_item(spec, enc, chunks)
            out.append(item)
            if enc is Encoding.XOR:
                stats.xor_items += 1
                stats.xor_entries += item.count
            elif enc is Encoding.ULP:
                stats.ulp_items += 1
                stats.ulp_entries += item.count
            else:
                stats.overwrite_items += 1
                stats.overwrite_entries += item.count
        self.parts = {}
        return out


def _span_item(
    spec: TensorSpec, enc: Encoding, chunks: list[tuple[Index | Span, UInt]]
) -> Item | None:
    """One span item of parts that are spans each continuing the one before, else ``None``."""
    first = chunks[0][0]
    if not isinstance(first, Span):
        return None
    span, count = first, int(chunks[0][1].shape[0])
    for part, values in chunks[1:]:
        if not isinstance(part, Span) or not span.follows(count, part):
            return None
        count += int(values.shape[0])
    values = chunks[0][1] if len(chunks) == 1 else np.concatenate([c[1] for c in chunks])
    return Item(
        name=spec.name,
        shape=spec.shape,
        dtype=spec.dtype,
        encoding=enc,
        span=span,
        values=np.ascontiguousarray(values),
    )


def _listed_item(spec: TensorSpec, enc: Encoding, chunks: list[tuple[Index | Span, UInt]]) -> Item:
    """One item of listed indices: each part is sorted (a monotone map of sorted source
    indices); parts in order with no overlap at their seams need no sort, unsorted seams are
    sorted and checked."""
    parts = [(p.locate(0, int(v.shape[0])) if isinstance(p, Span) else p, v) for p, v in chunks]
    in_order = all(a[0][-1] < b[0][0] for a, b in itertools.pairwise(parts))
    if len(parts) == 1:
        idx, vals = parts[0]
    else:
        idx = np.concatenate([c[0] for c in parts])
        vals = np.concatenate([c[1] for c in parts])
    if not in_order:
        order = np.argsort(idx, kind="stable")
        idx, vals = idx[order], vals[order]
        if not bool((np.diff(idx) > 0).all()):
            raise LayoutError(
                "two records for one canonical destination",
                tensor=spec.name,
                check="conflicting-records",
            )
    return Item(
        name=spec.name,
        shape=spec.shape,
        dtype=spec.dtype,
        encoding=enc,
        indices=np.ascontiguousarray(idx, dtype=np.int64),
        values=np.ascontiguousarray(vals),
    )


@dataclass(slots=True, eq=False)
class DenseRun:
    """Local element ranges of one shard that land in one :class:`Span` of ``names``."""

    names: tuple[str, ...]
    span: Span
    pieces: list[tuple[int, int]]
    count: int


def dense_spans(segments: Sequence[Segment]) -> list[DenseRun]:
    """A shard's affine segments as spans of canonical elements, per name in segment order;
    a segment that continues an earlier span of its names (fused QKV's per-group rows of one
    projection) joins it."""
    out: list[DenseRun] = []
    last: dict[tuple[str, ...], DenseRun] = {}
    for seg in segments:
        for lo, hi, span in _segment_spans(seg):
            run = last.get(seg.names)
            if run is not None and run.span.follows(run.count, span):
                run.pieces.append((lo, hi))
                run.count += hi - lo
                continue
            run = DenseRun(names=seg.names, span=span, pieces=[(lo, hi)], count=hi - lo)
            last[seg.names] = run
            out.append(run)
    return out


def _segment_spans(seg: Segment) -> list[tuple[int, int, Span]]:
    """``(lo, hi, span)``: the segment's local range as spans; a row-spread segment that
    starts inside a row gives that row's rest as a run first."""
    if seg.stop <= seg.start:
        return []
    first = int(seg.canonical(np.array([seg.start], dtype=np.int64))[0])
    if not seg.period or not seg.gap:
        return [(seg.start, seg.stop, Span(first))]
    out = []
    start = seg.start
    cut = -(-start // seg.period) * seg.period
    if cut != start:
        end = min(cut, seg.stop)
        out.append((start, end, Span(first)))
        if end == seg.stop:
            return out
        start = end
        first = int(seg.canonical(np.array([start], dtype=np.int64))[0])
    span = Span(first, seg.period, seg.gap) if seg.stop - start > seg.period else Span(first)
    out.append((start, seg.stop, span))
    return out
