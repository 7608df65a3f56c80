"""The receiver data plane: apply items in place through the native loader (paper §6.1).

A :class:`Applier` hands each item to the serving runtime's own loader as a scratch view in
canonical shape, under a dispatch hook that withholds the loader's writes into parameter and
buffer storage.  Once the call has passed every loader condition (paper App. A.2), the hook's
recorded copies are replayed as XOR or masked overwrite writes at the item's positions only,
so the receiver ends with the bits a dense load of the new checkpoint gives -- and dcr contains
no placement rule of any model.

On bit-preserving paths the item's flat indices are mapped through each copy's source view
directly to destination positions (``docs/architecture.md``, "Receiver data plane"): no
scratch fill, no pass over the tensor, cost proportional to the entries.  Transforming paths
fill scratch with the NaN placeholder and mask the loader's transformed copy input.

A payload is applied all or nothing: every item is admitted first (catalog, bounds, order,
encodings, overlaps), then the loader runs once per name and encoding of the payload -- items
of one name are merged, so a payload of many small items costs one loader call per name, not
per item -- and only when every call has passed its checks do the writes land, as fused
read-modify-write chunks on several cores.  The loader call is never replayed from a cache:
each payload re-proves, for every name it touches, that the loader still makes the writes
recorded at prewarm; only the index maps derived from that geometry are built once.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from dcr import native
from dcr.apply.call import Fail, LoaderCall, run_loader, run_loader_batch
from dcr.apply.geometry import IndexMap
from dcr.apply.hook import SourceKind
from dcr.apply.loader import Loader
from dcr.apply.pages import HugePages, advise_huge_pages
from dcr.apply.paths import CopyStrategy, LoaderPath, PathKind, matches
from dcr.apply.prewarm import classify, find_overlaps, with_overlaps
from dcr.apply.scratch import Scratch, torch_bits
from dcr.apply.storage import StorageGuard
from dcr.apply.writes import (
    Entries,
    Execution,
    FlatViews,
    Stage,
    WritePlan,
    active_mask,
    copies_overlap,
    entries_of,
    irregular,
    plan_block,
    plan_enumerated,
    plan_in_layout,
    plan_masked,
    plan_sparse,
)
from dcr.errors import (
    ConfigError,
    DcrError,
    LoaderConditionViolated,
    LoaderPathUnsupported,
    PayloadRejected,
)
from dcr.tensors.bits import numpy_bits_dtype
from dcr.tensors.ordered import ULP_DTYPES
from dcr.tensors.records import Encoding, Item, Span, TensorSpec

__all__ = [
    "ApplyConfig",
    "ApplyReport",
    "ItemReport",
    "LoaderPath",
    "PathKind",
    "PlaceholderScheme",
    "PrewarmReport",
    "Applier",
    "xor_allowed_across",
]


class PlaceholderScheme(enum.Enum):
    """How inactive positions are told apart on transforming paths (paper App. A.2)."""

    NAN = "nan"
    """One loader pass with NaN at inactive positions; items holding a NaN value fall back to
    :attr:`TWO_PASS` automatically, since NaN cannot mark them."""
    TWO_PASS = "two-pass"
    """Always two passes: actives 0.0 / inactives NaN gives the mask, the real values give the
    written bits.  Also covers transforms that may map an active value to NaN."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ApplyConfig:
    """Receiver settings.

    ``post_apply_checks`` (default off) re-reads every written position (paper App. A.2).
    ``placeholder`` (default NaN, the paper's default) picks the scheme for transforming paths.
    ``scratch_device`` (default: the device of the loader's first parameter) places the
    scratch buffer.  ``threads`` (default: the CPUs the process may run on -- its affinity
    mask -- at most 8) bounds the cores one apply writes with.  ``huge_pages`` (default on)
    backs resident storages in host memory with transparent huge pages at prewarm, where the
    kernel allows (:mod:`dcr.apply.pages`): scattered writes then miss the TLB far less often.
    """

    post_apply_checks: bool = False
    placeholder: PlaceholderScheme = PlaceholderScheme.NAN
    scratch_device: str | None = None
    threads: int | None = None
    huge_pages: bool = True

    def __post_init__(self) -> None:
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise ConfigError(
                f"ApplyConfig.threads must be a positive int or None, got {self.threads!r}"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class PrewarmReport:
    """What prewarm found: path kinds per name, scratch size, loader calls and time;
    ``huge_page_bytes``: resident bytes now backed by huge pages (``ApplyConfig.huge_pages``)."""

    names: int
    preserving: int
    transforming: int
    skipped: int
    xor_allowed: int
    scratch_bytes: int
    loader_calls: int
    seconds: float
    huge_page_bytes: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class ItemReport:
    """One applied group: a name's items of one encoding in one call, merged.

    ``entries`` counts the group's entries and ``merged`` the items they came in.
    ``written`` counts destination elements (an entry can land 0 times -- another rank's rows
    -- or several times -- a replicated copy); ``checked`` counts post-apply-checked positions.
    ``dense`` says whether some copy was reproduced over its whole view (the placeholder path,
    or NaN/subnormal values through a cast) instead of at the entries only.
    """

    name: str
    encoding: Encoding
    kind: PathKind
    entries: int
    merged: int
    written: int
    copies: int
    bytes_written: int
    loader_calls: int
    dense: bool
    checked: int
    seconds: float


@dataclass(frozen=True, slots=True, kw_only=True)
class ApplyReport:
    """Totals over a sequence of applied items, plus the per-item reports."""

    items: tuple[ItemReport, ...]
    entries: int
    written: int
    copies: int
    bytes_written: int
    loader_calls: int
    checked: int
    seconds: float

    @classmethod
    def of(cls, items: Iterable[ItemReport], seconds: float) -> ApplyReport:
        done = tuple(items)
        return cls(
            items=done,
            entries=sum(r.entries for r in done),
            written=sum(r.written for r in done),
            copies=sum(r.copies for r in done),
            bytes_written=sum(r.bytes_written for r in done),
            loader_calls=sum(r.loader_calls for r in done),
            checked=sum(r.checked for r in done),
            seconds=seconds,
        )


class Applier:
    """One rollout rank's in-place delta application through its native loader."""

    def __init__(
        self,
        loader: Loader,
        catalog: Mapping[str, TensorSpec],
        config: ApplyConfig = ApplyConfig(),
    ) -> None:
        for name, spec in catalog.items():
            if spec.name != name:
                raise ConfigError(
                    f"catalog key {name!r} holds the spec of {spec.name!r}", tensor=name
                )
        self._loader = loader
        self._catalog = dict(catalog)
        self._config = config
        self._paths: dict[str, LoaderPath] = {}
        self._xor_allowed: frozenset[str] = frozenset()
        self._report: PrewarmReport | None = None
        self._guard: StorageGuard | None = None
        self._scratch: Scratch | None = None
        self._imaps: dict[tuple[str, int], IndexMap | None] = {}
        # Loader calls witnessed in the current attempt, per (name, relative encoding).
        self._witnessed: dict[tuple[str, bool], LoaderCall] = {}
        self._witness_attempt: int | None = None
        # Whether the names of a payload are witnessed in one loader call: off for good once
        # a shared call could not be split or none of its shares matched (a loader that reads
        # its input ahead), so that such a loader is not called twice per name.
        self._batching = True
        self._flats = FlatViews()
        self._words = {n: np.dtype(numpy_bits_dtype(s.dtype)) for n, s in self._catalog.items()}

    # -- prewarm ---------------------------------------------------------------------------

    def prewarm(self) -> PrewarmReport:
        """Size the scratch, record resident storage and classify every canonical name.

        Runs the native loader once per name in discovery mode (writes withheld), twice more
        for names whose copies need the placeholder.  Idempotent: later calls return the first
        report.  Raises :class:`LoaderPathUnsupported` for a path dcr cannot apply through.
        """
        if self._report is not None:
            return self._report
        start = time.perf_counter()
        largest = max((spec.nbytes for spec in self._catalog.values()), default=0)
        self._loader.check_ready()
        guard = StorageGuard(self._loader)
        device = self._config.scratch_device or guard.device or "cpu"
        scratch = Scratch(largest, device)
        calls = 0
        paths: dict[str, LoaderPath] = {}
        with _restoring(guard, self._unsupported(None)):
            for name, spec in self._catalog.items():

                def run(view: torch.Tensor, name: str = name) -> LoaderCall:
                    nonlocal calls
                    calls += 1
                    return run_loader(
                        self._loader, guard, scratch.ptr, name, view, self._unsupported(name)
                    )

                paths[name] = classify(spec, run, scratch.view(spec))
        paths = with_overlaps(paths, find_overlaps(paths, guard.protected))
        guard.check(self._unsupported(None), full=True)
        huge = (
            advise_huge_pages(t for _, t in self._loader.storage_tensors())
            if self._config.huge_pages
            else HugePages()
        )
        self._guard, self._scratch, self._paths = guard, scratch, paths
        self._xor_allowed = frozenset(name for name, p in paths.items() if p.xor_allowed)
        kinds = [p.kind for p in paths.values()]
        self._report = PrewarmReport(
            names=len(paths),
            preserving=kinds.count(PathKind.PRESERVING),
            transforming=kinds.count(PathKind.TRANSFORMING),
            skipped=kinds.count(PathKind.SKIP),
            xor_allowed=len(self._xor_allowed),
            scratch_bytes=scratch.nbytes,
            loader_calls=calls,
            huge_page_bytes=huge.collapsed,
            seconds=time.perf_counter() - start,
        )
        return self._report

    @property
    def paths(self) -> Mapping[str, LoaderPath]:
        """The classified loader path of every canonical name (empty before prewarm)."""
        return MappingProxyType(self._paths)

    @property
    def catalog(self) -> Mapping[str, TensorSpec]:
        return MappingProxyType(self._catalog)

    @property
    def loader(self) -> Loader:
        """The native loader this receiver applies through."""
        return self._loader

    @property
    def config(self) -> ApplyConfig:
        return self._config

    @property
    def device(self) -> torch.device:
        """Where the scratch buffer (and, normally, the resident weights) live."""
        return self._require_prewarm()[1].device

    def xor_allowed(self) -> frozenset[str]:
        """Names on which XOR entries are safe on this receiver (paper §5, App. A.2).

        A name qualifies when its path preserves stored bits (or the rank skips it) and no
        write of it overlaps a write of another name.
        """
        self._require_prewarm()
        return self._xor_allowed

    # -- apply -----------------------------------------------------------------------------

    def apply_item(self, item: Item, *, attempt: int | None = None) -> ItemReport:
        """Apply one item in place; raises before any write lands when a check fails."""
        return self.apply_items([item], attempt=attempt).items[0]

    def apply_items(self, items: Iterable[Item], *, attempt: int | None = None) -> ApplyReport:
        """Apply a payload's items in place, all or nothing.

        Three phases.  *Admit*: every item is checked against the catalog (name, shape,
        dtype), its own arrays (bounds, strictly increasing indices) and the prewarm paths
        (XOR and ULP only where :meth:`xor_allowed`; ULP only for float dtypes); items of one
        name and encoding are merged into one group, and two items of one name that share a
        position are refused (:class:`PayloadRejected`, check ``"overlap"``), whatever their
        encodings, since their order would decide the result.  *Plan*: the native loader runs
        once per group under the dispatch hook and every loader condition is checked
        (:class:`LoaderConditionViolated`).  *Write*: only then do the planned writes land.  A
        payload rejected in the first two phases leaves every stored bit as it was, whichever
        item is at fault; only a post-apply check (``config.post_apply_checks``) or a write
        that bypassed the hook can fail after writes have landed.

        The report has one :class:`ItemReport` per group, in order of first appearance.
        """
        return self.apply_payloads([items], attempt=attempt)[0]

    def apply_payloads(
        self,
        payloads: Iterable[Iterable[Item]],
        *,
        attempt: int | None = None,
        on_applied: Callable[[int], None] | None = None,
    ) -> list[ApplyReport]:
        """Apply payloads in order, each all or nothing (:meth:`apply_items`); one report each.

        The result is that of one :meth:`apply_items` call per payload, in order, but the
        payloads overlap: while a payload's writes run on pool threads, the next one is
        admitted and planned (it writes nothing until the previous one has landed).  When a
        payload fails, every payload before it has been applied and none after it;
        ``on_applied(i)`` is called once payload ``i`` has landed.
        """
        reports: list[ApplyReport] = []
        running: _Running | None = None
        landed: tuple[_Running, dict[WritePlan, int], float] | None = None

        def report() -> None:
            nonlocal landed
            if landed is not None:
                reports.append(self._apply_report(*landed))
                landed = None
                if on_applied is not None:
                    on_applied(len(reports) - 1)

        try:
            for items in payloads:
                start = time.perf_counter()
                prepared = self._prepare(list(items), attempt)
                if running is not None:
                    done, running = running, None
                    landed = (done, self._land(done, attempt), time.perf_counter())
                running = _Running(
                    prepared=prepared,
                    execution=Execution(
                        self._stages(prepared.groups, prepared.planned),
                        check=self._config.post_apply_checks,
                        fail=self._violation(attempt, None),
                        threads=self._config.threads,
                    ),
                    start=start,
                )
                report()  # the previous payload's, while this one is written
            if running is not None:
                done, running = running, None
                landed = (done, self._land(done, attempt), time.perf_counter())
        finally:
            if running is not None:  # a later payload failed: this one still lands
                landed = (running, self._land(running, attempt), time.perf_counter())
            report()
        return reports

    def _prepare(self, items: list[Item], attempt: int | None) -> _Prepared:
        """Admit and plan one payload: every check that can refuse it, and no write."""
        guard = self._require_prewarm()[0]
        groups = self._admit_all(items, attempt)
        with torch.no_grad(), _restoring(guard, self._violation(attempt, None)):
            t0 = time.perf_counter()
            batched = self._witness_together(groups, attempt)
            together = time.perf_counter() - t0
            planned = [self._plan(group, attempt) for group in groups]
            # Before any write: a loader call may have replaced a parameter, so re-enumerate
            # them all; without one, the storages to be written must still be resident.
            if batched or any(p.calls for p in planned):
                guard.check(self._violation(attempt, None), full=True)
            else:
                guard.check(
                    self._violation(attempt, None),
                    {p.label for plan in planned for p in plan.writes},
                )
        if batched and planned:  # the shared call counts with the first group
            first = planned[0]
            planned[0] = dataclasses.replace(
                first, calls=first.calls + batched, seconds=first.seconds + together
            )
        return _Prepared(groups=groups, planned=planned)

    def _land(self, running: _Running, attempt: int | None) -> dict[WritePlan, int]:
        """Wait until a payload's writes have landed; the positions written per plan."""
        with _restoring(self._require_prewarm()[0], self._violation(attempt, None)):
            return running.execution.finish()

    def _apply_report(
        self, running: _Running, written: dict[WritePlan, int], landed: float
    ) -> ApplyReport:
        check = self._config.post_apply_checks
        reports = [
            ItemReport(
                name=g.spec.name,
                encoding=g.encoding,
                kind=g.path.kind,
                entries=g.entries.count,
                merged=g.merged,
                written=sum(written[p] for p in plan.writes),
                copies=len(plan.writes),
                bytes_written=sum(written[p] * p.itemsize for p in plan.writes),
                loader_calls=plan.calls,
                dense=plan.dense,
                checked=sum(written[p] for p in plan.writes) if check else 0,
                seconds=plan.seconds,
            )
            for g, plan in zip(running.prepared.groups, running.prepared.planned, strict=True)
        ]
        return ApplyReport.of(reports, landed - running.start)

    def dense_load(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Restore resident weights by a dense refit through the native loader (no hook).

        Raises :class:`LoaderPathUnsupported` if the load moved any resident storage: the
        receiver then needs a new :class:`Applier` (and prewarm) before it applies deltas.
        """
        self._loader.dense_load(state_dict)
        if self._guard is not None:
            # The dense load's bits are wanted even in new storage: report, do not restore.
            self._guard.check(self._unsupported(None), full=True, restore=False)

    # -- internals -------------------------------------------------------------------------

    def _require_prewarm(self) -> tuple[StorageGuard, Scratch]:
        if self._guard is None or self._scratch is None:
            raise ConfigError("call Applier.prewarm() before applying items", check="prewarm")
        return self._guard, self._scratch

    @staticmethod
    def _unsupported(name: str | None) -> Fail:
        def fail(message: str, check: str) -> DcrError:
            return LoaderPathUnsupported(message, tensor=name, check=check)

        return fail

    @staticmethod
    def _violation(attempt: int | None, name: str | None) -> Fail:
        def fail(message: str, check: str) -> DcrError:
            return LoaderConditionViolated(message, attempt=attempt, tensor=name, check=check)

        return fail

    def _admit_all(self, items: list[Item], attempt: int | None) -> list[_Group]:
        """Check every item and merge items of one name and encoding (no loader call)."""
        self._require_prewarm()
        by_key: dict[tuple[str, Encoding], list[Item]] = {}
        for item in items:
            self._admit(item, attempt)
            by_key.setdefault((item.name, item.encoding), []).append(item)
        groups = [self._merge(key[0], key[1], members, attempt) for key, members in by_key.items()]
        encodings: dict[str, list[_Group]] = {}
        for g in groups:
            encodings.setdefault(g.spec.name, []).append(g)
        for name, same in encodings.items():
            if len(same) > 1:
                _refuse_shared(name, [g.entries.indices for g in same], attempt)
        return groups

    def _admit(self, item: Item, attempt: int | None) -> None:
        """Check one item against the catalog and the path's classification (O(1))."""

        def reject(message: str, check: str) -> PayloadRejected:
            return PayloadRejected(message, attempt=attempt, tensor=item.name, check=check)

        spec = self._catalog.get(item.name)
        if spec is None:
            raise reject("no such canonical tensor in the catalog", "name")
        if tuple(item.shape) != spec.shape:
            raise reject(
                f"shape {list(item.shape)} differs from the catalog's {list(spec.shape)}", "shape"
            )
        if item.dtype != spec.dtype:
            raise reject(f"dtype {item.dtype} differs from the catalog's {spec.dtype}", "dtype")
        if not isinstance(item.encoding, Encoding):
            raise reject(f"unknown encoding {item.encoding!r}", "encoding")
        want = self._words[item.name]
        listed, values = item.listed, item.values
        if item.span is not None:
            if not isinstance(item.span, Span) or listed is not None:
                raise reject("an item has either listed indices or a span", "schema")
        elif not isinstance(listed, np.ndarray) or listed.dtype != np.int64 or listed.ndim != 1:
            raise reject("indices must be a 1-D int64 array", "schema")
        if (
            not isinstance(values, np.ndarray)
            or values.dtype != want
            or values.shape != (item.count,)
        ):
            raise reject(f"values must be {want.name}[{item.count}]", "schema")
        if item.encoding is not Encoding.OVERWRITE:
            if item.name not in self._xor_allowed:
                path = self._paths[item.name]
                why = (
                    f"it overlaps {sorted(path.overlaps)}"
                    if path.overlaps
                    else f"its loader path is {path.kind.value}"
                )
                raise reject(
                    f"{item.encoding.name} entries are not allowed on this tensor: {why}",
                    "classification",
                )
            if item.encoding is Encoding.ULP and spec.dtype not in ULP_DTYPES:
                raise reject(f"ULP entries need a float dtype, not {spec.dtype}", "encoding")

    def _merge(
        self, name: str, encoding: Encoding, items: list[Item], attempt: int | None
    ) -> _Group:
        """One group of a name's items of one encoding: bounds, order and shared positions.

        Each item's indices must be strictly increasing and inside the tensor; the merged
        indices are sorted, and a position held by two items is refused.  Vectorized over the
        concatenation, so many small items cost about as much as one item of their entries.
        """
        spec = self._catalog[name]

        def reject(message: str, check: str) -> PayloadRejected:
            return PayloadRejected(message, attempt=attempt, tensor=name, check=check)

        run = _run_of(items)
        if run is not None:
            start, values = run
            if start < 0 or start + values.shape[0] > spec.numel:
                raise reject("index out of range", "bounds")
            return _Group(
                spec=spec,
                path=self._paths[name],
                encoding=encoding,
                entries=entries_of(start, values, spec.dtype),
                merged=len(items),
            )
        if len(items) == 1:
            indices, values = items[0].indices, items[0].values
        else:
            indices = np.concatenate([i.indices for i in items])
            values = np.concatenate([i.values for i in items])
        kernels = native.kernels
        if indices.size:
            checked = len(items) == 1 and items[0].verified
            if not checked and (kernels is None or not kernels.increasing(indices)):
                indices, values = self._sorted(items, indices, values, encoding, reject)
            if int(indices[0]) < 0 or int(indices[-1]) >= spec.numel:
                raise reject("index out of range", "bounds")
        return _Group(
            spec=spec,
            path=self._paths[name],
            encoding=encoding,
            entries=entries_of(indices, values, spec.dtype),
            merged=len(items),
        )

    @staticmethod
    def _sorted(
        items: list[Item],
        indices: npt.NDArray[np.int64],
        values: npt.NDArray[Any],
        encoding: Encoding,
        reject: Callable[[str, str], PayloadRejected],
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[Any]]:
        """The merged entries of ``items`` sorted by index; raises if an item's indices do
        not strictly increase or two items share a position."""
        rising = indices[1:] > indices[:-1]
        ordered = bool(rising.all())
        if not ordered and len(items) > 1:
            # Item boundaries may fall anywhere; inside each item the order is strict.
            ends = np.cumsum([len(i.indices) for i in items])[:-1] - 1
            rising[ends[(ends >= 0) & (ends < rising.size)]] = True
        if not ordered and not bool(rising.all()):
            raise reject("indices must be strictly increasing", "schema")
        if not ordered:
            order = np.argsort(indices, kind="stable")
            indices, values = indices[order], values[order]
            if not bool((indices[1:] > indices[:-1]).all()):
                raise reject(
                    f"two {encoding.name} items of this tensor write the same position",
                    "overlap",
                )
        return indices, values

    def _stages(self, groups: list[_Group], planned: list[_Planned]) -> list[Stage]:
        """Writes that may run concurrently, in payload order where order matters.

        Groups of names without overlapping writes (no tied storage) touch pairwise disjoint
        bytes -- prewarm proved it -- and share one stage; a group of a name that overlaps
        another name's writes gets its own stage, so overwrites of tied storage land in
        payload order (the last one wins, as in a dense load).
        """
        stages: list[Stage] = []
        free: list[tuple[WritePlan, Encoding]] = []
        tied: list[list[tuple[WritePlan, Encoding]]] = []
        for g, plan in zip(groups, planned, strict=True):
            writes = [(w, g.encoding) for w in plan.writes]
            if g.path.overlaps:
                tied.append(writes)
            else:
                free.extend(writes)
        if free:
            stages.append(free)
        stages.extend(tied)
        return stages

    def _imap(self, path: LoaderPath, n: int) -> IndexMap | None:
        """The index map of the path's ``n``-th copy, built once from its prewarm geometry."""
        key = (path.name, n)
        if key not in self._imaps:
            copy = path.copies[n]
            self._imaps[key] = IndexMap.build(copy.src, copy.dst)
        return self._imaps[key]

    def _plan(self, group: _Group, attempt: int | None) -> _Planned:
        start = time.perf_counter()
        writes: list[WritePlan] = []
        calls = 0
        dense = False
        if group.entries.count:
            fail = self._violation(attempt, group.spec.name)
            if group.encoding is Encoding.OVERWRITE and any(
                c.strategy is CopyStrategy.PLACEHOLDER for c in group.path.copies
            ):
                writes, calls = self._plan_placeholder(group, fail)
                dense = True
            else:
                writes, dense, calls = self._plan_mapped(group, fail, attempt)
        return _Planned(
            writes=writes, calls=calls, dense=dense, seconds=time.perf_counter() - start
        )

    def _call(self, path: LoaderPath, view: torch.Tensor, fail: Fail) -> LoaderCall:
        guard, scratch = self._require_prewarm()
        call = run_loader(self._loader, guard, scratch.ptr, path.name, view, fail, path.storages)
        if call.scratch_writes and not path.scratch_mutated:
            raise fail(
                f"the loader wrote into scratch ({', '.join(call.scratch_writes[:3])}); "
                "it must leave the values it is given unchanged",
                "scratch-mutated",
            )
        if call.reported and not call.copies:
            raise fail(
                "the loader reports a load but no copy reached the dispatch hook: a write "
                "bypassed the hook and may already have landed; repair by an overwrite retry "
                "or a dense refit",
                "bypass",
            )
        if call.reported != path.reported:
            raise fail(
                f"the loader reported {call.reported} where prewarm saw {path.reported}",
                "report",
            )
        return call

    @staticmethod
    def _check_pattern(path: LoaderPath, call: LoaderCall, fail: Fail) -> None:
        if not _repeats(path, call):
            raise fail(
                f"the loader made {len(call.writes)} writes that differ from the "
                f"{len(path.writes)} recorded at prewarm (count, destination, source or value)",
                "pattern",
            )

    def _in_place(self, group: _Group) -> bool:
        """Whether overwrite values are cast position-dependently (:func:`irregular`): such a
        group is scattered into scratch and loaded with its values, a call of its own."""
        return (
            not group.encoding.relative
            and any(c.src.dtype != c.dst.dtype for c in group.path.copies)
            and irregular(group.entries.values, group.spec.dtype)
        )

    def _witness_attempt_of(self, attempt: int | None) -> dict[tuple[str, bool], LoaderCall]:
        """The witnessed loader calls of ``attempt`` (a new attempt starts with none)."""
        if attempt != self._witness_attempt:
            self._witnessed = {}
            self._witness_attempt = attempt
        return self._witnessed

    def _witness_together(self, groups: list[_Group], attempt: int | None) -> int:
        """Witness the names of a payload in one loader call; returns the calls made (0, 1).

        The sparse groups whose name has no witness in this attempt yet go to the loader
        together (:func:`run_loader_batch`); each name's share of the writes is checked like
        a call of its own and kept as its witness.  A name whose share differs from its
        prewarm record, or a call that cannot be split, is left to :meth:`_plan_mapped`, which
        calls the loader for that name alone (and raises there if the loader really changed).
        Names the loader does not report, that mutate scratch, or that need the placeholder
        are never batched; a receiver whose shared call gave no usable share stops sharing.
        """
        if attempt is None or not self._batching:
            return 0
        witnessed = self._witness_attempt_of(attempt)
        todo: dict[tuple[str, bool], _Group] = {}
        for g in groups:
            key = (g.spec.name, g.encoding.relative)
            if (
                not g.entries.count
                or key in witnessed
                or key in todo
                or not g.path.reported
                or g.path.scratch_mutated
                or (
                    g.encoding is Encoding.OVERWRITE
                    and any(c.strategy is CopyStrategy.PLACEHOLDER for c in g.path.copies)
                )
                or self._in_place(g)
            ):
                continue
            todo[key] = g
        if len(todo) < 2:
            return 0
        guard, scratch = self._require_prewarm()
        batch = list(todo.values())
        fail = self._violation(attempt, None)
        calls = run_loader_batch(
            self._loader,
            guard,
            scratch.ptr,
            [(g.spec.name, scratch.view(g.spec)) for g in batch],
            fail,
            frozenset().union(*(g.path.storages for g in batch)),
        )
        accepted = 0
        for (key, g), call in zip(todo.items(), calls or (), strict=False):
            if call.reported != g.path.reported or not _repeats(g.path, call):
                continue
            try:
                self._witness(g, call, self._violation(attempt, g.spec.name), repeats=True)
            except DcrError:
                continue  # the name's own call decides
            witnessed[key] = call
            accepted += 1
        if not accepted:
            self._batching = False
        return 1

    def _plan_mapped(
        self, group: _Group, fail: Fail, attempt: int | None
    ) -> tuple[list[WritePlan], bool, int]:
        """Sparse path: scratch is handed over unfilled; only the copy geometry matters.

        The loader call witnesses that the loader still makes the writes recorded at prewarm;
        the index maps themselves come from the prewarm geometry (built once per copy).  One
        witness per name and attempt suffices: later payloads of the attempt that carry the
        name reuse its checked copies (returns the loader calls made, 0 or 1).  Overwrite
        values that torch casts position-dependently (:func:`irregular`) are scattered into
        scratch and cast in the destination's layout instead (O(view)), with a call of their
        own.
        """
        spec, path, entries = group.spec, group.path, group.entries
        relative = group.encoding.relative
        scratch = self._require_prewarm()[1]
        in_place = self._in_place(group)
        witnessed = self._witness_attempt_of(attempt)
        key = (spec.name, relative)
        call = None if in_place or attempt is None else witnessed.get(key)
        calls = 0
        if call is None:
            view = (
                scratch.fill(spec, None, entries.where, torch_bits(entries.values))
                if in_place
                else scratch.view(spec)
            )
            call = self._witness(group, self._call(path, view, fail), fail)
            calls = 1
            if not in_place and attempt is not None:
                witnessed[key] = call
        plans = self._write_plans(group, call, in_place)
        return plans, in_place, calls

    def _witness(
        self, group: _Group, call: LoaderCall, fail: Fail, *, repeats: bool = False
    ) -> LoaderCall:
        """Check that a loader call made the writes the group's encoding may go through
        (``repeats``: the caller found that it repeats the prewarm record)."""
        path = group.path
        if group.encoding.relative:
            what = group.encoding.name
            for copy in call.copies:
                if copy.src_geometry.dtype != copy.dst_geometry.dtype:
                    raise fail(
                        f"the copy into {copy.storage.label!r} changes dtype "
                        f"({copy.src_geometry.dtype} -> {copy.dst_geometry.dtype}) on an "
                        f"{what} path",
                        "xor-dtype",
                    )
                if copy.source is not SourceKind.SCRATCH:
                    raise fail(
                        f"the copy into {copy.storage.label!r} does not read scratch storage "
                        f"on an {what} path",
                        "xor-source",
                    )
        if not repeats and not _repeats(path, call):
            if group.encoding.relative and copies_overlap(call.copies):
                raise fail(
                    f"two {group.encoding.name} writes of the item share destination bytes",
                    "xor-overlap",
                )
            self._check_pattern(path, call, fail)
        return call

    def _write_plans(self, group: _Group, call: LoaderCall, in_place: bool) -> list[WritePlan]:
        path, entries = group.path, group.entries
        relative = group.encoding.relative
        plans = []
        for n, (record, copy) in enumerate(zip(path.copies, call.copies, strict=True)):
            imap = self._imap(path, n) if record.strategy is CopyStrategy.SPARSE else None
            if in_place:
                plans.append(plan_in_layout(copy, self._flats, imap, entries))
            elif (
                imap is not None
                and entries.run
                and (relative or copy.dst_geometry.dtype == entries.dtype)
            ):
                plans.append(plan_block(copy, self._flats, imap, entries))
            elif imap is not None:
                plans.append(plan_sparse(copy, self._flats, imap, entries, relative=relative))
            else:
                plans.append(plan_enumerated(copy, self._flats, entries, relative=relative))
        return plans

    def _plan_placeholder(self, group: _Group, fail: Fail) -> tuple[list[WritePlan], int]:
        """Dense path for overwrite items on transforming paths (paper §6.1, App. A.2).

        Scratch holds NaN at inactive positions; each masked copy's active mask is the non-NaN
        positions of its input.  Items holding NaN values (or every item, with the two-pass
        scheme) first run with actives 0.0 for the mask, then with the real values.
        """
        spec, path, entries = group.spec, group.path, group.entries
        scratch = self._require_prewarm()[1]
        values = torch_bits(entries.values)
        two_pass = self._config.placeholder is PlaceholderScheme.TWO_PASS or bool(
            torch.isnan(values.view(spec.dtype)).any()
        )
        calls = 1
        masks: list[torch.Tensor | None] = []
        if two_pass:
            view = scratch.fill(spec, math.nan, entries.where, torch.zeros_like(values))
            first = self._call(path, view, fail)
            self._check_pattern(path, first, fail)
            masks = self._masks(path, first)
            calls = 2
        view = scratch.fill(spec, math.nan, entries.where, values)
        call = self._call(path, view, fail)
        self._check_pattern(path, call, fail)
        if not two_pass:
            masks = self._masks(path, call)
        plans = [
            plan_masked(c, self._flats, mask)
            if mask is not None
            else plan_in_layout(
                c,
                self._flats,
                self._imap(path, n) if r.strategy is CopyStrategy.SPARSE else None,
                entries,
            )
            for n, (r, c, mask) in enumerate(zip(path.copies, call.copies, masks, strict=True))
        ]
        return plans, calls

    @staticmethod
    def _masks(path: LoaderPath, call: LoaderCall) -> list[torch.Tensor | None]:
        # Read right after the call: a scratch-view input changes with the next fill.
        return [
            active_mask(c) if r.strategy is CopyStrategy.PLACEHOLDER else None
            for r, c in zip(path.copies, call.copies, strict=True)
        ]


@contextmanager
def _restoring(guard: StorageGuard, fail: Fail) -> Iterator[None]:
    """On a failed check, first put back any storage the loader replaced (and say so)."""
    try:
        yield
    except DcrError:
        guard.check(fail)
        raise


def _run_of(items: list[Item]) -> tuple[int, npt.NDArray[Any]] | None:
    """``(start, values)`` when the items are runs that together form one run (a dense
    refit's items), else ``None``."""
    runs = [i for i in items if i.count]
    if not runs or any(i.span is None or not i.span.is_run for i in runs):
        return None
    runs.sort(key=lambda i: i.span.start if i.span is not None else 0)
    first = runs[0].span
    assert first is not None
    at = first.start
    for i in runs:
        assert i.span is not None
        if i.span.start != at:
            return None
        at += i.count
    values = runs[0].values if len(runs) == 1 else np.concatenate([i.values for i in runs])
    return first.start, values


def _repeats(path: LoaderPath, call: LoaderCall) -> bool:
    """Whether the call made exactly the writes recorded at prewarm.

    Constant fills must recur too but are never executed: they rewrite a constant the dense
    load already wrote, and prewarm proved they never overlap a copy.
    """
    return len(call.writes) == len(path.writes) and all(
        matches(r, w) for r, w in zip(path.writes, call.writes, strict=True)
    )


def _refuse_shared(name: str, groups: list[npt.NDArray[np.int64]], attempt: int | None) -> None:
    """Refuse a payload whose groups of one name (different encodings) share a position."""
    seen = np.concatenate(groups)
    if seen.size != np.unique(seen).size:
        raise PayloadRejected(
            "items of this tensor with different encodings write the same position",
            attempt=attempt,
            tensor=name,
            check="overlap",
        )


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class _Group:
    """A name's merged items of one encoding in one apply call."""

    spec: TensorSpec
    path: LoaderPath
    encoding: Encoding
    entries: Entries
    merged: int


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class _Planned:
    """A group's checked writes, not yet executed."""

    writes: list[WritePlan]
    calls: int
    dense: bool
    seconds: float


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class _Prepared:
    """A payload admitted and planned: its groups and their checked writes."""

    groups: list[_Group]
    planned: list[_Planned]


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class _Running:
    """A prepared payload whose writes are under way."""

    prepared: _Prepared
    execution: Execution
    start: float


def xor_allowed_across(receivers: Iterable[Applier]) -> frozenset[str]:
    """Names every given receiver may take as XOR: what owners may XOR-encode (paper §5)."""
    allowed: frozenset[str] | None = None
    for receiver in receivers:
        mine = receiver.xor_allowed()
        allowed = mine if allowed is None else allowed & mine
    return allowed if allowed is not None else frozenset()
