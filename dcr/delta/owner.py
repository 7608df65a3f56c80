"""Owners: change detection, direct projection and record packing on one training rank.

An owner compares each shard it owns with its *tracker* (the committed copy, in host memory),
projects the changed elements into canonical coordinates, and packs the records into buckets
of items (paper §4, §7.2, Fig. 8): whole tensors are grouped into chunks for comparison, an
unchanged chunk contributes nothing, and a bucket closes once the chunks that emitted records
reach the bucket target.  Within a chunk, shards are compared in blocks of about a
million elements on worker threads (``BuildConfig.threads``): a block finds its changed words
and gathers their values in one pass (:func:`~dcr.tensors.bits.changed_words`) and maps them
through its shard's affine segments (:meth:`~dcr.delta.mapping.AffineMapping.segments`); only
the changed entries outlive a block, and a bounded window of blocks is in flight, so the
extra memory is a few blocks per thread.  Trackers and the residual baseline change only in
:meth:`commit`, after the commit record names the new version.  :meth:`Owner.build_dense`
packs every element of the committed version the same way, to restore a joining receiver
over the transport.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from dcr.delta.layout import ShardSpec, TrainingPlan
from dcr.delta.mapping import Segment
from dcr.errors import ConfigError, DcrError, LayoutError
from dcr.tensors.bits import bits, changed_indices, changed_values, copy_at
from dcr.tensors.ordered import ULP_DTYPES, ulp_delta
from dcr.tensors.parallel import default_threads, ordered_map
from dcr.tensors.records import Encoding, Item, Mode, Span, TensorSpec

__all__ = ["BuildConfig", "BuildStats", "Bucket", "Owner", "ResidualJob"]

MiB = 1 << 20

_SCAN_BLOCK = 1 << 22
"""Source elements one worker compares at once (one pass of the C scan): large enough that
the per-block work around the scan (the Python calls, the hand-over between threads) stays
small next to it (blocks of 2**20 elements made ``dcr bench construct`` about 7% slower at
3% change) and small enough to bound the per-thread scratch, of which only the
entries of changed elements are ever written."""
_SPARSE_COPY_BELOW = 128
"""Commit writes only the changed elements of a tracker holding fewer than one change per
this many elements, and copies it whole otherwise: scattered writes cost a cache miss each
(about 24 ns per element measured on x86-64), a whole copy about 0.12 ns per element, so
the two meet near 1% of elements changed."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BuildConfig:
    """Construction settings (paper App. C "Pipeline settings").

    ``chunk_bytes``: tensors compared together (64 MiB suits object storage, 256 MiB the relay
    tree).  ``bucket_bytes``: input bytes of record-emitting chunks packed into one payload.
    Tensors and chunks are never split, so either can exceed its target.  ``threads``: worker
    threads one owner compares blocks on (``None``: the CPUs this process may use; 1: the
    calling thread).  Owners building at the same time in one process share them (one
    process-wide pool): while ``n`` owners build, one whose share ``threads // n`` is below
    two compares in the thread that drives its build (:func:`~dcr.tensors.parallel.ordered_map`).
    ``relative_encoding``: what mixed mode emits where a relative encoding is allowed --
    :attr:`Encoding.ULP` deltas for float dtypes (:data:`~dcr.tensors.ordered.ULP_DTYPES`; other
    dtypes keep XOR), the default, or :attr:`Encoding.XOR` masks everywhere (the paper's
    representation; payload format version 1 carries only these).
    """

    chunk_bytes: int = 64 * MiB
    bucket_bytes: int = 512 * MiB
    threads: int | None = None
    relative_encoding: Encoding = Encoding.ULP

    def __post_init__(self) -> None:
        if self.chunk_bytes <= 0 or self.bucket_bytes <= 0:
            raise ConfigError("chunk_bytes and bucket_bytes must be positive")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"threads must be >= 1, got {self.threads}")
        if self.relative_encoding not in (Encoding.XOR, Encoding.ULP):
            raise ConfigError(
                f"relative_encoding must be XOR or ULP, got {self.relative_encoding!r}"
            )

    @property
    def worker_threads(self) -> int:
        return self.threads if self.threads is not None else default_threads()


