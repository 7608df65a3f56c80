"""The tables of a format version 2 or 3 body (paper App. D): its preamble, the tensor list,
the fixed-size item records (version 3's also carry each item's last index, and the period and
gap of ROWS locations), and the buffer sizes the records imply.

The tensor list takes one Python step per distinct tensor; the item records are checked as
arrays, never a Python object per item.  Every buffer size follows from the checked records and
is checked against the body before any buffer is read (:class:`Buffers`).
"""

from __future__ import annotations

import struct
from collections.abc import Container, Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt
import torch

from dcr.errors import PayloadRejected
from dcr.tensors.bits import DTYPE_FROM_CODE
from dcr.tensors.ordered import ULP_DTYPES
from dcr.tensors.records import Encoding, TensorSpec
from dcr.wire.decode.body import NATIVE_WORDS, Body, check_tensor, reject
from dcr.wire.decode.rice import U64, Reject, per_k
from dcr.wire.format import (
    ITEM_RECORD,
    ITEM_RECORD_V3,
    PREAMBLE_V2,
    TENSOR_ENTRY,
    V3,
    WORD_WIDTHS,
    DecodeLimits,
    ValueLayout,
)
from dcr.wire.locations import V2_KINDS, V3_KINDS, LocationKind
from dcr.wire.split import remainder_bytes

__all__ = [
    "TOP",
    "Buffers",
    "Preamble",
    "Records",
    "TensorList",
    "plan_buffers",
    "read_preamble",
    "read_records",
    "read_tensor_list",
    "record_dtype",
]

_V2_ENCODINGS = frozenset(int(e) for e in Encoding)
TOP = float(1 << 62)
"""Sums above this (computed in floats) may not fit the 64-bit words they are checked in."""

Int64s = npt.NDArray[np.int64]
Bools = npt.NDArray[np.bool_]


def record_dtype(version: int) -> np.dtype[np.void]:
    """The item record of format ``version`` (2 or 3)."""
    return ITEM_RECORD_V3 if version == V3 else ITEM_RECORD


@dataclass(frozen=True, slots=True, kw_only=True)
class Preamble:
    """The checked version 2 or 3 preamble, with the item count of the header."""

    n_items: int
    n_tensors: int
    tensor_bytes: int
    record_bytes: int
    n_loc_esc: int
    """Escape words of the location symbols."""
    n_val_esc: int
    """Escape words of the value symbols."""


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class TensorList:
    """The checked tensor list: each distinct tensor once, and what the item checks need of
    each as arrays indexed by tensor id."""

    tensors: list[tuple[str, tuple[int, ...], torch.dtype]]
    numels: Int64s
    widths: Int64s
    """Bytes of the word each tensor's values travel as."""
    float_ok: Bools
    """Whether the tensor is a float (may carry ULP entries)."""
    relative_ok: Bools
    """Whether the tensor's loader path allows relative (XOR and ULP) entries."""
    is_bool: Bools


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Records:
    """The checked item records, one array per field in item order, and the per-item values
    later steps derive from them."""

    tid: Int64s
    """The tensor (index into the tensor list) of each item."""
    enc: npt.NDArray[np.uint8]
    count: Int64s
    start_u: npt.NDArray[np.uint64]
    """First index: a run's or rows' start, or a Rice item's first position."""
    last_u: npt.NDArray[np.uint64] | None
    """The last index each record states (version 3; ``None`` in version 2): checked against
    a run's or rows' own last index here, a Rice item's once its gaps are joined."""
    period: Int64s
    """Elements per row of a ROWS item (0 for other kinds)."""
    gap: Int64s
    """Elements between the rows of a ROWS item (0 for other kinds)."""
    lk: Int64s
    """Rice parameter of the gaps."""
    vk: Int64s
    """Rice parameter of the ULP values."""
    numel: Int64s
    """Elements of each item's tensor."""
    item_width: Int64s
    """Bytes of each item's value word."""
    ulp: Bools
    rice: Bools
    rows: Bools
    """Items whose locations are ROWS (version 3): implied by the record, no gaps."""
    reject: Reject
    """The rejection of a check that names an item."""


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Buffers:
    """The buffers that follow the item records, sized by the records and read from ``body``.

    ``sizes`` holds the byte length of each buffer in body order: location symbols, location
    remainders, location escapes, value words, value symbols (nibbles), value remainders,
    value escapes; their sum was checked to be the rest of the body.
    """

    body: Body
    layout: ValueLayout
    attempt: int
    gaps_n: Int64s
    """Gaps of each item (``count - 1`` for a Rice item, else 0)."""
    n_gaps: int
    loc_ks: dict[int, int]
    """Rice parameter -> gaps split with it, ascending."""
    esc_loc: dict[int, int]
    """Words per width class of the location escapes (all u64)."""
    val_words: dict[int, int]
    """Words per width class of the XOR and overwrite values."""
    ulp_n: Int64s
    """ULP values of each item."""
    n_ulp: int
    val_ks: dict[int, int]
    """Rice parameter -> ULP values split with it, ascending."""
    esc_val: dict[int, int]
    """Words per width class of the value escapes (all u64)."""
    sizes: list[int]


