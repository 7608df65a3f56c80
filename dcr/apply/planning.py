"""Planning: how admitted groups become checked loader calls and planned writes (paper §6.1).

For each group (:class:`~dcr.apply.admission.Group`) the native loader runs under the dispatch
hook and every loader condition is checked (:mod:`dcr.apply.conditions`); the call's
intercepted copies then become :class:`~dcr.apply.writes.WritePlan` objects, none executed yet.
On bit-preserving paths the item's flat indices are mapped through each copy's source view
directly to destination positions (index maps built once from the prewarm geometry); one
witness per name and attempt suffices, and the names of a payload may be witnessed in one
shared loader call.  Overwrite items on transforming paths go through the NaN placeholder (or
two passes).  :func:`stages` then orders the planned writes into stages that may run
concurrently.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from dcr.apply.admission import Group
from dcr.apply.call import Fail, LoaderCall, run_loader_batch
from dcr.apply.conditions import (
    call_checked,
    check_pattern,
    repeats_prewarm,
    violation,
    witness,
)
from dcr.apply.config import PlaceholderScheme
from dcr.apply.execution import Stage
from dcr.apply.geometry import IndexMap
from dcr.apply.loader import Loader
from dcr.apply.paths import CopyStrategy, LoaderPath
from dcr.apply.scratch import Scratch, torch_bits
from dcr.apply.storage import StorageGuard
from dcr.apply.writes import (
    FlatViews,
    WritePlan,
    active_mask,
    block_mappable,
    irregular,
    plan_block,
    plan_enumerated,
    plan_in_layout,
    plan_masked,
    plan_sparse,
)
from dcr.errors import DcrError
from dcr.tensors.records import Encoding

__all__ = ["Planned", "Planner", "stages"]


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Planned:
    """A group's checked writes, not yet executed."""

    writes: list[WritePlan]
    calls: int
    dense: bool
    seconds: float


class Planner:
    """A prewarmed receiver's loader calls and write plans, with what they keep between
    payloads: the index maps of its copies, the loader calls witnessed in the current attempt
    and whether its loader may witness several names in one call."""

    def __init__(
        self,
        loader: Loader,
        guard: StorageGuard,
        scratch: Scratch,
        placeholder: PlaceholderScheme,
    ) -> None:
        self._loader = loader
        self._guard = guard
        self._scratch = scratch
        self._placeholder = placeholder
        self._imaps: dict[tuple[str, int], IndexMap | None] = {}
        # Loader calls witnessed in the current attempt, per (name, relative encoding).
        self._witnessed: dict[tuple[str, bool], LoaderCall] = {}
        self._witness_attempt: int | None = None
        # Whether the names of a payload are witnessed in one loader call: off for good once
        # a shared call could not be split or none of its shares matched (a loader that reads
        # its input ahead), so that such a loader is not called twice per name.
        self._batching = True
        self._flats = FlatViews()

    def imap(self, path: LoaderPath, n: int) -> IndexMap | None:
        """The index map of the path's ``n``-th copy, built once from its prewarm geometry."""
        key = (path.name, n)
        if key not in self._imaps:
            copy = path.copies[n]
            self._imaps[key] = IndexMap.build(copy.src, copy.dst)
        return self._imaps[key]

    def plan(self, group: Group, attempt: int | None) -> Planned:
        start = time.perf_counter()
        writes: list[WritePlan] = []
        calls = 0
        dense = False
        if group.entries.count:
            fail = violation(attempt, group.spec.name)
            if group.encoding is Encoding.OVERWRITE and any(
                c.strategy is CopyStrategy.PLACEHOLDER for c in group.path.copies
            ):
                writes, calls = self._plan_placeholder(group, fail)
                dense = True
            else:
                writes, dense, calls = self._plan_mapped(group, fail, attempt)
        return Planned(writes=writes, calls=calls, dense=dense, seconds=time.perf_counter() - start)

    def _call(self, path: LoaderPath, view: torch.Tensor, fail: Fail) -> LoaderCall:
        return call_checked(self._loader, self._guard, self._scratch.ptr, path, view, fail)

    def _in_place(self, group: Group) -> bool:
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

    def witness_together(self, groups: list[Group], attempt: int | None) -> int:
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
        todo: dict[tuple[str, bool], Group] = {}
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
        guard, scratch = self._guard, self._scratch
        batch = list(todo.values())
        fail = violation(attempt, None)
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
            if call.reported != g.path.reported or not repeats_prewarm(g.path, call):
                continue
            try:
                witness(g, call, violation(attempt, g.spec.name), repeats=True)
            except DcrError:
                continue  # the name's own call decides
            witnessed[key] = call
            accepted += 1
        if not accepted:
            self._batching = False
        return 1

    def _plan_mapped(
        self, group: Group, fail: Fail, attempt: int | None
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
        scratch = self._scratch
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
            call = witness(group, self._call(path, view, fail), fail)
            calls = 1
            if not in_place and attempt is not None:
                witnessed[key] = call
        plans = self._write_plans(group, call, in_place)
        return plans, in_place, calls

    def _write_plans(self, group: Group, call: LoaderCall, in_place: bool) -> list[WritePlan]:
        path, entries = group.path, group.entries
        relative = group.encoding.relative
        plans = []
        for n, (record, copy) in enumerate(zip(path.copies, call.copies, strict=True)):
            imap = self.imap(path, n) if record.strategy is CopyStrategy.SPARSE else None
            if in_place:
                plans.append(plan_in_layout(copy, self._flats, imap, entries))
            elif (
                imap is not None
                and block_mappable(imap, entries)
                and (relative or copy.dst_geometry.dtype == entries.dtype)
            ):
                plans.append(plan_block(copy, self._flats, imap, entries))
            elif imap is not None:
                listed = entries.as_listed()
                plans.append(plan_sparse(copy, self._flats, imap, listed, relative=relative))
            else:
                plans.append(plan_enumerated(copy, self._flats, entries, relative=relative))
        return plans

    def _plan_placeholder(self, group: Group, fail: Fail) -> tuple[list[WritePlan], int]:
        """Dense path for overwrite items on transforming paths (paper §6.1, App. A.2).

        Scratch holds NaN at inactive positions; each masked copy's active mask is the non-NaN
        positions of its input.  Items holding NaN values (or every item, with the two-pass
        scheme) first run with actives 0.0 for the mask, then with the real values.
        """
        spec, path, entries = group.spec, group.path, group.entries
        scratch = self._scratch
        values = torch_bits(entries.values)
        two_pass = self._placeholder is PlaceholderScheme.TWO_PASS or bool(
            torch.isnan(values.view(spec.dtype)).any()
        )
        calls = 1
        masks: list[torch.Tensor | None] = []
        if two_pass:
            view = scratch.fill(spec, math.nan, entries.where, torch.zeros_like(values))
            first = self._call(path, view, fail)
            check_pattern(path, first, fail)
            masks = self._masks(path, first)
            calls = 2
        view = scratch.fill(spec, math.nan, entries.where, values)
        call = self._call(path, view, fail)
        check_pattern(path, call, fail)
        if not two_pass:
            masks = self._masks(path, call)
        plans = [
            plan_masked(c, self._flats, mask)
            if mask is not None
            else plan_in_layout(
                c,
                self._flats,
                self.imap(path, n) if r.strategy is CopyStrategy.SPARSE else None,
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


def stages(groups: list[Group], planned: list[Planned]) -> list[Stage]:
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
