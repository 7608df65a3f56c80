"""Items of one tensor never share a position (``docs/wire-format.md``, "Entries"): the check
both format versions make once every item's positions are known.

Two items of one tensor that write the same element would make the result depend on their
order, so the decoder refuses them (``check="overlap"``), whatever their encodings, as the
receiver's admission does.  The check is vectorized and costs nothing for the usual payload
(one non-empty item per tensor); for a tensor with several items it first compares the items'
spans (first to last position), and lists positions only for the items whose spans meet.  A
run is one interval and is never expanded; strided rows (version 3's ROWS items) are one
interval per row.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from dcr.wire.decode.rice import Reject

__all__ = ["check_disjoint"]

Int64s = npt.NDArray[np.int64]


def check_disjoint(
    tid: Int64s,
    count: Int64s,
    run: Int64s,
    offs: Int64s,
    indices: Int64s,
    reject: Reject,
    *,
    period: Int64s | None = None,
    gap: Int64s | None = None,
) -> None:
    """Refuse two items of one tensor that share a position.

    Per item: ``tid`` its tensor, ``count`` its entries, ``run`` its first index when it is a
    run or strided rows (``-1`` when its positions are listed), ``offs`` where its listed
    positions start in ``indices``, ``period`` and ``gap`` its rows' (``gap`` 0, or not given:
    one run).  Every item's positions are strictly increasing and inside its tensor (checked
    before).  Raises ``reject(message, "overlap", item)`` naming the later of two such items in
    position order.
    """
    if period is None or gap is None:
        period = gap = np.zeros(count.shape[0], dtype=np.int64)
    nonempty = count > 0
    if int(np.count_nonzero(nonempty)) < 2:
        return
    per_tensor = np.bincount(tid[nonempty], minlength=int(tid.max()) + 1)
    shared = np.flatnonzero(nonempty & (per_tensor[tid] > 1))
    if not shared.shape[0]:
        return
    # Each item's span [first, last]: positions of items whose spans do not meet are disjoint.
    first, last = _spans(shared, count, run, offs, indices, period, gap)
    meets = _meeting(tid[shared], first, last + 1)
    if not meets.any():
        return
    suspects = shared[meets]
    lo, hi, item = _intervals(suspects, count, run, offs, indices, period, gap)
    bad = _first_overlap(tid[item], lo, hi)
    if bad is not None:
        raise reject(
            f"item {int(item[bad])} shares a position with another item of its tensor",
            "overlap",
            int(item[bad]),
        )


def _spans(
    items: Int64s,
    count: Int64s,
    run: Int64s,
    offs: Int64s,
    indices: Int64s,
    period: Int64s,
    gap: Int64s,
) -> tuple[Int64s, Int64s]:
    """First and last position of each of ``items`` (non-empty)."""
    first = run[items].copy()
    last = first + count[items] - 1
    rows = gap[items] > 0
    if rows.any():
        which = items[rows]
        last[rows] += (count[which] - 1) // period[which] * gap[which]
    listed = first < 0
    if listed.any():
        which = items[listed]
        first[listed] = indices[offs[which]]
        last[listed] = indices[offs[which] + count[which] - 1]
    return first, last


def _meeting(tid: Int64s, lo: Int64s, hi: Int64s) -> npt.NDArray[np.bool_]:
    """Which half-open intervals ``[lo, hi)`` belong to a tensor where two intervals meet."""
    order = np.lexsort((lo, tid))
    t, a, b = tid[order], lo[order], hi[order]
    # Sorted by (tensor, start), the intervals of a tensor are pairwise disjoint exactly when
    # each starts at or after the end of the one before it.
    hit = (t[1:] == t[:-1]) & (a[1:] < b[:-1])
    return np.isin(tid, t[1:][hit])


def _intervals(
    items: Int64s,
    count: Int64s,
    run: Int64s,
    offs: Int64s,
    indices: Int64s,
    period: Int64s,
    gap: Int64s,
) -> tuple[Int64s, Int64s, Int64s]:
    """Every position of ``items`` as half-open intervals: one per run item, one per row of a
    strided item, one per listed position; with the item each comes from."""
    is_span = run[items] >= 0
    is_rows = is_span & (gap[items] > 0)
    runs = items[is_span & ~is_rows]
    listed = items[~is_span]
    sizes = count[listed]
    n = int(sizes.sum())
    within = np.arange(n, dtype=np.int64)
    starts = np.zeros(listed.shape[0], dtype=np.int64)
    if listed.shape[0]:
        np.cumsum(sizes[:-1], out=starts[1:])
    within -= np.repeat(starts, sizes)
    pos = indices[np.repeat(offs[listed], sizes) + within]
    row_lo, row_hi, row_item = _rows(items[is_rows], count, run, period, gap)
    lo = np.concatenate([run[runs], row_lo, pos])
    hi = np.concatenate([run[runs] + count[runs], row_hi, pos + 1])
    item = np.concatenate([runs, row_item, np.repeat(listed, sizes)])
    return lo, hi, item


def _rows(
    items: Int64s, count: Int64s, run: Int64s, period: Int64s, gap: Int64s
) -> tuple[Int64s, Int64s, Int64s]:
    """The rows of strided ``items`` as half-open intervals (a last row may be partial), with
    the item each comes from."""
    p, n = period[items], count[items]
    n_rows = (n + p - 1) // p
    item = np.repeat(items, n_rows)
    firsts = np.zeros(items.shape[0], dtype=np.int64)
    if items.shape[0]:
        np.cumsum(n_rows[:-1], out=firsts[1:])
    row = np.arange(int(n_rows.sum()), dtype=np.int64) - np.repeat(firsts, n_rows)
    p_rep = np.repeat(p, n_rows)
    lo = np.repeat(run[items], n_rows) + row * (p_rep + np.repeat(gap[items], n_rows))
    hi = lo + np.minimum(p_rep, np.repeat(n, n_rows) - row * p_rep)
    return lo, hi, item


def _first_overlap(tid: Int64s, lo: Int64s, hi: Int64s) -> int | None:
    """Index (into the arguments) of an interval that meets an earlier one of its tensor in
    ``(tensor, start)`` order, or ``None``."""
    order = np.lexsort((lo, tid))
    t, a, b = tid[order], lo[order], hi[order]
    hit = np.flatnonzero((t[1:] == t[:-1]) & (a[1:] < b[:-1]))
    return int(order[int(hit[0]) + 1]) if hit.shape[0] else None