def read_preamble(
    body: Body, n_items: int, attempt: int, limits: DecodeLimits, version: int
) -> Preamble:
    """The preamble of a version 2 or 3 body, checked against the item count and the
    limits."""
    if body.remaining < PREAMBLE_V2.size:
        raise reject(attempt, f"body of {body.remaining} bytes cannot hold its preamble", "schema")
    n_tensors, reserved, tensor_bytes, n_loc_esc, n_val_esc = PREAMBLE_V2.unpack(
        body.read(PREAMBLE_V2.size).tobytes()
    )
    if reserved:
        raise reject(attempt, "reserved preamble field is not zero", "schema")
    if n_tensors > n_items or (n_items and not n_tensors):
        raise reject(attempt, f"{n_tensors} tensors for {n_items} items", "schema")
    if n_items > n_tensors * limits.max_items_per_tensor:
        raise reject(
            attempt,
            f"{n_items} items for {n_tensors} tensors exceed {limits.max_items_per_tensor} each",
            "oversized",
        )
    most = n_tensors * (TENSOR_ENTRY.size + 8 * limits.max_ndim + limits.max_name_bytes)
    if tensor_bytes > most:
        raise reject(attempt, f"tensor list of {tensor_bytes} bytes exceeds {most}", "schema")
    record_bytes = n_items * record_dtype(version).itemsize
    if tensor_bytes + record_bytes > body.remaining:
        raise reject(attempt, "the body ends inside the item records", "schema")
    return Preamble(
        n_items=n_items,
        n_tensors=n_tensors,
        tensor_bytes=tensor_bytes,
        record_bytes=record_bytes,
        n_loc_esc=n_loc_esc,
        n_val_esc=n_val_esc,
    )


