"""The per-item checks of a format version 1 body that follow its table, as array operations
over every item at once (paper App. D, Fig. D.3): runs inside their tensors, gap-coded
positions summed from their width classes, bool values.

Each check returns the first failing item (in table order) and why, or ``None``; the caller
reports the earliest.  Gaps of one width class follow item order (the table's offsets were
checked to tile the class), so one running sum over the class, less each item's base, gives
every item's positions, with no Python step per item.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["Failure", "check_bools", "check_runs", "gap_positions"]

Int64s = npt.NDArray[np.int64]
Bools = npt.NDArray[np.bool_]
Failure = tuple[int, str] | None
"""The first item failing a check and why, or ``None``."""

_WRAP = 2.0**63
"""Running sums of steps below this (estimated in floats) cannot wrap around 2**64."""


def _first(bad: Bools, items: Int64s) -> int:
    """The item of the first set element of ``bad`` (one of which is set)."""
    return int(items[int(np.flatnonzero(bad)[0])])


def check_runs(
    is_run: Bools, location: npt.NDArray[np.uint64], count: Int64s, numel: Int64s
) -> Failure:
    """Every run lies in its tensor (``count <= numel`` holds already); an empty run starts
    at 0."""
    items = np.arange(is_run.shape[0], dtype=np.int64)
    past = is_run & (location > (numel - count).astype(np.uint64))
    misplaced = is_run & (count == 0) & (location != 0)
    found = [
        (_first(bad, items), message)
        for bad, message in ((past, "run exceeds the tensor"), (misplaced, "empty run not at 0"))
        if bool(bad.any())
    ]
    return min(found) if found else None


def gap_positions(
    words: npt.NDArray[np.unsignedinteger[Any]],
    members: Int64s,
    count: Int64s,
    numel: Int64s,
    start: Int64s,
    indices: Int64s,
) -> Failure:
    """Write the positions of the items ``members`` (ascending), whose gaps are ``words`` (one
    width class, in item order), into ``indices`` from each item's ``start``.

    ``index[0] = gap[0]``, ``index[i] = index[i-1] + gap[i] + 1``.  A gap must be below its
    tensor's ``numel`` and so must the last position; the running sum is taken in uint64 over
    the whole class (wrapping, which subtracting each item's base undoes), and where an item's
    sum could pass 2**64 its positions must still increase.
    """
    sizes = count[members]
    limit = np.repeat(numel[members], sizes).astype(np.uint64)
    steps = words.astype(np.uint64)
    over = steps >= limit
    if bool(over.any()):
        return _first(over, np.repeat(members, sizes)), "gap reaches past the tensor's elements"
    steps += np.uint64(1)  # each step is in [1, numel]
    offs = np.zeros(members.shape[0], dtype=np.int64)
    np.cumsum(sizes[:-1], out=offs[1:])
    nonempty = sizes > 0
    np.cumsum(steps, out=steps)
    base = np.zeros(members.shape[0], dtype=np.uint64)
    later = nonempty & (offs > 0)
    base[later] = steps[offs[later] - 1]
    steps -= np.repeat(base, sizes)
    steps -= np.uint64(1)
    if float(limit.max(initial=0)) * float(sizes.max(initial=0)) >= _WRAP:
        up = np.ones(steps.shape[0], dtype=bool)
        up[1:] = steps[1:] > steps[:-1]
        up[offs[nonempty]] = True
        if not bool(up.all()):
            return _first(~up, np.repeat(members, sizes)), "gap sum overflows 64 bits"
    last = steps[offs[nonempty] + sizes[nonempty] - 1]
    outside = last >= numel[members[nonempty]].astype(np.uint64)
    if bool(outside.any()):
        return _first(outside, members[nonempty]), "a position is outside the tensor"
    dest = np.repeat(start[members] - offs, sizes)
    dest += np.arange(steps.shape[0], dtype=np.int64)
    indices[dest] = steps.view(np.int64)
    return None


def check_bools(
    narrow_values: npt.NDArray[np.unsignedinteger[Any]],
    is_bool: Bools,
    narrow: Bools,
    count: Int64s,
) -> Failure:
    """Every value of a bool item is 0 or 1.  ``narrow_values`` is the value class of width
    1, the values of the items ``narrow`` marks, in item order."""
    if not bool((is_bool & (count > 0)).any()):
        return None
    members = np.flatnonzero(narrow)
    bad = np.repeat(is_bool[members], count[members]) & (narrow_values > 1)
    if not bool(bad.any()):
        return None
    return _first(bad, np.repeat(members, count[members])), "bool value other than 0 or 1"
