"""The body of a format version 1 payload (paper App. D): a preamble, an item table of
variable-length entries, a location buffer of run- or gap-coded indices and a value buffer,
both grouped into width classes.

Each table entry is parsed and checked as it is read; offsets must equal the running word count
of their width class (canonical packing), so the buffers are tiled exactly.  Every entry of one
name carries the same shape and dtype, so that one ``numel`` bounds them all.  The positions and
the per-item checks after the table are array operations over all items
(:mod:`~dcr.wire.decode.gaps`); items of one name never share a position
(:mod:`~dcr.wire.decode.overlap`).
"""

from __future__ import annotations

import struct
from collections.abc import Container, Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from dcr.errors import PayloadRejected
from dcr.tensors.bits import DTYPE_FROM_CODE, dtype_name
from dcr.tensors.records import Encoding, TensorSpec
from dcr.wire.decode.body import (
    NATIVE_WORDS,
    Body,
    Chunks,
    check_tensor,
    class_matrices,
    read_words,
    reject,
    take_words,
)
from dcr.wire.decode.gaps import check_bools, check_runs, gap_positions
from dcr.wire.decode.header import Framing
from dcr.wire.decode.overlap import check_disjoint
from dcr.wire.decode.rice import Reject
from dcr.wire.format import BODY_PREAMBLE, ITEM_ENTRY, WORD_WIDTHS, DecodeLimits, Items
from dcr.wire.locations import GAP_WIDTHS, V1_KINDS, LocationKind
from dcr.wire.planes import word_dtype

__all__ = ["decode_v1"]

Int64s = npt.NDArray[np.int64]

_V1_ENCODINGS = {int(e): e for e in (Encoding.XOR, Encoding.OVERWRITE)}
_V1_KINDS = {int(k): k for k in LocationKind if int(k) in V1_KINDS}


@dataclass(slots=True, kw_only=True)
class _Entry:
    """One parsed, checked version 1 item table entry."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    encoding: Encoding
    kind: LocationKind
    count: int
    numel: int
    location: int
    value: int


@dataclass(slots=True, kw_only=True)
class _Seen:
    """What the entries of one name so far declared: every entry of a name carries the same
    shape and dtype, so that one ``numel`` bounds all of them."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    items: int = 0
    entries: int = 0


def _parse_table(
    table: Chunks,
    n_items: int,
    *,
    attempt: int,
    limits: DecodeLimits,
    catalog: Mapping[str, TensorSpec] | None,
    xor_allowed: Container[str] | None,
) -> tuple[list[_Entry], dict[int, int], dict[int, int]]:
    """Parse ``n_items`` version 1 table entries from ``table``, checking each one.

    Offsets must equal the running word count of their width class (canonical packing), so the
    buffers are tiled exactly, without holes or overlaps.  Returns the entries and the word
    totals of the gap and value width classes.
    """
    entries: list[_Entry] = []
    gap_next = dict.fromkeys(WORD_WIDTHS, 0)
    value_next = dict.fromkeys(WORD_WIDTHS, 0)
    per_name: dict[str, _Seen] = {}
    for i in range(n_items):
        fixed = table.take(ITEM_ENTRY.size)
        if fixed is None:
            raise reject(attempt, f"item table ends inside entry {i}", "schema")
        name_len, code, enc, kind_code, ndim, count, location, value = ITEM_ENTRY.unpack(fixed)
        if name_len > limits.max_name_bytes or name_len == 0:
            raise reject(
                attempt,
                f"entry {i}: name of {name_len} bytes (limit {limits.max_name_bytes})",
                "name",
            )
        if ndim > limits.max_ndim:
            raise reject(
                attempt,
                f"entry {i}: {ndim} dimensions exceed the limit of {limits.max_ndim}",
                "shape",
            )
        rest = table.take(8 * ndim + name_len)
        if rest is None:
            raise reject(attempt, f"item table ends inside entry {i}", "schema")
        shape: tuple[int, ...] = struct.unpack_from(f"<{ndim}Q", rest)
        try:
            name = rest[8 * ndim :].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise reject(attempt, f"entry {i}: name is not valid UTF-8", "name") from exc

        dtype = DTYPE_FROM_CODE.get(code)
        if dtype is None:
            raise reject(attempt, f"unknown dtype code {code}", "dtype", name)
        if enc not in _V1_ENCODINGS:
            raise reject(attempt, f"unknown encoding {enc}", "encoding", name)
        if kind_code not in _V1_KINDS:
            raise reject(attempt, f"unknown location kind {kind_code}", "encoding", name)
        encoding = _V1_ENCODINGS[enc]
        kind = _V1_KINDS[kind_code]
        numel = check_tensor(name, shape, dtype, attempt=attempt, limits=limits, catalog=catalog)
        if numel >= 1 << 63:
            raise reject(attempt, f"shape {list(shape)} has 2**63 elements or more", "shape", name)
        seen = per_name.setdefault(name, _Seen(shape=shape, dtype=dtype))
        if shape != seen.shape:
            raise reject(
                attempt,
                f"shape {list(shape)} differs from an earlier entry's {list(seen.shape)}",
                "shape",
                name,
            )
        if dtype != seen.dtype:
            raise reject(
                attempt,
                f"dtype {dtype_name(dtype)} differs from an earlier entry's "
                f"{dtype_name(seen.dtype)}",
                "dtype",
                name,
            )
        if xor_allowed is not None and encoding is Encoding.XOR and name not in xor_allowed:
            raise reject(
                attempt,
                "XOR entry for a tensor whose loader path does not allow XOR",
                "classification",
                name,
            )
        if count > numel:
            raise reject(attempt, f"{count} entries exceed {numel} elements", "bounds", name)
        seen.items += 1
        seen.entries += count
        if seen.items > limits.max_items_per_tensor:
            raise reject(
                attempt,
                f"more than {limits.max_items_per_tensor} items for one tensor",
                "oversized",
                name,
            )
        if seen.entries > numel:
            raise reject(
                attempt,
                f"{seen.entries} entries in one payload exceed {numel} elements",
                "bounds",
                name,
            )
        if kind is not LocationKind.RUN:
            gap_width = GAP_WIDTHS[kind]
            if location != gap_next[gap_width]:
                raise reject(
                    attempt,
                    f"gap offset {location}, expected {gap_next[gap_width]}",
                    "bounds",
                    name,
                )
            gap_next[gap_width] += count
        width = NATIVE_WORDS[dtype].itemsize
        if value != value_next[width]:
            raise reject(
                attempt, f"value offset {value}, expected {value_next[width]}", "bounds", name
            )
        value_next[width] += count
        entries.append(
            _Entry(
                name=name,
                shape=shape,
                dtype=dtype,
                encoding=encoding,
                kind=kind,
                count=count,
                numel=numel,
                location=location,
                value=value,
            )
        )
    if table.rest:
        raise reject(attempt, f"{table.rest} bytes after the last item table entry", "schema")
    return entries, gap_next, value_next


