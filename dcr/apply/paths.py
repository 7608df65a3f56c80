"""Loader paths: what the native loader writes for one canonical tensor on this receiver.

Prewarm records one :class:`LoaderPath` per canonical name (paper §6.1, App. A.2 Table A.2): the
ordered writes the loader made into resident storage, and from them the path's kind -- a
bit-preserving path (identity, views, slices, splits, fusions; XOR allowed), a transforming path
(casts, pointwise transforms; overwrite only) or a native skip.  At apply time every loader call
must repeat the recorded writes exactly.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from dcr.apply.geometry import ViewGeometry
from dcr.apply.hook import InterceptedCopy, InterceptedFill, InterceptedWrite, SourceKind

__all__ = [
    "CopyRecord",
    "CopyStrategy",
    "FillRecord",
    "LoaderPath",
    "PathKind",
    "WriteRecord",
    "matches",
]


class PathKind(enum.Enum):
    """How the loader treats one canonical name on this receiver."""

    PRESERVING = "preserving"
    """Every write is a plain ``copy_`` from a view of scratch of the same dtype: XOR allowed."""
    TRANSFORMING = "transforming"
    """Some copy casts or reads a computed tensor (e.g. ``-exp(A_log)``): overwrite only."""
    SKIP = "skip"
    """The loader neither writes nor reports the name on this rank (a native skip)."""


class CopyStrategy(enum.Enum):
    """How apply reproduces one recorded copy without executing the loader's dense copy."""

    SPARSE = "sparse"
    """Map the item's indices through the source view (mixed radix): cost ~ entries."""
    ENUMERATE = "enumerate"
    """Source is a scratch view of another geometry (a broadcast): enumerate the view."""
    PLACEHOLDER = "placeholder"
    """Source is computed by the loader: fill scratch with the placeholder and mask (overwrite)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CopyRecord:
    """One recorded ``copy_`` into resident storage: destination and source geometry."""

    dst: ViewGeometry
    src: ViewGeometry
    source: SourceKind
    strategy: CopyStrategy

    @property
    def preserving(self) -> bool:
        """Whether the copy carries the scratch bits unchanged (same dtype, scratch source)."""
        return self.strategy is not CopyStrategy.PLACEHOLDER and self.src.dtype == self.dst.dtype


@dataclass(frozen=True, slots=True, kw_only=True)
class FillRecord:
    """One recorded constant fill into resident storage (e.g. vocabulary padding rows).

    The fill writes a constant that does not depend on the checkpoint, so the resident bits
    there already equal what a dense load writes; apply checks that it recurs and skips it.
    """

    dst: ViewGeometry
    value: bool | int | float


WriteRecord = CopyRecord | FillRecord


@dataclass(frozen=True, slots=True, kw_only=True)
class LoaderPath:
    """The classified loader path of one canonical name on this receiver.

    ``reported`` is whether the loader reported the name as loaded (``None`` when the loader
    does not report; then a write that bypasses the dispatch hook cannot be detected).
    ``writes`` are the loader's writes into resident storage in call order.
    ``overlaps`` names the other canonical names whose copies share destination bytes with this
    one's (tied weights); such names are not XOR-allowed.
    """

    name: str
    kind: PathKind
    reported: bool | None
    writes: tuple[WriteRecord, ...] = ()
    scratch_mutated: bool = False
    overlaps: frozenset[str] = frozenset()

    @property
    def copies(self) -> tuple[CopyRecord, ...]:
        return tuple(w for w in self.writes if isinstance(w, CopyRecord))

    @property
    def fills(self) -> tuple[FillRecord, ...]:
        return tuple(w for w in self.writes if isinstance(w, FillRecord))

    @property
    def storages(self) -> frozenset[str]:
        """Labels of the resident storages this path writes."""
        return frozenset(w.dst.storage for w in self.writes)

    @property
    def xor_allowed(self) -> bool:
        """XOR entries are safe: bit-preserving (or skipped) and no other name writes here."""
        return self.kind in (PathKind.PRESERVING, PathKind.SKIP) and not self.overlaps


def _same_value(a: bool | int | float, b: bool | int | float) -> bool:
    # repr keeps NaN == NaN and tells -0.0 from 0.0.
    return type(a) is type(b) and repr(a) == repr(b)


def matches(record: WriteRecord, write: InterceptedWrite) -> bool:
    """Whether an intercepted write repeats a recorded one (op, geometry, source kind, value)."""
    if isinstance(record, FillRecord):
        return (
            isinstance(write, InterceptedFill)
            and record.dst == write.dst_geometry
            and _same_value(record.value, write.value)
        )
    if not isinstance(write, InterceptedCopy):
        return False
    if record.dst != write.dst_geometry or record.source is not write.source:
        return False
    if record.source is SourceKind.SCRATCH:
        return record.src == write.src_geometry
    # A computed source lives in a fresh buffer: its offset and storage carry no meaning.
    src = write.src_geometry
    return (record.src.shape, record.src.stride, record.src.dtype) == (
        src.shape,
        src.stride,
        src.dtype,
    )
