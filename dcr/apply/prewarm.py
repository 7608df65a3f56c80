"""Prewarm: discover and classify every canonical name's loader path (paper §6.1, App. A.2).

For each canonical name the native loader runs once on the scratch view in discovery mode: its
writes into resident storage are recorded and withheld, so prewarm changes no resident bit.
The recorded writes decide the path kind (:class:`~dcr.apply.paths.PathKind`); transforming
paths that need the placeholder run twice more to validate the NaN scheme; finally the byte
footprints of all writes are intersected for the overlap rules ("Write overlap").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import replace

import numpy as np
import torch

from dcr.apply.call import Fail, LoaderCall
from dcr.apply.geometry import IndexMap, byte_intervals, overlapping_groups
from dcr.apply.hook import InterceptedCopy, InterceptedWrite, SourceKind, StorageInfo
from dcr.apply.paths import (
    CopyRecord,
    CopyStrategy,
    FillRecord,
    LoaderPath,
    PathKind,
    WriteRecord,
    matches,
)
from dcr.errors import LoaderPathUnsupported
from dcr.tensors.records import TensorSpec

__all__ = ["classify", "copy_strategy", "find_overlaps", "with_overlaps"]

Run = Callable[[torch.Tensor], LoaderCall]
"""Runs the loader on one prepared scratch view of the name being classified."""


def copy_strategy(
    spec: TensorSpec, copy: InterceptedCopy, scratch_mutated: bool, fail: Fail
) -> CopyStrategy:
    """How apply will reproduce ``copy`` (see :class:`~dcr.apply.paths.CopyStrategy`)."""
    if copy.source is SourceKind.OTHER:
        return CopyStrategy.PLACEHOLDER
    span = copy.src_geometry.element_span()
    if span is not None:
        size = copy.src_geometry.itemsize
        if span[0] < 0 or (span[1] + 1) * size > spec.nbytes:
            raise fail(
                f"a copy into {copy.storage.label!r} reads scratch outside the item's tensor",
                "scratch-bounds",
            )
    if copy.src_geometry.dtype != spec.dtype or scratch_mutated:
        return CopyStrategy.PLACEHOLDER
    if IndexMap.build(copy.src_geometry, copy.dst_geometry) is None:
        return CopyStrategy.ENUMERATE
    return CopyStrategy.SPARSE


def _record(
    spec: TensorSpec, write: InterceptedWrite, scratch_mutated: bool, fail: Fail
) -> WriteRecord:
    if isinstance(write, InterceptedCopy):
        return CopyRecord(
            dst=write.dst_geometry,
            src=write.src_geometry,
            source=write.source,
            strategy=copy_strategy(spec, write, scratch_mutated, fail),
        )
    return FillRecord(dst=write.dst_geometry, value=write.value)


def classify(spec: TensorSpec, run: Run, scratch_view: torch.Tensor) -> LoaderPath:
    """Classify ``spec.name``'s loader path; raises :class:`LoaderPathUnsupported`."""

    def fail(message: str, check: str) -> LoaderPathUnsupported:
        return LoaderPathUnsupported(message, tensor=spec.name, check=check)

    call = run(scratch_view)
    mutated = bool(call.scratch_writes)
    records = tuple(_record(spec, w, mutated, fail) for w in call.writes)
    if not records:
        if call.reported:
            raise fail(
                "the loader reports a load but no write reached the dispatch hook "
                "(a write that bypasses the hook)",
                "bypass",
            )
        return LoaderPath(name=spec.name, kind=PathKind.SKIP, reported=call.reported)
    copies = [r for r in records if isinstance(r, CopyRecord)]
    if not copies:
        raise fail("the loader fills resident storage but copies no value", "no-copy")
    if call.reported is False:
        raise fail("the loader writes resident storage but reports no load", "report")
    if any(c.strategy is CopyStrategy.PLACEHOLDER for c in copies):
        _validate_placeholder(spec, records, run, scratch_view, fail)
    preserving = all(c.preserving for c in copies)
    return LoaderPath(
        name=spec.name,
        kind=PathKind.PRESERVING if preserving else PathKind.TRANSFORMING,
        reported=call.reported,
        writes=records,
        scratch_mutated=mutated,
    )