def _entry_reject(attempt: int, entries: list[_Entry]) -> Reject:
    """The rejection of a check on the entries, naming the tensor of the entry it names."""

    def reject_entry(message: str, check: str, item: int | None = None) -> PayloadRejected:
        return reject(attempt, message, check, None if item is None else entries[item].name)

    return reject_entry


def decode_v1(
    body: Body,
    framing: Framing,
    attempt: int,
    limits: DecodeLimits,
    catalog: Mapping[str, TensorSpec] | None,
    xor_allowed: Container[str] | None,
) -> Items:
    """The checked items of a version 1 body (the rest of ``body``); raises
    :class:`~dcr.errors.PayloadRejected`."""
    if body.remaining < BODY_PREAMBLE.size:
        raise reject(attempt, f"body of {body.remaining} bytes cannot hold its preamble", "schema")
    table_bytes, location_bytes, value_bytes = BODY_PREAMBLE.unpack(
        body.read(BODY_PREAMBLE.size).tobytes()
    )
    if table_bytes + location_bytes + value_bytes != body.remaining:
        raise reject(attempt, "preamble lengths do not add up to the body length", "schema")
    most = framing.n_items * (ITEM_ENTRY.size + 8 * limits.max_ndim + limits.max_name_bytes)
    if table_bytes > most:
        raise reject(attempt, f"item table of {table_bytes} bytes exceeds {most}", "schema")
    entries, gap_totals, value_totals = _parse_table(
        Chunks(body, table_bytes),
        framing.n_items,
        attempt=attempt,
        limits=limits,
        catalog=catalog,
        xor_allowed=xor_allowed,
    )
    for buffer, declared, totals in (
        ("location", location_bytes, gap_totals),
        ("value", value_bytes, value_totals),
    ):
        needed = sum(w * n for w, n in totals.items())
        if needed != declared:
            raise reject(
                attempt, f"items need {needed} {buffer} bytes, buffer has {declared}", "bounds"
            )

    layout = framing.layout
    gaps = class_matrices(body.read(location_bytes), gap_totals, layout)
    values = read_words(body, value_totals, layout)
    reject_entry = _entry_reject(attempt, entries)
    tensors: dict[tuple[str, tuple[int, ...], torch.dtype], int] = {}
    n = len(entries)
    tensor = np.fromiter(
        (tensors.setdefault((e.name, e.shape, e.dtype), len(tensors)) for e in entries),
        dtype=np.int64,
        count=n,
    )
    count = np.fromiter((e.count for e in entries), dtype=np.int64, count=n)
    numel = np.fromiter((e.numel for e in entries), dtype=np.int64, count=n)
    location = np.fromiter((e.location for e in entries), dtype=np.uint64, count=n)
    kind = np.fromiter((int(e.kind) for e in entries), dtype=np.int64, count=n)
    is_run = kind == int(LocationKind.RUN)
    run = np.where(is_run, location.astype(np.int64), -1)
    start = np.zeros(n, dtype=np.int64)
    np.cumsum(np.where(is_run, 0, count)[:-1], out=start[1:])
    indices = np.empty(int(count[~is_run].sum()), dtype=np.int64)
    # Every item's check at once; the first failing item (in table order) is reported.
    failures = [check_runs(is_run, location, count, numel)]
    for gap_kind, width in GAP_WIDTHS.items():
        members = np.flatnonzero(kind == int(gap_kind))
        if members.shape[0]:
            words = take_words(gaps[width], 0, gap_totals[width], word_dtype(width), layout)
            failures.append(gap_positions(words, members, count, numel, start, indices))
    is_bool = np.fromiter((e.dtype == torch.bool for e in entries), dtype=bool, count=n)
    narrow = np.fromiter((NATIVE_WORDS[e.dtype].itemsize == 1 for e in entries), bool, count=n)
    failures.append(check_bools(values[1], is_bool, narrow, count))
    found = [f for f in failures if f is not None]
    if found:
        item, message = min(found)
        raise reject_entry(message, "bounds", item)
    check_disjoint(tensor, count, run, start, indices, reject_entry)
    return Items(
        verified=True,
        tensors=list(tensors),
        tensor=tensor,
        encoding=np.array([int(e.encoding) for e in entries], dtype=np.int64),
        start=start,
        count=count,
        value_start=np.array([e.value for e in entries], dtype=np.int64),
        indices=indices,
        values={w: v for w, v in values.items() if v.shape[0]},
        run=run,
    )