def read_tensor_list(
    body: Body,
    preamble: Preamble,
    *,
    attempt: int,
    limits: DecodeLimits,
    catalog: Mapping[str, TensorSpec] | None,
    xor_allowed: Container[str] | None,
) -> TensorList:
    """The tensor list: one Python step per distinct tensor."""
    n_tensors = preamble.n_tensors
    tensor_bytes = preamble.tensor_bytes
    raw = body.read(tensor_bytes).tobytes()
    tensors: list[tuple[str, tuple[int, ...], torch.dtype]] = []
    numels = np.empty(n_tensors, dtype=np.int64)
    widths = np.empty(n_tensors, dtype=np.int64)
    float_ok = np.empty(n_tensors, dtype=bool)
    relative_ok = np.empty(n_tensors, dtype=bool)
    is_bool = np.empty(n_tensors, dtype=bool)
    names: set[str] = set()
    pos = 0
    for t in range(n_tensors):
        if pos + TENSOR_ENTRY.size > tensor_bytes:
            raise reject(attempt, f"tensor list ends inside tensor {t}", "schema")
        name_len, code, ndim = TENSOR_ENTRY.unpack_from(raw, pos)
        pos += TENSOR_ENTRY.size
        if name_len > limits.max_name_bytes or name_len == 0:
            raise reject(
                attempt,
                f"tensor {t}: name of {name_len} bytes (limit {limits.max_name_bytes})",
                "name",
            )
        if ndim > limits.max_ndim:
            raise reject(
                attempt,
                f"tensor {t}: {ndim} dimensions exceed the limit of {limits.max_ndim}",
                "shape",
            )
        if pos + 8 * ndim + name_len > tensor_bytes:
            raise reject(attempt, f"tensor list ends inside tensor {t}", "schema")
        shape: tuple[int, ...] = struct.unpack_from(f"<{ndim}Q", raw, pos)
        pos += 8 * ndim
        try:
            name = raw[pos : pos + name_len].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise reject(attempt, f"tensor {t}: name is not valid UTF-8", "name") from exc
        pos += name_len
        if name in names:
            raise reject(attempt, "tensor listed twice", "name", name)
        names.add(name)
        dtype = DTYPE_FROM_CODE.get(code)
        if dtype is None:
            raise reject(attempt, f"unknown dtype code {code}", "dtype", name)
        elements = check_tensor(name, shape, dtype, attempt=attempt, limits=limits, catalog=catalog)
        if elements >= 1 << 63:
            raise reject(attempt, f"shape {list(shape)} has 2**63 elements or more", "shape", name)
        numels[t] = elements
        widths[t] = NATIVE_WORDS[dtype].itemsize
        float_ok[t] = dtype in ULP_DTYPES
        relative_ok[t] = xor_allowed is None or name in xor_allowed
        is_bool[t] = dtype == torch.bool
        tensors.append((name, shape, dtype))
    if pos != tensor_bytes:
        raise reject(attempt, f"{tensor_bytes - pos} bytes after the last tensor", "schema")
    return TensorList(
        tensors=tensors,
        numels=numels,
        widths=widths,
        float_ok=float_ok,
        relative_ok=relative_ok,
        is_bool=is_bool,
    )


def _item_reject(
    attempt: int, tensors: list[tuple[str, tuple[int, ...], torch.dtype]], tid: Int64s
) -> Reject:
    """The rejection of a check on the items, naming the tensor of the item it names."""

    def reject_item(message: str, check: str, item: int | None = None) -> PayloadRejected:
        tensor = None if item is None else tensors[int(tid[item])][0]
        return reject(attempt, message, check, tensor)

    return reject_item