def _validate_placeholder(
    spec: TensorSpec,
    records: tuple[WriteRecord, ...],
    run: Run,
    scratch_view: torch.Tensor,
    fail: Fail,
) -> None:
    """Paper App. A.2 "Placeholder schemes": NaN must survive to every masked copy's input.

    With scratch all NaN every such copy input must be all NaN (inactive positions stay
    recognisable); with scratch all zero it must hold no NaN (an active value never looks
    inactive).  The two-pass scheme used for NaN-valued entries relies on the same two facts.
    """
    if not spec.dtype.is_floating_point:
        raise fail(
            f"a transforming path needs a floating-point tensor for the NaN placeholder, "
            f"got {spec.dtype}",
            "placeholder",
        )
    for fill, want_nan in ((0.0, False), (math.nan, True)):
        scratch_view.fill_(fill)
        call = run(scratch_view)
        if len(call.writes) != len(records) or not all(
            matches(r, w) for r, w in zip(records, call.writes, strict=True)
        ):
            raise fail("the loader writes differently when the values change", "pattern")
        for record, write in zip(records, call.writes, strict=True):
            if not (
                isinstance(record, CopyRecord)
                and isinstance(write, InterceptedCopy)
                and record.strategy is CopyStrategy.PLACEHOLDER
            ):
                continue
            if not write.src.dtype.is_floating_point:
                raise fail(
                    f"the copy into {record.dst.storage!r} reads a {write.src.dtype} input; "
                    "the NaN placeholder needs floating point",
                    "placeholder",
                )
            nan = torch.isnan(write.src)
            if not (bool(nan.all()) if want_nan else not bool(nan.any())):
                what = "loses the NaN placeholder" if want_nan else "turns active zeros into NaN"
                raise fail(
                    f"the transform feeding the copy into {record.dst.storage!r} {what}",
                    "placeholder",
                )


def find_overlaps(
    paths: Mapping[str, LoaderPath], storages: Mapping[int, StorageInfo]
) -> dict[str, frozenset[str]]:
    """Names whose copies share destination bytes with other names' copies.

    Raises :class:`LoaderPathUnsupported` when two copies of one name overlap (the result
    would depend on the loader's write order, which masked writes do not reproduce) or when a
    constant fill overlaps any copy (apply skips fills, so the copy must never land under one).
    """
    index = {info.label: info.index for info in storages.values()}
    big = max((info.nbytes for info in storages.values()), default=0) + 1
    names = list(paths)
    starts, ends, owner, store, fills = [], [], [], [], []
    for n, name in enumerate(names):
        for w in paths[name].writes:
            s, e = byte_intervals(w.dst)
            starts.append(s)
            ends.append(e)
            owner.append(np.full(s.shape, n, dtype=np.int64))
            store.append(np.full(s.shape, index[w.dst.storage], dtype=np.int64))
            fills.append(np.full(s.shape, isinstance(w, FillRecord)))
    if not starts:
        return {}
    start, end = np.concatenate(starts), np.concatenate(ends)
    who, where, is_fill = np.concatenate(owner), np.concatenate(store), np.concatenate(fills)

    copy = ~is_fill
    _, group = np.unique(who[copy] * (len(storages) + 1) + where[copy], return_inverse=True)
    base = group.astype(np.int64) * big
    for labels in overlapping_groups(start[copy] + base, end[copy] + base, who[copy]):
        raise LoaderPathUnsupported(
            "two copies of one name write the same resident bytes",
            tensor=names[int(labels[0])],
            check="self-overlap",
        )

    base = where * big
    row = np.arange(start.size, dtype=np.int64)
    for rows in overlapping_groups(start + base, end + base, row):
        if is_fill[rows].any() and (~is_fill[rows]).any():
            filler = names[int(who[rows][is_fill[rows]][0])]
            writer = names[int(who[rows][~is_fill[rows]][0])]
            raise LoaderPathUnsupported(
                f"a constant fill of {filler!r} overlaps a copy of {writer!r}",
                tensor=filler,
                check="fill-overlap",
            )

    base = where[copy] * big
    shared: dict[str, set[str]] = {}
    for labels in overlapping_groups(start[copy] + base, end[copy] + base, who[copy]):
        members = {names[int(i)] for i in np.unique(labels)}
        if len(members) > 1:
            for m in members:
                shared.setdefault(m, set()).update(members - {m})
    return {name: frozenset(others) for name, others in shared.items()}


def with_overlaps(
    paths: Mapping[str, LoaderPath], overlaps: Mapping[str, frozenset[str]]
) -> dict[str, LoaderPath]:
    """``paths`` with each path's ``overlaps`` filled in."""
    return {
        name: replace(path, overlaps=overlaps.get(name, frozenset()))
        for name, path in paths.items()
    }
