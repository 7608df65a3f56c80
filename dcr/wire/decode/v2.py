"""The body of a format version 2 or 3 payload (paper App. D), decoded in named steps: the
preamble, the tensor list and the item records (:mod:`dcr.wire.decode.records`), the buffer
sizes they imply, the positions (:mod:`dcr.wire.decode.positions`), which no two items of one
tensor may share (:mod:`dcr.wire.decode.overlap`), then the values.  Version 3 bodies differ
only in their records: each states its item's last index (checked against the decoded
positions), and ROWS items (strided rows) decode to a :class:`~dcr.tensors.records.Span`
without listing their indices.

Values are XOR and overwrite words in width classes, and ULP deltas zigzagged into nibble
symbols Rice-split with their remainders; a receiver gets one value array per width, in item
order.  Every item record is checked with array operations, never a Python object per item.
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from dcr import native
from dcr.tensors.records import TensorSpec
from dcr.wire.decode.body import Body, class_words, read_words, reject
from dcr.wire.decode.header import Framing
from dcr.wire.decode.overlap import check_disjoint
from dcr.wire.decode.positions import read_locations
from dcr.wire.decode.records import (
    Buffers,
    Records,
    plan_buffers,
    read_preamble,
    read_records,
    read_tensor_list,
)
from dcr.wire.decode.rice import U64, check_escapes, join, join_failure, remainders, streams
from dcr.wire.format import WORD_WIDTHS, DecodeLimits, Items
from dcr.wire.split import VALUE_CAP, unpack_nibbles, unzigzag

__all__ = ["decode_v2"]

Words = npt.NDArray[np.unsignedinteger[Any]]
Int64s = npt.NDArray[np.int64]


def decode_v2(
    body: Body,
    framing: Framing,
    attempt: int,
    limits: DecodeLimits,
    catalog: Mapping[str, TensorSpec] | None,
    xor_allowed: Container[str] | None,
) -> Items:
    """The checked items of a version 2 or 3 body (the rest of ``body``, ``framing.version``
    says which); raises :class:`~dcr.errors.PayloadRejected`."""
    version = framing.version
    preamble = read_preamble(body, framing.n_items, attempt, limits, version)
    table = read_tensor_list(
        body, preamble, attempt=attempt, limits=limits, catalog=catalog, xor_allowed=xor_allowed
    )
    records = read_records(body, preamble, table, attempt=attempt, limits=limits, version=version)
    buffers = plan_buffers(body, preamble, records, framing.layout, attempt)
    kernels = native.kernels
    indices, offs, run = read_locations(buffers, records, kernels)
    _check_rice_last(records, indices, offs)
    check_disjoint(
        records.tid,
        records.count,
        run,
        offs,
        indices,
        records.reject,
        period=records.period,
        gap=records.gap,
    )
    values, value_start = _read_values(buffers, records, kernels)
    count, tid, item_width = records.count, records.tid, records.item_width
    bools = table.is_bool[tid] & (count > 0)
    if (
        bools.any()
        and int(values[1][np.repeat(bools[item_width == 1], count[item_width == 1])].max()) > 1
    ):
        raise reject(attempt, "bool value other than 0 or 1", "bounds")
    return Items(
        verified=True,
        tensors=table.tensors,
        tensor=tid,
        encoding=records.enc,
        start=offs,
        count=count,
        value_start=value_start,
        indices=indices,
        values=values,
        run=run,
        period=records.period if records.rows.any() else None,
        gap=records.gap if records.rows.any() else None,
    )


def _check_rice_last(records: Records, indices: npt.NDArray[np.int64], offs: Int64s) -> None:
    """Version 3: the last index each Rice item's record states is its last decoded
    position."""
    last_u = records.last_u
    if last_u is None or not records.rice.any():
        return
    rice = np.flatnonzero(records.rice)
    decoded = indices[offs[rice] + records.count[rice] - 1].view(U64)
    bad = np.flatnonzero(decoded != last_u[rice])
    if bad.shape[0]:
        item = int(rice[int(bad[0])])
        raise records.reject(
            f"item {item}: the last index disagrees with the decoded positions", "schema", item
        )


def _read_values(
    buffers: Buffers, records: Records, kernels: Any
) -> tuple[dict[int, Words], npt.NDArray[np.int64]]:
    """Every item's values: one array per width, in item order, and each item's offset into
    the array of its width."""
    body = buffers.body
    words = read_words(body, buffers.val_words, buffers.layout)
    packed = body.read(buffers.sizes[4])
    if buffers.n_ulp % 2 and int(packed[-1]) >> 4:
        raise reject(
            buffers.attempt, "the padding nibble of the value symbols is not zero", "schema"
        )
    if kernels is not None:
        zz, unzigzagged = _ulp_native(kernels, buffers, records, packed)
    else:
        zz, unzigzagged = _ulp_numpy(buffers, records, packed), None
    return _value_classes(records, words, zz, unzigzagged)


def _value_max(item_width: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """Largest zigzagged ULP value of each item's word (``-1``: any u64)."""
    return np.where(item_width == 8, -1, (1 << (8 * np.minimum(item_width, 4))) - 1)