def read_records(
    body: Body,
    preamble: Preamble,
    table: TensorList,
    *,
    attempt: int,
    limits: DecodeLimits,
    version: int,
) -> Records:
    """The item records of format ``version`` (2 or 3), checked as arrays against the tensor
    list and the limits."""
    n_items = preamble.n_items
    n_tensors = preamble.n_tensors
    tensors = table.tensors
    v3 = version == V3
    records = np.frombuffer(body.read(preamble.record_bytes), dtype=record_dtype(version))
    tid = records["tensor"].astype(np.int64)
    reject_item = _item_reject(attempt, tensors, tid)
    if n_items and int(tid.max()) >= n_tensors:
        raise reject(attempt, "item names a tensor outside the list", "schema")
    per_tensor = np.bincount(tid, minlength=n_tensors)
    if n_tensors and int(per_tensor.min()) == 0:
        raise reject(attempt, "a listed tensor has no item", "schema")
    if n_tensors and int(per_tensor.max()) > limits.max_items_per_tensor:
        raise reject_item(
            f"more than {limits.max_items_per_tensor} items for one tensor",
            "oversized",
            int(np.flatnonzero(per_tensor[tid] > limits.max_items_per_tensor)[0]),
        )
    enc = records["encoding"]
    kind = records["kind"]
    lk = records["location_k"].astype(np.int64)
    vk = records["value_k"].astype(np.int64)

    def first(mask: npt.NDArray[np.bool_]) -> int | None:
        hits = np.flatnonzero(mask)
        return int(hits[0]) if hits.shape[0] else None

    def require(mask: npt.NDArray[np.bool_], message: str, check: str) -> None:
        bad = first(~mask)
        if bad is not None:
            raise reject_item(f"item {bad}: {message}", check, bad)

    require(np.isin(enc, list(_V2_ENCODINGS)), "unknown encoding", "encoding")
    kinds = V3_KINDS if v3 else V2_KINDS
    require(np.isin(kind, list(kinds)), "unknown location kind", "encoding")
    ulp = enc == int(Encoding.ULP)
    require(~ulp | table.float_ok[tid], "ULP entries for a tensor that is not a float", "encoding")
    relative = enc != int(Encoding.OVERWRITE)
    require(
        ~relative | table.relative_ok[tid],
        "relative entry for a tensor whose loader path does not allow XOR or ULP",
        "classification",
    )
    count_u = records["count"]
    numels = table.numels
    numel = numels[tid]
    require(count_u <= numel.astype(U64), "more entries than elements", "bounds")
    count = count_u.astype(np.int64)
    sums = np.bincount(tid, weights=count.astype(np.float64), minlength=n_tensors)
    if n_tensors and float(sums.max()) > TOP:
        raise reject(attempt, "entries in one payload exceed the tensor's elements", "bounds")
    exact = np.zeros(n_tensors, dtype=np.int64)
    np.add.at(exact, tid, count)
    over = np.flatnonzero(exact > numels)
    if over.shape[0]:
        raise reject(
            attempt,
            "entries in one payload exceed the tensor's elements",
            "bounds",
            tensors[int(over[0])][0],
        )
    rice = kind == int(LocationKind.RICE)
    rows = kind == int(LocationKind.ROWS)
    start_u = records["start"]
    item_width = table.widths[tid]
    require(rice | (lk == 0), "a run has a Rice parameter", "schema")
    require(~rice | (count >= 2), "Rice locations of fewer than two entries", "schema")
    require(lk <= 63, "Rice parameter above 63", "schema")
    require((ulp & (count > 0)) | (vk == 0), "a value parameter without ULP values", "schema")
    require(vk < 8 * item_width, "value parameter exceeds the word", "schema")
    # A run lies in the tensor; an empty run starts at 0; Rice locations start inside it.
    run_end_ok = start_u <= (numel - count).astype(U64)
    require(rice | rows | run_end_ok, "run exceeds the tensor", "bounds")
    require((count > 0) | (start_u == 0), "an empty run must start at 0", "bounds")
    require(~rice | (start_u < numel.astype(U64)), "first index outside the tensor", "bounds")
    last_u = None
    period = gap = np.zeros(n_items, dtype=np.int64)
    if v3:
        last_u = records["last"]
        period, gap = _check_v3(records, rows, count, numel, require)
    return Records(
        tid=tid,
        enc=enc,
        count=count,
        start_u=start_u,
        last_u=last_u,
        period=period,
        gap=gap,
        lk=lk,
        vk=vk,
        numel=numel,
        item_width=item_width,
        ulp=ulp,
        rice=rice,
        rows=rows,
        reject=reject_item,
    )


class _Require(Protocol):
    def __call__(self, mask: npt.NDArray[np.bool_], message: str, check: str) -> None: ...


