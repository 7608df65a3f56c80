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

Construction settings and results are in :mod:`dcr.delta.build`, the packing of records into
items in :mod:`dcr.delta.packing`, and the block scan in :mod:`dcr.delta.scan`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch

from dcr.delta.build import Bucket, BuildConfig, BuildStats, ResidualJob
from dcr.delta.fp8 import Fp8Region, Fp8Rollout, region_values
from dcr.delta.fp8_shared import SharedTiles, shared_partials
from dcr.delta.layout import ShardSpec, TrainingPlan
from dcr.delta.mapping import Segment
from dcr.delta.packing import DenseRun, Index, Packer, UInt, dense_spans
from dcr.delta.scan import Block, Hits, cover_segments, scan_block
from dcr.errors import DcrError, LayoutError
from dcr.tensors.bits import bits, changed_indices, copy_at
from dcr.tensors.ordered import ULP_DTYPES
from dcr.tensors.parallel import ordered_map
from dcr.tensors.records import Encoding, Mode, Span

__all__ = ["Owner"]

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

DENSE_MIN_ELEMENTS = 1 << 16
"""Tensors smaller than this are always sent sparse (``BuildConfig.dense_above`` leaves
them alone): sending one whole saves at most a few hundred kilobytes of apply work."""


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
        fp8_amax: Mapping[str, torch.Tensor] | None = None,
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
            s.key: cover_segments(s.mapping.segments(), math.prod(s.shape))
            for s in self.shards
            if s.mapping is not None
        }
        self.residual_baseline: dict[str, torch.Tensor] = {}
        # The FP8 rollout of the quantized weights whose tiles this rank owns (dcr.delta.fp8).
        self._regions = plan.fp8_regions(rank)
        self.fp8 = (
            Fp8Rollout.of_shards(plan.fp8, self._regions, self.trackers, fp8_amax)
            if plan.fp8 is not None and self._regions
            else None
        )
        self._fp8_staged = False
        self._wire = plan.wire_catalog
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
        self._discard_fp8()
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
        if self.fp8 is not None and not self._fp8_staged:
            self.fp8.stage_shards(cand, self._regions)  # no build reached the FP8 tiles
            self._fp8_staged = True
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
        if self.fp8 is not None:
            self.fp8.commit()  # repeatable: the staged bits are absolute
        self._committed = True

    def discard(self) -> None:
        """Drop the staged candidate (transition aborted); the baseline is unchanged."""
        self._candidate = None
        self._donated = False
        self._discard_fp8()
        self._residual_candidate = {}
        self._changed = None
        self._committed = False

    def _discard_fp8(self) -> None:
        if self.fp8 is not None:
            self.fp8.discard()
            self.fp8.unshare()
        self._fp8_staged = False

    def fp8_partials(
        self, shards: Mapping[str, torch.Tensor]
    ) -> dict[str, tuple[Fp8Region, torch.Tensor]]:
        """This owner's partial tile maxima of its FP8 tiles that other owners share (rows of
        row-parallel weights under per-channel scales, block tiles its shards cut) in
        ``shards``: what its training group exchanges at staging."""
        if self.fp8 is None or not self.fp8.shared:
            return {}
        return shared_partials(self.fp8.scheme, self._regions, shards)

    def fp8_share(self, shared: SharedTiles, vector: torch.Tensor) -> None:
        """Hand this owner the staged candidate's tile maxima over every owner (``vector``,
        the element-wise maximum of every owner's :meth:`fp8_partials` in ``shared``'s
        slots)."""
        if self.fp8 is not None and self.fp8.shared:
            self.fp8.share(shared.tiles(vector, self.fp8.regions.values()))

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
        packer = Packer(self._wire)
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
        packer = Packer(self._wire)
        return self._buckets(self._dense_records(packer, stats), packer, stats)

    def _encoding_of(self, name: str, mode: Mode, xor_allowed: Container[str]) -> Encoding:
        if mode is not Mode.MIXED or name not in xor_allowed or name in self.plan.quantized:
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
    ) -> Iterator[tuple[int, Block]]:
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
                        yield number, Block(s.key, new, old, seg, encs, lo, hi)

    def _delta_records(
        self,
        cand: Mapping[str, torch.Tensor],
        packer: Packer,
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
        # The last block of each shard: its shard's hits are complete there, and the shard
        # goes sparse or dense (``dense_above``).
        last = {block.key: i for i, (_, block) in enumerate(tasks)}
        shards = {s.key: s for c in chunks for s in c}
        held: list[tuple[Block, Hits]] = []
        quantized = self.plan.quantized
        fp8_hits: dict[str, list[tuple[Index, UInt]]] = {}
        emitted = [False] * len(chunks)
        finished = 0
        results = ordered_map(scan_block, [b for _, b in tasks], threads=self.config.worker_threads)
        for i, ((number, block), hits) in enumerate(zip(tasks, results, strict=True)):
            stats.add_time("detect", hits.detect_seconds)
            stats.add_time("project", hits.project_seconds)
            if hits.count:
                changed[block.key].append((hits.positions, hits.shift))
                if hits.canonical is not None:
                    held.append((block, hits))
            if last[block.key] == i and held:
                shard = shards[block.key]
                count = sum(p.shape[0] for p, _ in changed[block.key])
                for b, h in held:  # FP8 weights travel as their re-quantized tiles (below)
                    for name, enc in zip(b.segment.names, b.encodings, strict=True):
                        if name in quantized:
                            fp8_hits.setdefault(name, []).append((h.canonical, h.values[enc]))  # type: ignore[arg-type]
                if self._goes_dense(count, math.prod(shard.shape)):
                    t0 = time.thread_time()
                    self._add_dense(packer, stats, shard, bits(cand[shard.key]).reshape(-1))
                    stats.add_time("project", time.thread_time() - t0)
                else:
                    for b, h in held:
                        for name, enc in zip(b.segment.names, b.encodings, strict=True):
                            if name not in quantized:
                                packer.add(name, enc, h.canonical, h.values[enc])  # type: ignore[arg-type]
                for b, h in held:
                    stats.changed_elements += h.count * len(b.segment.names)
                held = []
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
        if self.fp8 is not None and project:
            yield from self._fp8_records(packer, stats, fp8_hits)
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
                if self._goes_dense(int(idx.size), new.shape[0]):
                    packer.add(job.spec.name, Encoding.OVERWRITE, Span(0), new.copy())
                    stats.dense_tensors += 1
                    stats.dense_elements += new.shape[0]
                else:
                    packer.add(job.spec.name, Encoding.OVERWRITE, idx, new[idx])
                yield job.spec.nbytes, False
        if project:
            self._changed = changed

    def _fp8_records(
        self, packer: Packer, stats: BuildStats, hits: Mapping[str, list[tuple[Index, UInt]]]
    ) -> Iterator[tuple[int, bool]]:
        """Re-quantize the tiles the changed BF16 elements of each quantized weight touch and
        add the FP8 values and scales that changed (overwrites); yield each region's bytes."""
        assert self.fp8 is not None
        self.fp8.discard()  # an earlier attempt of the same candidate staged it already
        self._fp8_staged = False  # until every weight is staged again (commit completes it)
        cand = self._require_candidate()
        # A shared tile's scale moves with another owner's values: re-quantize it here too.
        for name in sorted({*hits, *self.fp8.moved()}):
            numel = self.fp8.mirror[name].numel()
            above = self.config.dense_above if numel >= DENSE_MIN_ELEMENTS else None
            count = sum(p.shape[0] for p, _ in hits.get(name, ()))
            t0 = time.thread_time()
            if count * 4 >= numel:  # most elements changed: compare the region whole
                region, blocks = self._regions[name]
                values = region_values(region, blocks, cand)
                items = self.fp8.stage_region(name, values, stats.fp8, dense_above=above)
            elif count == 0:
                empty = np.empty(0, np.int64)
                items = self.fp8.stage(name, empty, empty.astype(np.uint16), stats.fp8,
                                       dense_above=above)  # fmt: skip
            else:
                index = np.concatenate([p for p, _ in hits[name]])
                vals = np.concatenate([v for _, v in hits[name]])
                if index.shape[0] > 1 and bool((index[1:] < index[:-1]).any()):
                    order = np.argsort(index, kind="stable")
                    index, vals = index[order], vals[order]
                items = self.fp8.stage(name, index, vals, stats.fp8, dense_above=above)
            for item in items:
                where = item.span if item.span is not None else item.indices
                packer.add(item.name, Encoding.OVERWRITE, where, item.values)
            stats.add_time("convert", time.thread_time() - t0)
            if items:
                yield numel * 2, False
        self._fp8_staged = True

    def _goes_dense(self, changed: int, numel: int) -> bool:
        """Whether a tensor with ``changed`` of ``numel`` elements changed is sent dense."""
        above = self.config.dense_above
        return above is not None and numel >= DENSE_MIN_ELEMENTS and changed >= above * numel

    def _add_dense(self, packer: Packer, stats: BuildStats, shard: ShardSpec, flat: UInt) -> None:
        """Add every element shard ``shard`` projects, from its words ``flat``, as span
        overwrites (what a dense build sends of it)."""
        assert shard.mapping is not None
        for run in self._dense_runs(shard):
            values = np.empty(run.count, dtype=flat.dtype)
            at = 0
            for lo, hi in run.pieces:
                values[at : at + hi - lo] = flat[lo:hi]
                at += hi - lo
            names = [n for n in run.names if n not in self.plan.quantized]
            for name in names:
                packer.add(name, Encoding.OVERWRITE, run.span, values)
            stats.dense_elements += run.count * len(names)
        stats.dense_tensors += 1

    def _dense_runs(self, shard: ShardSpec) -> list[DenseRun]:
        assert shard.mapping is not None
        return dense_spans(shard.mapping.segments())

    def _dense_records(self, packer: Packer, stats: BuildStats) -> Iterator[tuple[int, bool]]:
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

        chunks = [[s for s in chunk if s.mapping is not None] for chunk in self.chunks()]
        residual = [t for t in self.plan.residual if t.name in self.residual_baseline]
        fp8 = self.fp8.dense_items() if self.fp8 is not None else []
        emits = [any(self._dense_runs(s) for s in chunk) for chunk in chunks]
        for number, chunk in enumerate(chunks):
            chunk_bytes = 0
            t0 = time.thread_time()
            for s in chunk:
                chunk_bytes += s.nbytes
                self._add_dense(packer, stats, s, bits(self.trackers[s.key]).reshape(-1))
            check_epoch()
            stats.add_time("project", time.thread_time() - t0)
            stats.source_bytes += chunk_bytes
            if emits[number]:
                yield chunk_bytes, bool(residual or fp8) or any(emits[number + 1 :])
        for n, item in enumerate(fp8):
            assert item.span is not None
            packer.add(item.name, Encoding.OVERWRITE, item.span, item.values)
            check_epoch()
            yield item.values.nbytes, bool(residual) or n + 1 < len(fp8)
        for n, task in enumerate(residual):
            flat = bits(self.residual_baseline[task.name]).reshape(-1)
            packer.add(task.name, Encoding.OVERWRITE, Span(0), flat.copy())
            check_epoch()
            stats.source_bytes += task.spec.nbytes
            yield task.spec.nbytes, n + 1 < len(residual)

    def _buckets(
        self, records: Iterable[tuple[int, bool]], packer: Packer, stats: BuildStats
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