def _ulp_native(
    kernels: Any, buffers: Buffers, records: Records, packed: npt.NDArray[np.uint8]
) -> tuple[Words, Words | None]:
    """The ULP items' zigzagged values joined in C, and the same unzigzagged when every ULP
    item has one width (else ``None``)."""
    body, reject_item = buffers.body, records.reject
    ulp, count, item_width = records.ulp, records.count, records.item_width
    value_max = _value_max(item_width)
    val_streams = streams(body, buffers.val_ks, buffers.attempt)
    val_escs = class_words(body.read(buffers.sizes[6]), buffers.esc_val, buffers.layout)[8]
    caps = int(np.count_nonzero((packed & 15) == VALUE_CAP))
    caps += int(np.count_nonzero((packed >> 4) == VALUE_CAP))
    check_escapes(caps, val_escs, VALUE_CAP, reject_item)
    # One width for every ULP item (the usual case): the kernel writes the values
    # unzigzagged at that width, no u64 words in between.
    widths = np.unique(item_width[ulp])
    narrow = widths.shape[0] == 1
    zz = np.empty(buffers.n_ulp, dtype=np.dtype(f"u{int(widths[0])}") if narrow else U64)
    unzigzagged = zz if narrow else None
    status, _ = kernels.join_values(
        packed, val_streams, np.ascontiguousarray(val_escs, dtype=U64), count[ulp],
        records.vk[ulp], np.ascontiguousarray(value_max[ulp]).view(U64), zz, narrow,
    )  # fmt: skip
    if status:
        raise join_failure(status, None, reject_item)
    return zz, unzigzagged


def _ulp_numpy(buffers: Buffers, records: Records, packed: npt.NDArray[np.uint8]) -> Words:
    """The ULP items' zigzagged values, joined vectorized."""
    body = buffers.body
    val_sym = unpack_nibbles(packed, buffers.n_ulp)
    assert val_sym is not None
    val_rems = remainders(body, buffers.val_ks, buffers.attempt)
    val_escs = class_words(body.read(buffers.sizes[6]), buffers.esc_val, buffers.layout)[8]
    value_max = _value_max(records.item_width)
    return join(
        val_sym,
        VALUE_CAP,
        val_escs,
        val_rems,
        buffers.ulp_n,
        records.vk,
        value_max,
        records.reject,
    )


def _value_classes(
    records: Records, words: dict[int, Words], zz: Words, unzigzagged: Words | None
) -> tuple[dict[int, Words], npt.NDArray[np.int64]]:
    """The XOR and overwrite ``words`` and the zigzagged ULP values ``zz`` merged into one
    array per width in item order (``unzigzagged``: ``zz`` already unzigzagged at the one width
    of every ULP item), and each item's offset into the array of its width."""
    count, ulp, item_width = records.count, records.ulp, records.item_width
    word_items = ~ulp
    value_start = np.zeros(count.shape[0], dtype=np.int64)
    values: dict[int, Words] = {}
    for w in WORD_WIDTHS:
        of_width = item_width == w
        total = int(count[of_width].sum())
        if not total:
            continue
        sizes_w = count[of_width]
        starts_w = np.zeros(sizes_w.shape[0], dtype=np.int64)
        np.cumsum(sizes_w[:-1], out=starts_w[1:])
        value_start[of_width] = starts_w
        ulp_w = ulp & of_width
        if not ulp_w.any():
            out = words[w]
        else:
            if unzigzagged is not None:
                decoded = unzigzagged
            else:
                ulp_vals = (
                    zz
                    if bool(ulp_w.sum() == ulp.sum())
                    else zz[np.repeat(item_width[ulp], count[ulp]) == w]
                )
                decoded = unzigzag(ulp_vals.astype(np.dtype(f"u{w}")))
            if not (word_items & of_width).any():
                out = decoded
            else:
                out = np.empty(total, dtype=np.dtype(f"u{w}"))
                mask = np.repeat(ulp[of_width], sizes_w)
                out[mask] = decoded
                out[~mask] = words[w]
        values[w] = out
    return values, value_start