@dataclass(slots=True, kw_only=True)
class BuildStats:
    """Counters and stage seconds of one owner's construction.

    ``changed_elements`` counts canonical elements of projected tensors whose stored bits
    changed, each once: a shard copy that another rank projects (replicated key/value rows)
    counts nothing, a tied source element counts once per canonical tensor it lands in.
    Entries are counted per encoding (``xor_*``, ``ulp_*``, ``overwrite_*``).  Stage seconds
    are CPU seconds of the threads that ran them, summed over threads (``detect``: comparison
    and the gather of changed values; ``project``: canonical indices and encoded values;
    ``pack``: items of a bucket), except ``convert`` (wall seconds of residual conversion,
    which may use torch's own threads).
    """

    source_bytes: int = 0
    changed_elements: int = 0
    residual_changed: int = 0
    xor_items: int = 0
    overwrite_items: int = 0
    ulp_items: int = 0
    xor_entries: int = 0
    overwrite_entries: int = 0
    ulp_entries: int = 0
    seconds: dict[str, float] = field(default_factory=dict)

    def add_time(self, stage: str, dt: float) -> None:
        self.seconds[stage] = self.seconds.get(stage, 0.0) + dt

    def merge(self, other: BuildStats) -> None:
        for f in (
            "source_bytes",
            "changed_elements",
            "residual_changed",
            "xor_items",
            "overwrite_items",
            "ulp_items",
            "xor_entries",
            "overwrite_entries",
            "ulp_entries",
        ):
            setattr(self, f, getattr(self, f) + getattr(other, f))
        for k, v in other.seconds.items():
            self.add_time(k, v)


@dataclass(slots=True, kw_only=True)
class Bucket:
    """Items of one payload, with the input bytes of the chunks they came from."""

    items: list[Item]
    input_bytes: int
    final: bool = False


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class ResidualJob:
    """A residual canonical tensor this owner assembles and compares.

    ``candidate`` returns the converted candidate tensor (assembled from every owner's parts);
    the owner compares it with its residual baseline.
    """

    spec: TensorSpec
    candidate: Callable[[], torch.Tensor]


UInt = npt.NDArray[np.unsignedinteger[Any]]
Index = npt.NDArray[np.int64]


class _Packer:
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
class _DenseRun:
    """Local element ranges of one shard that land in one :class:`Span` of ``names``."""

    names: tuple[str, ...]
    span: Span
    pieces: list[tuple[int, int]]
    count: int


def _dense_spans(segments: Sequence[Segment]) -> list[_DenseRun]:
    """A shard's affine segments as spans of canonical elements, per name in segment order;
    a segment that continues an earlier span of its names (fused QKV's per-group rows of one
    projection) joins it."""
    out: list[_DenseRun] = []
    last: dict[tuple[str, ...], _DenseRun] = {}
    for seg in segments:
        for lo, hi, span in _segment_spans(seg):
            run = last.get(seg.names)
            if run is not None and run.span.follows(run.count, span):
                run.pieces.append((lo, hi))
                run.count += hi - lo
                continue
            run = _DenseRun(names=seg.names, span=span, pieces=[(lo, hi)], count=hi - lo)
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


@dataclass(frozen=True, slots=True, eq=False)
class _Block:
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
class _Hits:
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


def _scan(block: _Block) -> _Hits:
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
    return _Hits(pos, shift, canonical, values, t1 - t0, time.thread_time() - t1)


def _cover(segments: list[Segment], numel: int) -> list[Segment]:
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


