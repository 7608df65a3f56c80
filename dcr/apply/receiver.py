"""The receiver data plane: apply items in place through the native loader (paper §6.1).

A :class:`Receiver` hands each item to the serving runtime's own loader as a scratch view in
canonical shape, under a dispatch hook that withholds the loader's writes into parameter and
buffer storage.  Once the call has passed every loader condition (paper App. A.2), the hook's
recorded copies are replayed as XOR or masked overwrite writes at the item's positions only,
so the receiver ends with the bits a dense load of the new checkpoint gives -- and dcr contains
no placement rule of any model.

On bit-preserving paths the item's flat indices are mapped through each copy's source view
directly to destination positions (ARCHITECTURE §5, "Beyond the paper"): no scratch fill, no
pass over the tensor, cost proportional to the entries.  Transforming paths fill scratch with
the NaN placeholder and mask the loader's transformed copy input.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from types import MappingProxyType

import torch

from dcr.apply.call import Fail, LoaderCall, run_loader
from dcr.apply.hook import SourceKind
from dcr.apply.loader import Loader
from dcr.apply.paths import CopyStrategy, LoaderPath, PathKind, matches
from dcr.apply.prewarm import classify, copy_strategy, find_overlaps, with_overlaps
from dcr.apply.scratch import Scratch, torch_bits
from dcr.apply.storage import StorageGuard
from dcr.apply.writes import (
    WritePlan,
    active_mask,
    execute,
    irregular,
    plan_mapped,
    plan_masked,
    xor_overlap,
)
from dcr.delta.records import Encoding, Item, TensorSpec
from dcr.errors import (
    ConfigError,
    DcrError,
    LoaderConditionViolated,
    LoaderPathUnsupported,
    PayloadRejected,
)

__all__ = [
    "ApplyConfig",
    "ApplyReport",
    "ItemReport",
    "LoaderPath",
    "PathKind",
    "PlaceholderScheme",
    "PrewarmReport",
    "Receiver",
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
    scratch buffer.
    """

    post_apply_checks: bool = False
    placeholder: PlaceholderScheme = PlaceholderScheme.NAN
    scratch_device: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class PrewarmReport:
    """What prewarm found: path kinds per name, scratch size, loader calls and time."""

    names: int
    preserving: int
    transforming: int
    skipped: int
    xor_allowed: int
    scratch_bytes: int
    loader_calls: int
    seconds: float


@dataclass(frozen=True, slots=True, kw_only=True)
class ItemReport:
    """One applied item: entries received, destination elements written and how.

    ``written`` counts destination elements (an entry can land 0 times -- another rank's rows
    -- or several times -- a replicated copy); ``checked`` counts post-apply-checked positions.
    ``dense`` says whether some copy was reproduced over its whole view (the placeholder path,
    or NaN/subnormal values through a cast) instead of at the entries only.
    """

    name: str
    encoding: Encoding
    kind: PathKind
    entries: int
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