def _check_v3(
    records: npt.NDArray[np.void],
    rows: Bools,
    count: Int64s,
    numel: Int64s,
    require: _Require,
) -> tuple[Int64s, Int64s]:
    """Version 3's record fields: every item's last index (a Rice item's is checked once its
    gaps are joined), and the period and gap of ROWS items; their periods and gaps as int64.

    Every sum below is exact in u64: the starts, counts, periods and gaps are first bounded by
    the tensor's elements (below ``2**63``)."""
    start_u, last_u = records["start"], records["last"]
    period_u, gap_u = records["period"], records["gap"]
    numel_u = numel.astype(U64)
    nonempty = count > 0
    require(rows | (period_u == 0), "a period without ROWS locations", "schema")
    require(rows | (gap_u == 0), "a gap without ROWS locations", "schema")
    require(nonempty | (last_u == 0), "an empty item's last index is not 0", "schema")
    # A run's last index is start + count - 1 (start + count <= numel was checked).
    run = (records["kind"] == int(LocationKind.RUN)) & nonempty
    run_last = start_u + np.maximum(count - 1, 0).astype(U64)
    require(~run | (last_u == run_last), "the last index disagrees with the run", "schema")
    require(~rows | nonempty, "ROWS locations without entries", "schema")
    require(~rows | (period_u >= 1), "ROWS locations with period 0", "schema")
    require(~rows | (gap_u >= 1), "ROWS locations with gap 0", "schema")
    require(~rows | (start_u < numel_u), "first index outside the tensor", "bounds")
    require(~rows | (period_u <= numel_u), "ROWS period exceeds the tensor", "bounds")
    require(~rows | (gap_u < numel_u), "ROWS gap exceeds the tensor", "bounds")
    # last == start + (count - 1) + ((count - 1) // period) * gap, exactly: the difference
    # last - start - (count - 1) is a whole number of gaps, one per row boundary passed.
    n_less = np.maximum(count - 1, 0).astype(U64)
    first_row_end = start_u + n_less  # < 2**64: start < numel, count <= numel
    reach = np.where(rows & (last_u >= first_row_end), last_u - first_row_end, U64(0))
    one = np.maximum(gap_u, U64(1))
    boundaries = n_less // np.maximum(period_u, U64(1))
    exact = (last_u >= first_row_end) & (reach % one == 0) & (reach // one == boundaries)
    require(~rows | exact, "the last index disagrees with the rows", "schema")
    require(~rows | (last_u < numel_u), "rows reach past the tensor", "bounds")
    return period_u.astype(np.int64), gap_u.astype(np.int64)


def plan_buffers(
    body: Body, preamble: Preamble, records: Records, layout: ValueLayout, attempt: int
) -> Buffers:
    """The sizes the records imply, checked before reading any buffer."""
    count, ulp = records.count, records.ulp
    gaps_n = np.where(records.rice, count - 1, 0)
    n_gaps = int(gaps_n.sum())
    item_width = records.item_width
    word_items = ~ulp
    val_words = {w: int(count[word_items & (item_width == w)].sum()) for w in WORD_WIDTHS}
    ulp_n = np.where(ulp, count, 0)
    n_ulp = int(ulp_n.sum())
    loc_ks = per_k(records.lk, gaps_n)
    val_ks = per_k(records.vk, ulp_n)
    n_loc_esc, n_val_esc = preamble.n_loc_esc, preamble.n_val_esc
    if n_loc_esc > n_gaps or n_val_esc > n_ulp:
        raise reject(attempt, "more escapes than symbols", "bounds")
    esc_loc = {**dict.fromkeys(WORD_WIDTHS, 0), 8: n_loc_esc}
    esc_val = {**dict.fromkeys(WORD_WIDTHS, 0), 8: n_val_esc}
    sizes = [
        n_gaps,
        sum(remainder_bytes(m, k) for k, m in loc_ks.items()),
        8 * n_loc_esc,
        sum(w * n for w, n in val_words.items()),
        (n_ulp + 1) // 2,
        sum(remainder_bytes(m, k) for k, m in val_ks.items()),
        8 * n_val_esc,
    ]
    if sum(sizes) != body.remaining:
        raise reject(
            attempt,
            f"items need {sum(sizes)} buffer bytes, the body has {body.remaining}",
            "bounds",
        )
    return Buffers(
        body=body,
        layout=layout,
        attempt=attempt,
        gaps_n=gaps_n,
        n_gaps=n_gaps,
        loc_ks=loc_ks,
        esc_loc=esc_loc,
        val_words=val_words,
        ulp_n=ulp_n,
        n_ulp=n_ulp,
        val_ks=val_ks,
        esc_val=esc_val,
        sizes=sizes,
    )
