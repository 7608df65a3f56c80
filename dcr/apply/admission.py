"""Admission: what a payload's items must satisfy before anything is written.

Every item of a payload is checked against the receiver's catalog (name, shape, dtype) --
for a decoded payload, its distinct tensors first, before any item object is made -- its
own arrays (schema, bounds, strictly increasing indices) and the prewarm paths (XOR and ULP
only on names where they are allowed, paper §5 and App. A.2; ULP only for float dtypes).
Items of one name and encoding are merged into one :class:`Group`; two items of one name that
share a position are refused (:class:`PayloadRejected`, check ``"overlap"``), whatever their
encodings, since their order would decide the result.  Admission calls no loader and writes
nothing: a payload refused here leaves every stored bit as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from dcr import native
from dcr.apply.paths import LoaderPath
from dcr.apply.writes import Entries, entries_of
from dcr.errors import PayloadRejected
from dcr.tensors.ordered import ULP_DTYPES
from dcr.tensors.records import Encoding, Item, Span, TensorSpec

__all__ = ["Admission", "Group"]


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Group:
    """A name's merged items of one encoding in one apply call."""

    spec: TensorSpec
    path: LoaderPath
    encoding: Encoding
    entries: Entries
    merged: int


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Admission:
    """The checks of one receiver: its catalog, value word types and prewarm paths, and the
    names on which XOR and ULP entries are allowed."""

    catalog: Mapping[str, TensorSpec]
    words: Mapping[str, np.dtype[Any]]
    paths: Mapping[str, LoaderPath]
    xor_allowed: frozenset[str]

    def admit_all(self, items: list[Item], attempt: int | None) -> list[Group]:
        """Check every item and merge items of one name and encoding (no loader call)."""
        by_key: dict[tuple[str, Encoding], list[Item]] = {}
        for item in items:
            self.admit(item, attempt)
            by_key.setdefault((item.name, item.encoding), []).append(item)
        groups = [self.merge(key[0], key[1], members, attempt) for key, members in by_key.items()]
        encodings: dict[str, list[Group]] = {}
        for g in groups:
            encodings.setdefault(g.spec.name, []).append(g)
        for name, same in encodings.items():
            if len(same) > 1:
                _refuse_shared(name, [g.entries.indices for g in same], attempt)
        return groups

    def admit_tensors(
        self, tensors: Iterable[tuple[str, tuple[int, ...], torch.dtype]], attempt: int | None
    ) -> None:
        """Check the distinct ``(name, shape, dtype)`` of a decoded payload's items against the
        catalog before any item is made (O(tensors), nothing per item): a payload of unknown
        names is refused at the cost of its tensor list, however many items it holds."""
        for name, shape, dtype in tensors:
            self._spec(name, shape, dtype, attempt)

    def _spec(
        self, name: str, shape: Sequence[int], dtype: torch.dtype, attempt: int | None
    ) -> TensorSpec:
        """The catalog's spec of ``name``, which must have ``shape`` and ``dtype``."""

        def reject(message: str, check: str) -> PayloadRejected:
            return PayloadRejected(message, attempt=attempt, tensor=name, check=check)

        spec = self.catalog.get(name)
        if spec is None:
            raise reject("no such canonical tensor in the catalog", "name")
        if tuple(shape) != spec.shape:
            raise reject(
                f"shape {list(shape)} differs from the catalog's {list(spec.shape)}", "shape"
            )
        if dtype != spec.dtype:
            raise reject(f"dtype {dtype} differs from the catalog's {spec.dtype}", "dtype")
        return spec

    def admit(self, item: Item, attempt: int | None) -> None:
        """Check one item against the catalog and the path's classification (O(1))."""

        def reject(message: str, check: str) -> PayloadRejected:
            return PayloadRejected(message, attempt=attempt, tensor=item.name, check=check)

        spec = self._spec(item.name, item.shape, item.dtype, attempt)
        if not isinstance(item.encoding, Encoding):
            raise reject(f"unknown encoding {item.encoding!r}", "encoding")
        want = self.words[item.name]
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
            if item.name not in self.xor_allowed:
                path = self.paths[item.name]
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

    def merge(self, name: str, encoding: Encoding, items: list[Item], attempt: int | None) -> Group:
        """One group of a name's items of one encoding: bounds, order and shared positions.

        Each item's indices must be strictly increasing and inside the tensor; the merged
        indices are sorted, and a position held by two items is refused.  Vectorized over the
        concatenation, so many small items cost about as much as one item of their entries.
        """
        spec = self.catalog[name]

        def reject(message: str, check: str) -> PayloadRejected:
            return PayloadRejected(message, attempt=attempt, tensor=name, check=check)

        run = _run_of(items)
        if run is not None:
            start, values = run
            if start < 0 or start + values.shape[0] > spec.numel:
                raise reject("index out of range", "bounds")
            return Group(
                spec=spec,
                path=self.paths[name],
                encoding=encoding,
                entries=entries_of(start, values, spec.dtype),
                merged=len(items),
            )
        span = items[0].span if len(items) == 1 else None
        if span is not None and span.gap and items[0].count:
            # Strided rows (a row-parallel rank's columns, sent whole): implied, not listed.
            values = items[0].values
            if span.index(values.shape[0] - 1) >= spec.numel:
                raise reject("index out of range", "bounds")
            rows = Entries(
                values=values, dtype=spec.dtype, start=span.start, period=span.period, gap=span.gap
            )
            return Group(
                spec=spec, path=self.paths[name], encoding=encoding, entries=rows, merged=1
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
                indices, values = _sorted(items, indices, values, encoding, reject)
            if int(indices[0]) < 0 or int(indices[-1]) >= spec.numel:
                raise reject("index out of range", "bounds")
        return Group(
            spec=spec,
            path=self.paths[name],
            encoding=encoding,
            entries=entries_of(indices, values, spec.dtype),
            merged=len(items),
        )


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


def _run_of(items: list[Item]) -> tuple[int, npt.NDArray[Any]] | None:
    """``(start, values)`` when the items are runs that together form one run (a dense
    refit's items), or row spans that interleave into one (each training rank's columns of a
    row-parallel tensor), else ``None``."""
    runs = [i for i in items if i.count]
    if not runs or any(i.span is None for i in runs):
        return None
    if any(not i.span.is_run for i in runs):  # type: ignore[union-attr]
        return _interleaved(runs)
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


def _interleaved(spans: list[Item]) -> tuple[int, npt.NDArray[Any]] | None:
    """``(start, values)`` of ``m`` row spans of equal shape whose rows sit side by side
    (span ``i`` starts ``i * period`` after the first, ``gap == (m - 1) * period``): together
    they are every element of their rows, one run.  Anything else is ``None``."""
    first = spans[0].span
    assert first is not None
    m, period, count = len(spans), first.period, spans[0].count
    if m < 2 or not period or count % period or first.gap != (m - 1) * period:
        return None
    ordered = sorted(spans, key=lambda i: i.span.start if i.span is not None else 0)
    lo = ordered[0].span.start  # type: ignore[union-attr]
    for k, item in enumerate(ordered):
        span = item.span
        assert span is not None
        if (item.count, span.period, span.gap, span.start) != (count, period, first.gap,
                                                               lo + k * period):  # fmt: skip
            return None
    rows = count // period
    out = np.empty((rows, m * period), dtype=spans[0].values.dtype)
    for k, item in enumerate(ordered):
        out[:, k * period : (k + 1) * period] = item.values.reshape(rows, period)
    return lo, out.reshape(-1)


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
