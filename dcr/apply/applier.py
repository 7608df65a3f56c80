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

:class:`Applier` ties the phases together; each lives in its own module: admission
(:mod:`dcr.apply.admission`), the loader conditions (:mod:`dcr.apply.conditions`), planning
(:mod:`dcr.apply.planning`) and the writes (:mod:`dcr.apply.writes`, :mod:`dcr.apply.rmw`,
:mod:`dcr.apply.execution`); settings and reports are in :mod:`dcr.apply.config` and
:mod:`dcr.apply.reports`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
import torch

from dcr.apply.admission import Admission, Group
from dcr.apply.call import LoaderCall, run_loader
from dcr.apply.conditions import unsupported, violation
from dcr.apply.config import ApplyConfig, PlaceholderScheme
from dcr.apply.execution import Execution
from dcr.apply.loader import Loader
from dcr.apply.pages import HugePages, advise_huge_pages
from dcr.apply.paths import LoaderPath, PathKind
from dcr.apply.planning import Planned, Planner, stages
from dcr.apply.prewarm import classify, find_overlaps, with_overlaps
from dcr.apply.reports import ApplyReport, ItemReport, PrewarmReport
from dcr.apply.scratch import Scratch
from dcr.apply.storage import StorageGuard, restoring
from dcr.apply.writes import WritePlan
from dcr.errors import ConfigError
from dcr.tensors.bits import numpy_bits_dtype
from dcr.tensors.records import Item, TensorSpec
from dcr.wire.format import Items

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


class Applier:
    """One rollout rank's in-place delta application through its native loader."""

    def __init__(
        self,
        loader: Loader,
        catalog: Mapping[str, TensorSpec],
        config: ApplyConfig = ApplyConfig(),  # noqa: B008 -- frozen, shared safely
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
        self._planner: Planner | None = None
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
        with restoring(guard, unsupported(None)):
            for name, spec in self._catalog.items():

                def run(view: torch.Tensor, name: str = name) -> LoaderCall:
                    nonlocal calls
                    calls += 1
                    return run_loader(
                        self._loader, guard, scratch.ptr, name, view, unsupported(name)
                    )

                paths[name] = classify(spec, run, scratch.view(spec))
        paths = with_overlaps(paths, find_overlaps(paths, guard.protected))
        guard.check(unsupported(None), full=True)
        huge = (
            advise_huge_pages(t for _, t in self._loader.storage_tensors())
            if self._config.huge_pages
            else HugePages()
        )
        self._guard, self._scratch, self._paths = guard, scratch, paths
        self._planner = Planner(self._loader, guard, scratch, self._config.placeholder)
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
        dtype; a decoded :class:`~dcr.wire.format.Items` has its distinct tensors checked
        before any item object is made), its own arrays (bounds, strictly increasing
        indices) and the prewarm paths (XOR and ULP only where :meth:`xor_allowed`; ULP only
        for float dtypes); items of one name and encoding are merged into one group, and two
        items of one name that share a position are refused (:class:`PayloadRejected`, check
        ``"overlap"``), whatever their encodings, since their order would decide the result
        (the decoder refuses such a payload too).  *Plan*: the native loader runs
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
                prepared = self._prepare(items, attempt)
                if running is not None:
                    done, running = running, None
                    landed = (done, self._land(done, attempt), time.perf_counter())
                running = _Running(
                    prepared=prepared,
                    execution=Execution(
                        stages(prepared.groups, prepared.planned),
                        check=self._config.post_apply_checks,
                        fail=violation(attempt, None),
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

    def _prepare(self, items: Iterable[Item], attempt: int | None) -> _Prepared:
        """Admit and plan one payload: every check that can refuse it, and no write."""
        guard, _, planner = self._require_prewarm()
        groups = self._admit_all(items, attempt)
        with torch.no_grad(), restoring(guard, violation(attempt, None)):
            t0 = time.perf_counter()
            batched = planner.witness_together(groups, attempt)
            together = time.perf_counter() - t0
            planned = [planner.plan(group, attempt) for group in groups]
            # Before any write: a loader call may have replaced a parameter, so re-enumerate
            # them all; without one, the storages to be written must still be resident.
            if batched or any(p.calls for p in planned):
                guard.check(violation(attempt, None), full=True)
            else:
                guard.check(
                    violation(attempt, None),
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
        with restoring(self._require_prewarm()[0], violation(attempt, None)):
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
            self._guard.check(unsupported(None), full=True, restore=False)

    # -- internals -------------------------------------------------------------------------

    def _require_prewarm(self) -> tuple[StorageGuard, Scratch, Planner]:
        if self._guard is None or self._scratch is None or self._planner is None:
            raise ConfigError("call Applier.prewarm() before applying items", check="prewarm")
        return self._guard, self._scratch, self._planner

    def _admit_all(self, items: Iterable[Item], attempt: int | None) -> list[Group]:
        """Check every item and merge items of one name and encoding (no loader call).

        A decoded payload (:class:`~dcr.wire.format.Items`) has its distinct tensors checked
        against the catalog before any item object is made, so unknown names cost nothing per
        item."""
        self._require_prewarm()
        admission = Admission(
            catalog=self._catalog,
            words=self._words,
            paths=self._paths,
            xor_allowed=self._xor_allowed,
        )
        if isinstance(items, Items):
            admission.admit_tensors(items.tensors, attempt)
        return admission.admit_all(list(items), attempt)


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class _Prepared:
    """A payload admitted and planned: its groups and their checked writes."""

    groups: list[Group]
    planned: list[Planned]


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
