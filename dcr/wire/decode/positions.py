"""The positions of a version 2 or 3 body's items (paper App. D, Fig. D.3): a run (or, in
version 3, strided rows) stays its start, a Rice item's positions are its first index and its
gaps, joined back from the location streams and summed.

Two paths give the same positions: one C pass of the kernels' join when they are built
(:func:`locations_native`), vectorized NumPy otherwise (:func:`locations_numpy`).  The
location coding itself is :mod:`dcr.wire.locations`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from dcr.errors import PayloadRejected
from dcr.wire.decode.body import class_words
from dcr.wire.decode.records import TOP, Buffers, Records
from dcr.wire.decode.rice import (
    U64,
    Reject,
    check_escapes,
    join,
    join_failure,
    remainders,
    streams,
)
from dcr.wire.split import GAP_CAP

__all__ = ["RiceItems", "locations_native", "locations_numpy", "read_locations"]

Int64s = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class RiceItems:
    """The items whose locations are Rice-coded, as per-item arrays of those items only (in
    item order)."""

    count: Int64s
    lk: Int64s
    """Rice parameter of the gaps."""
    start_u: npt.NDArray[np.uint64]
    """First position."""
    numel: Int64s
    """Elements of the item's tensor."""
    gaps_n: Int64s
    """Gaps of the item (``count - 1``)."""
    n: int
    """Positions of these items in all."""
    reject: Reject
    """The rejection of a check that names one of these items by its place among them."""


def read_locations(
    buffers: Buffers, records: Records, kernels: Any
) -> tuple[Int64s, Int64s, Int64s]:
    """Every item's locations: only Rice items list their indices; a run or ROWS item stays
    its start (its rows' period and gap are in ``records``).

    Returns the listed positions, each item's offset into them and each item's run or rows
    start (``-1`` for a Rice item)."""
    rice, count, start_u = records.rice, records.count, records.start_u
    n_items = count.shape[0]
    listed = np.flatnonzero(rice)
    listed_count = np.where(rice, count, 0)
    n = int(listed_count.sum())
    offs = np.zeros(n_items, dtype=np.int64)
    np.cumsum(listed_count[:-1], out=offs[1:])
    run = np.where(rice, -1, start_u.astype(np.int64))

    def reject_listed(message: str, check: str, item: int | None = None) -> PayloadRejected:
        return records.reject(message, check, None if item is None else int(listed[item]))

    loc_sym = buffers.body.read(buffers.sizes[0])
    items = RiceItems(
        count=count[listed],
        lk=records.lk[listed],
        start_u=start_u[listed],
        numel=records.numel[listed],
        gaps_n=buffers.gaps_n[listed],
        n=n,
        reject=reject_listed,
    )
    if kernels is not None:
        indices = locations_native(kernels, buffers, loc_sym, items)
    else:
        indices = locations_numpy(buffers, loc_sym, items)
    return indices, offs, run


def locations_native(
    kernels: Any, buffers: Buffers, symbols: npt.NDArray[np.uint8], items: RiceItems
) -> Int64s:
    """The positions of every Rice item in one C pass (:func:`locations_numpy` without
    temporaries)."""
    body, reject = buffers.body, items.reject
    rems = streams(body, buffers.loc_ks, buffers.attempt)
    escapes = class_words(body.read(buffers.sizes[2]), buffers.esc_loc, buffers.layout)[8]
    check_escapes(int(np.count_nonzero(symbols == GAP_CAP)), escapes, GAP_CAP, reject)
    count = items.count
    indices = np.empty(items.n, dtype=np.int64)
    status, bad = kernels.join_locations(
        symbols, rems, np.ascontiguousarray(escapes, dtype=U64), count,
        np.ones(count.shape[0], dtype=np.int64), items.lk,
        np.ascontiguousarray(items.start_u, dtype=U64),
        np.ascontiguousarray(items.numel, dtype=np.int64), indices,
    )  # fmt: skip
    if status:
        raise join_failure(status, int(bad), reject)
    return indices


def locations_numpy(buffers: Buffers, loc_sym: npt.NDArray[np.uint8], items: RiceItems) -> Int64s:
    """The positions of every Rice item: the gaps joined, then cumulative sums,
    vectorized."""
    body, reject = buffers.body, items.reject
    count, start_u, numel, n = items.count, items.start_u, items.numel, items.n
    n_gaps = buffers.n_gaps
    loc_rems = remainders(body, buffers.loc_ks, buffers.attempt)
    loc_escs = class_words(body.read(buffers.sizes[2]), buffers.esc_loc, buffers.layout)[8]
    gaps = join(loc_sym, GAP_CAP, loc_escs, loc_rems, items.gaps_n, items.lk, numel - 1, reject)
    offs = np.zeros(count.shape[0], dtype=np.int64)
    np.cumsum(count[:-1], out=offs[1:])
    steps = np.ones(n, dtype=U64)
    if n_gaps:
        in_gaps = np.ones(n, dtype=bool)
        in_gaps[offs] = False
        gaps += U64(1)
        steps[in_gaps] = gaps
        del in_gaps
    steps[offs] = start_u
    np.cumsum(steps, out=steps)
    if n:
        base = steps[offs] - start_u
        steps -= np.repeat(base, count)
    if n_gaps and float(gaps.max()) * n_gaps >= TOP:
        # Positions could wrap around 2**64 inside an item: they must still increase.
        up = np.ones(n, dtype=bool)
        up[1:] = steps[1:] > steps[:-1]
        up[offs] = True
        if not bool(up.all()):
            bad = int(np.searchsorted(offs, int(np.flatnonzero(~up)[0]), side="right")) - 1
            raise reject("positions wrap around", "bounds", bad)
    if n:
        last = steps[offs + count - 1]
        bad_last = last >= numel.astype(U64)
        if bool(bad_last.any()):
            raise reject(
                "a position is outside the tensor", "bounds", int(np.flatnonzero(bad_last)[0])
            )
    indices = steps.view(np.int64)
    return indices