class Receiver:
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
        guard = self._require_prewarm()[0]
        with torch.no_grad(), _restoring(guard, self._violation(attempt, item.name)):
            report = self._apply(item, attempt)
        guard.check(self._violation(attempt, None), full=True)
        return report

    def apply_items(self, items: Iterable[Item], *, attempt: int | None = None) -> ApplyReport:
        """Apply items in the given (declared) order; the first failure stops the sequence."""
        start = time.perf_counter()
        guard = self._require_prewarm()[0]
        with torch.no_grad(), _restoring(guard, self._violation(attempt, None)):
            done = [self._apply(item, attempt) for item in items]
        guard.check(self._violation(attempt, None), full=True)
        return ApplyReport.of(done, time.perf_counter() - start)

    def dense_load(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Restore resident weights by a dense refit through the native loader (no hook).

        Raises :class:`LoaderPathUnsupported` if the load moved any resident storage: the
        receiver then needs a new :class:`Receiver` (and prewarm) before it applies deltas.
        """
        self._loader.dense_load(state_dict)
        if self._guard is not None:
            # The dense load's bits are wanted even in new storage: report, do not restore.
            self._guard.check(self._unsupported(None), full=True, restore=False)

    # -- internals -------------------------------------------------------------------------

    def _require_prewarm(self) -> tuple[StorageGuard, Scratch]:
        if self._guard is None or self._scratch is None:
            raise ConfigError("call Receiver.prewarm() before applying items", check="prewarm")
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

    def _admit(self, item: Item, attempt: int | None) -> tuple[TensorSpec, LoaderPath]:
        """Check the item against the catalog and the path's classification."""
        self._require_prewarm()
        spec = self._catalog.get(item.name)
        if spec is None:
            raise PayloadRejected(
                "no such canonical tensor in the catalog",
                attempt=attempt,
                tensor=item.name,
                check="name",
            )
        if tuple(item.shape) != spec.shape:
            raise PayloadRejected(
                f"shape {list(item.shape)} differs from the catalog's {list(spec.shape)}",
                attempt=attempt,
                tensor=item.name,
                check="shape",
            )
        if item.dtype != spec.dtype:
            raise PayloadRejected(
                f"dtype {item.dtype} differs from the catalog's {spec.dtype}",
                attempt=attempt,
                tensor=item.name,
                check="dtype",
            )
        try:
            item.validate()
        except ConfigError as exc:
            raise PayloadRejected(
                exc.message, attempt=attempt, tensor=item.name, check=exc.check or "schema"
            ) from exc
        path = self._paths[item.name]
        if item.encoding is Encoding.XOR and not path.xor_allowed:
            why = (
                f"it overlaps {sorted(path.overlaps)}"
                if path.overlaps
                else f"its loader path is {path.kind.value}"
            )
            raise PayloadRejected(
                f"XOR entries are not allowed on this tensor: {why}",
                attempt=attempt,
                tensor=item.name,
                check="classification",
            )
        return spec, path

    def _apply(self, item: Item, attempt: int | None) -> ItemReport:
        start = time.perf_counter()
        spec, path = self._admit(item, attempt)
        xor = item.encoding is Encoding.XOR
        calls = 0
        plans: list[WritePlan] = []
        dense = False
        checked = 0
        if item.count:
            fail = self._violation(attempt, item.name)
            if not xor and any(c.strategy is CopyStrategy.PLACEHOLDER for c in path.copies):
                plans, calls = self._plan_placeholder(spec, path, item, fail)
                dense = True
            else:
                plans, dense = self._plan_mapped(spec, path, item, xor, fail)
                calls = 1
            checked = execute(plans, xor=xor, check=self._config.post_apply_checks, fail=fail)
        return ItemReport(
            name=item.name,
            encoding=item.encoding,
            kind=path.kind,
            entries=item.count,
            written=sum(p.count for p in plans),
            copies=len(plans),
            bytes_written=sum(p.nbytes for p in plans),
            loader_calls=calls,
            dense=dense,
            checked=checked,
            seconds=time.perf_counter() - start,
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
        # Constant fills must recur here but are never executed: they rewrite a constant the
        # dense load already wrote, and prewarm proved they never overlap a copy.
        if len(call.writes) != len(path.writes) or not all(
            matches(r, w) for r, w in zip(path.writes, call.writes, strict=True)
        ):
            raise fail(
                f"the loader made {len(call.writes)} writes that differ from the "
                f"{len(path.writes)} recorded at prewarm (count, destination, source or value)",
                "pattern",
            )

    def _plan_mapped(
        self, spec: TensorSpec, path: LoaderPath, item: Item, xor: bool, fail: Fail
    ) -> tuple[list[WritePlan], bool]:
        """Sparse path: scratch is handed over unfilled; only the copy geometry matters.

        Overwrite values that torch casts position-dependently (:func:`irregular`) are
        scattered into scratch and cast in the destination's layout instead (O(view)).
        """
        scratch = self._require_prewarm()[1]
        in_place = (
            not xor
            and any(c.src.dtype != c.dst.dtype for c in path.copies)
            and irregular(item.values, item.dtype)
        )
        view = (
            scratch.fill(spec, None, item.indices, torch_bits(item.values))
            if in_place
            else scratch.view(spec)
        )
        call = self._call(path, view, fail)
        if xor:
            for copy in call.copies:
                if copy.src_geometry.dtype != copy.dst_geometry.dtype:
                    raise fail(
                        f"the copy into {copy.storage.label!r} changes dtype "
                        f"({copy.src_geometry.dtype} -> {copy.dst_geometry.dtype}) on an XOR "
                        "path",
                        "xor-dtype",
                    )
                if copy.source is not SourceKind.SCRATCH:
                    raise fail(
                        f"the copy into {copy.storage.label!r} does not read scratch storage "
                        "on an XOR path",
                        "xor-source",
                    )
            plans = [
                plan_mapped(c, copy_strategy(spec, c, False, fail), item, xor=True, in_place=False)
                for c in call.copies
            ]
            if xor_overlap(plans):
                raise fail("two XOR writes of the item share destination bytes", "xor-overlap")
            self._check_pattern(path, call, fail)
            return plans, False
        self._check_pattern(path, call, fail)
        plans = [
            plan_mapped(c, r.strategy, item, xor=False, in_place=in_place)
            for r, c in zip(path.copies, call.copies, strict=True)
        ]
        return plans, in_place

    def _plan_placeholder(
        self, spec: TensorSpec, path: LoaderPath, item: Item, fail: Fail
    ) -> tuple[list[WritePlan], int]:
        """Dense path for overwrite items on transforming paths (paper §6.1, App. A.2).

        Scratch holds NaN at inactive positions; each masked copy's active mask is the non-NaN
        positions of its input.  Items holding NaN values (or every item, with the two-pass
        scheme) first run with actives 0.0 for the mask, then with the real values.
        """
        scratch = self._require_prewarm()[1]
        values = torch_bits(item.values)
        two_pass = self._config.placeholder is PlaceholderScheme.TWO_PASS or bool(
            torch.isnan(values.view(spec.dtype)).any()
        )
        calls = 1
        masks: list[torch.Tensor | None] = []
        if two_pass:
            view = scratch.fill(spec, math.nan, item.indices, torch.zeros_like(values))
            first = self._call(path, view, fail)
            self._check_pattern(path, first, fail)
            masks = self._masks(path, first)
            calls = 2
        view = scratch.fill(spec, math.nan, item.indices, values)
        call = self._call(path, view, fail)
        self._check_pattern(path, call, fail)
        if not two_pass:
            masks = self._masks(path, call)
        plans = [
            plan_masked(c, mask)
            if mask is not None
            else plan_mapped(c, r.strategy, item, xor=False, in_place=True)
            for r, c, mask in zip(path.copies, call.copies, masks, strict=True)
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


def xor_allowed_across(receivers: Iterable[Receiver]) -> frozenset[str]:
    """Names every given receiver may take as XOR: what owners may XOR-encode (paper §5)."""
    allowed: frozenset[str] | None = None
    for receiver in receivers:
        mine = receiver.xor_allowed()
        allowed = mine if allowed is None else allowed & mine
    return allowed if allowed is not None else frozenset()