class Owner:
    """One training rank's trackers, candidate shards and construction.

    ``base`` holds (at least) this rank's owned shards at the committed version; they are
    copied into trackers, so the caller may keep mutating its own tensors.
    """

    def __init__(
        self,
        rank: int,
        plan: TrainingPlan,
        base: Mapping[str, torch.Tensor],
        *,
        config: BuildConfig | None = None,
    ) -> None:
        self.rank = rank
        self.plan = plan
        self.config = config or BuildConfig()
        self.shards: list[ShardSpec] = plan.owned_by(rank)
        self.trackers: dict[str, torch.Tensor] = {}
        for s in self.shards:
            t = base.get(s.key)
            if t is None:
                raise LayoutError("base shard missing", tensor=s.key)
            if tuple(t.shape) != s.shape or t.dtype != s.dtype:
                raise LayoutError(
                    f"base shard is {t.dtype}{list(t.shape)}, expected {s.dtype}{list(s.shape)}",
                    tensor=s.key,
                    check="shape",
                )
            self.trackers[s.key] = t.detach().to("cpu", copy=True).contiguous()
        self._segments: dict[str, list[Segment]] = {
            s.key: _cover(s.mapping.segments(), math.prod(s.shape))
            for s in self.shards
            if s.mapping is not None
        }
        self.residual_baseline: dict[str, torch.Tensor] = {}
        self._candidate: dict[str, torch.Tensor] | None = None
        self._donated = False
        self._residual_candidate: dict[str, torch.Tensor] = {}
        # Changed indices per shard (one array per block) from the last *complete* build of the
        # staged candidate; lets commit update trackers at O(changed) instead of copying.
        self._changed: dict[str, list[tuple[Index, int]]] | None = None
        # Bumped when a commit starts moving the baseline; a dense build that sees it move
        # fails instead of mixing two versions.
        self._epoch = 0
        self._committed = False

    # ------------------------------------------------------------------ version state

    def stage(self, candidate: Mapping[str, torch.Tensor], *, donate: bool = False) -> None:
        """Hold the candidate shards of the next version (kept until commit).

        ``donate=True`` hands the tensors over: at commit the trackers become the candidate's
        CPU tensors instead of copies of them (no copy of the shards per refit, and one copy
        of them less in memory once the old trackers are freed).  The caller must not write
        a donated tensor again -- it is the baseline the next delta is computed against; a
        trainer that updates its weights in place steps on a clone.
        """
        held = {}
        for s in self.shards:
            t = candidate.get(s.key)
            if t is None:
                raise LayoutError("candidate shard missing", tensor=s.key)
            if tuple(t.shape) != s.shape or t.dtype != s.dtype:
                raise LayoutError(
                    f"candidate shard is {t.dtype}{list(t.shape)}, expected "
                    f"{s.dtype}{list(s.shape)}",
                    tensor=s.key,
                    check="shape",
                )
            held[s.key] = t.detach() if t.is_contiguous() else t.detach().contiguous()
        self._candidate = held
        self._donated = donate
        self._residual_candidate = {}
        self._changed = None
        self._committed = False

    def set_residual_baseline(self, name: str, tensor: torch.Tensor) -> None:
        """Install the committed canonical tensor of a residual task this rank owns."""
        self.residual_baseline[name] = tensor.detach().to("cpu", copy=True).contiguous()

    def commit(self, *, residual: Sequence[ResidualJob] = ()) -> None:
        """Update trackers and residual baseline in place to the staged candidate.

        Repeatable: it writes absolute values of the fixed candidate, so an owner that reads
        the commit record again after a coordinator failover may call it again (App. B.2).
        After a complete build only the changed elements are written (a tracker with more
        than one change in :data:`_SPARSE_COPY_BELOW` elements is copied whole: the same
        bits, fewer cache misses); otherwise every shard is copied.  A donated candidate's
        CPU tensors become the trackers instead (:meth:`stage`).  ``residual`` are the
        transition's residual jobs of this owner: those no build has reached are converted
        here, so the residual baseline always moves with the trackers (App. A.1:
        ``R_u^g = W_u^{v+1}`` for every required tensor).
        """
        cand = self._require_candidate()
        for job in residual:
            if job.spec.name not in self._residual_candidate:
                self._residual_candidate[job.spec.name] = job.candidate()
        if not self._committed:
            self._epoch += 1
        changed = self._changed
        for key, tracker in list(self.trackers.items()):
            if self._donated and cand[key].device.type == "cpu":
                self.trackers[key] = cand[key]
                continue
            dst, src = bits(tracker).reshape(-1), bits(cand[key]).reshape(-1)
            if changed is not None and key in changed:
                blocks = changed[key]
                if sum(p.shape[0] for p, _ in blocks) * _SPARSE_COPY_BELOW >= dst.shape[0]:
                    # Unchanged elements are equal: a whole copy is the same update, and
                    # faster than scattered writes once most cache lines hold a change.
                    np.copyto(dst, src)
                    continue
                for positions, shift in blocks:
                    copy_at(dst, src, positions, shift)
            else:
                np.copyto(dst, src)
        for name, t in self._residual_candidate.items():
            np.copyto(bits(self.residual_baseline[name]), bits(t))
        self._committed = True

    def discard(self) -> None:
        """Drop the staged candidate (transition aborted); the baseline is unchanged."""
        self._candidate = None
        self._donated = False
        self._residual_candidate = {}
        self._changed = None
        self._committed = False

    def _require_candidate(self) -> dict[str, torch.Tensor]:
        if self._candidate is None:
            raise DcrError(f"owner {self.rank} has no staged candidate", check="stage")
        return self._candidate

    # ------------------------------------------------------------------ construction

    def flags(self) -> frozenset[str]:
        """Keys of owned residual-input shards whose stored bits changed (change flags)."""
        cand = self._require_candidate()
        inputs = self.plan.residual_inputs
        out = set()
        for s in self.shards:
            if (
                s.key in inputs
                and changed_indices(bits(cand[s.key]), bits(self.trackers[s.key])).size
            ):
                out.add(s.key)
        return frozenset(out)

    def chunks(self) -> list[list[ShardSpec]]:
        """Owned projectable shards grouped into chunks of about ``chunk_bytes``."""
        out: list[list[ShardSpec]] = []
        cur: list[ShardSpec] = []
        size = 0
        for s in self.shards:
            if s.mapping is None:
                continue
            if cur and size + s.nbytes > self.config.chunk_bytes:
                out.append(cur)
                cur, size = [], 0
            cur.append(s)
            size += s.nbytes
        if cur:
            out.append(cur)
        return out

    def build(
        self,
        *,
        mode: Mode,
        xor_allowed: Container[str],
        residual: Sequence[ResidualJob] = (),
        project: bool = True,
        stats: BuildStats | None = None,
    ) -> Iterator[Bucket]:
        """Construct this owner's buckets for the staged candidate, lazily.

        Affine shards are compared chunk by chunk and projected (skipped when ``project`` is
        false, as in full conversion); then the ``residual`` jobs are assembled and compared
        with the residual baseline.  The last bucket has ``final=True`` (an owner with no
        changes still yields one empty final bucket so receivers learn it is done).
        """
        cand = self._require_candidate()
        stats = stats if stats is not None else BuildStats()
        packer = _Packer(self.plan.catalog)
        self._changed = None
        records = self._delta_records(cand, packer, stats, mode, xor_allowed, residual, project)
        return self._buckets(records, packer, stats)

    def build_dense(self, *, stats: BuildStats | None = None) -> Iterator[Bucket]:
        """Every canonical element this owner is responsible for, at the committed version.

        Restores a receiver that starts, restarts or fell behind over the transport (paper
        App. A.1 "Version alignment"): each owned affine shard's tracker is projected whole
        (the baseline ``B^v`` reconstructs ``W^v``) and each residual tensor whose baseline
        this rank holds is sent whole, all as overwrite records with sorted indices, so
        contiguous projections travel as runs.  Bucketing follows :meth:`build`.  A staged
        candidate is ignored; a commit while the iterator runs makes it raise
        :class:`DcrError` (``check="dense-stale"``) rather than mix two versions.
        """
        stats = stats if stats is not None else BuildStats()
        packer = _Packer(self.plan.catalog)
        return self._buckets(self._dense_records(packer, stats), packer, stats)

    def _encoding_of(self, name: str, mode: Mode, xor_allowed: Container[str]) -> Encoding:
        if mode is not Mode.MIXED or name not in xor_allowed:
            return Encoding.OVERWRITE
        if (
            self.config.relative_encoding is Encoding.ULP
            and self.plan.catalog[name].dtype in ULP_DTYPES
        ):
            return Encoding.ULP
        return Encoding.XOR

    def _blocks(
        self,
        cand: Mapping[str, torch.Tensor],
        chunks: list[list[ShardSpec]],
        encoding: Callable[[str], Encoding],
    ) -> Iterator[tuple[int, _Block]]:
        """Every block of every chunk, in order, with the index of its chunk."""
        for number, chunk in enumerate(chunks):
            for s in chunk:
                new = bits(cand[s.key]).reshape(-1)
                old = bits(self.trackers[s.key]).reshape(-1)
                for seg in self._segments[s.key]:
                    encs = tuple(encoding(n) for n in seg.names)
                    # Block edges at multiples of the block size keep blocks word-aligned.
                    cut = (seg.start // _SCAN_BLOCK + 1) * _SCAN_BLOCK
                    starts = [seg.start, *range(cut, seg.stop, _SCAN_BLOCK)]
                    for lo, hi in zip(starts, [*starts[1:], seg.stop], strict=True):
                        yield number, _Block(s.key, new, old, seg, encs, lo, hi)

    def _delta_records(
        self,
        cand: Mapping[str, torch.Tensor],
        packer: _Packer,
        stats: BuildStats,
        mode: Mode,
        xor_allowed: Container[str],
        residual: Sequence[ResidualJob],
        project: bool,
    ) -> Iterator[tuple[int, bool]]:
        """Add the changed set to ``packer``; yield the input bytes of each emitting chunk
        (and ``False``: whether more chunks emit is not known ahead).

        Blocks of every chunk are compared on worker threads, a bounded window ahead of the
        chunk being packed (:func:`~dcr.tensors.parallel.ordered_map`); each block finds its
        changed words and gathers their values in one pass (:func:`changed_words`) and maps
        them through its shard's affine segment.
        """
        chunks = self.chunks() if project else []
        # Every scanned shard has an entry, so commit knows an empty list means unchanged.
        changed: dict[str, list[tuple[Index, int]]] = {s.key: [] for c in chunks for s in c}
        encodings: dict[str, Encoding] = {}

        def encoding(name: str) -> Encoding:
            enc = encodings.get(name)
            if enc is None:
                enc = encodings[name] = self._encoding_of(name, mode, xor_allowed)
            return enc

        tasks = list(self._blocks(cand, chunks, encoding))
        left = [0] * len(chunks)
        for number, _ in tasks:
            left[number] += 1
        emitted = [False] * len(chunks)
        finished = 0
        results = ordered_map(_scan, [b for _, b in tasks], threads=self.config.worker_threads)
        for (number, block), hits in zip(tasks, results, strict=True):
            stats.add_time("detect", hits.detect_seconds)
            stats.add_time("project", hits.project_seconds)
            if hits.count:
                changed[block.key].append((hits.positions, hits.shift))
                if hits.canonical is not None:
                    names = block.segment.names
                    for name, enc in zip(names, block.encodings, strict=True):
                        packer.add(name, enc, hits.canonical, hits.values[enc])
                    stats.changed_elements += hits.count * len(names)
                    emitted[number] = True
            left[number] -= 1
            while finished < len(chunks) and left[finished] == 0:
                nbytes = sum(s.nbytes for s in chunks[finished])
                stats.source_bytes += nbytes
                if emitted[finished]:
                    yield nbytes, False
                finished += 1
        for chunk in chunks[finished:]:
            stats.source_bytes += sum(s.nbytes for s in chunk)
        for job in residual:
            t0 = time.perf_counter()
            converted = job.candidate()
            stats.add_time("convert", time.perf_counter() - t0)
            t1 = time.thread_time()
            base = self.residual_baseline.get(job.spec.name)
            if base is None:
                raise LayoutError(
                    f"owner {self.rank} holds no residual baseline", tensor=job.spec.name
                )
            new = bits(converted).reshape(-1)
            idx = changed_indices(new, bits(base).reshape(-1))
            stats.add_time("detect", time.thread_time() - t1)
            stats.source_bytes += job.spec.nbytes
            self._residual_candidate[job.spec.name] = converted
            if idx.size:
                stats.residual_changed += int(idx.size)
                packer.add(job.spec.name, Encoding.OVERWRITE, idx, new[idx])
                yield job.spec.nbytes, False
        if project:
            self._changed = changed

    def _dense_records(self, packer: _Packer, stats: BuildStats) -> Iterator[tuple[int, bool]]:
        """Add every committed element to ``packer``; yield the input bytes of each chunk and
        whether a later chunk emits records too.

        Each shard's affine segments become :class:`Span` records (segments of one tensor
        that continue each other are joined), so the only memory a chunk takes is the copy of
        its values; nothing lists an index.
        """
        epoch = self._epoch

        def check_epoch() -> None:
            if self._epoch != epoch:
                raise DcrError(
                    f"owner {self.rank}: the committed version moved during a dense build",
                    check="dense-stale",
                )

        chunks = [
            [(s, _dense_spans(s.mapping.segments())) for s in chunk if s.mapping is not None]
            for chunk in self.chunks()
        ]
        residual = [t for t in self.plan.residual if t.name in self.residual_baseline]
        emits = [any(spans for _, spans in chunk) for chunk in chunks]
        for number, chunk in enumerate(chunks):
            chunk_bytes = 0
            t0 = time.thread_time()
            for s, spans in chunk:
                chunk_bytes += s.nbytes
                flat = bits(self.trackers[s.key]).reshape(-1)
                for run in spans:
                    values = np.empty(run.count, dtype=flat.dtype)
                    at = 0
                    for lo, hi in run.pieces:
                        values[at : at + hi - lo] = flat[lo:hi]
                        at += hi - lo
                    for name in run.names:
                        packer.add(name, Encoding.OVERWRITE, run.span, values)
            check_epoch()
            stats.add_time("project", time.thread_time() - t0)
            stats.source_bytes += chunk_bytes
            if emits[number]:
                yield chunk_bytes, bool(residual) or any(emits[number + 1 :])
        for n, task in enumerate(residual):
            flat = bits(self.residual_baseline[task.name]).reshape(-1)
            packer.add(task.name, Encoding.OVERWRITE, Span(0), flat.copy())
            check_epoch()
            stats.source_bytes += task.spec.nbytes
            yield task.spec.nbytes, n + 1 < len(residual)

    def _buckets(
        self, records: Iterable[tuple[int, bool]], packer: _Packer, stats: BuildStats
    ) -> Iterator[Bucket]:
        """Close a bucket once record-emitting chunks reach ``bucket_bytes`` (paper §7.2).

        ``records`` fills ``packer`` and yields the input bytes of each chunk that emitted
        records, with whether a later chunk is known to emit too.  A bucket closed where more
        records are known to follow is yielded at once; otherwise it is held back until the
        next one closes, so that the last bucket can be marked final.  An owner that emitted
        nothing yields one empty final bucket.
        """
        input_bytes = 0
        pending: Bucket | None = None

        def flush() -> Bucket | None:
            nonlocal input_bytes
            if not packer:
                return None
            t0 = time.thread_time()
            b = Bucket(items=packer.items(stats), input_bytes=input_bytes)
            stats.add_time("pack", time.thread_time() - t0)
            input_bytes = 0
            return b

        for nbytes, more in records:
            input_bytes += nbytes
            if input_bytes >= self.config.bucket_bytes:
                if pending is not None:
                    yield pending
                    pending = None
                if more:
                    closed = flush()
                    if closed is not None:
                        yield closed
                        del closed  # the consumer owns it now: do not hold it while building
                else:
                    pending = flush()
        last = flush()
        if pending is not None and last is not None:
            yield pending
            pending = last
        elif last is not None:
            pending = last
        if pending is None:
            pending = Bucket(items=[], input_bytes=0)
        pending.final = True
        yield pending
