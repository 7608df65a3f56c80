"""Index math of the sparse path and of the overlap rules, against brute force."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dcr.apply.geometry import (
    IndexMap,
    ViewGeometry,
    byte_intervals,
    enumerate_map,
    overlapping_groups,
)


@st.composite
def _views(draw: st.DrawFn) -> tuple[tuple[int, ...], torch.Tensor]:
    """A canonical shape and a view of it built from slices, steps, permutations, selects."""
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=4)))
    base = torch.arange(int(np.prod(shape)), dtype=torch.int64).reshape(shape)
    view = base
    for dim in range(view.dim()):
        size = view.shape[dim]
        start = draw(st.integers(0, size - 1))
        stop = draw(st.integers(start + 1, size))
        step = draw(st.integers(1, 3))
        view = view.narrow(dim, start, stop - start)[
            (slice(None),) * dim + (slice(None, None, step),)
        ]
    order = draw(st.permutations(range(view.dim())))
    view = view.permute(*order)
    if view.dim() > 1 and draw(st.booleans()):
        view = view.select(0, draw(st.integers(0, view.shape[0] - 1)))
    return shape, view


@settings(max_examples=300, deadline=None)
@given(_views(), st.data())
def test_index_map_matches_brute_force(
    case: tuple[tuple[int, ...], torch.Tensor], data: st.DataObject
) -> None:
    shape, view = case
    numel = int(np.prod(shape))
    src = ViewGeometry.of(view, "scratch")
    dst_t = torch.empty(view.shape, dtype=torch.int64)
    if dst_t.dim() > 1 and data.draw(st.booleans()):
        dims = list(range(dst_t.dim()))[::-1]
        dst_t = torch.empty(tuple(reversed(view.shape)), dtype=torch.int64).permute(*dims)
    dst = ViewGeometry(
        storage="d", offset=5, shape=tuple(dst_t.shape), stride=dst_t.stride(), dtype=torch.int64
    )
    picked = data.draw(st.lists(st.integers(0, numel - 1), unique=True))
    indices = np.array(sorted(picked), dtype=np.int64)
    # Brute force: every view element names its canonical index (the base held arange).
    canon = view.reshape(-1).numpy()
    dst_pos = dst.positions()
    want = sorted(
        (int(np.searchsorted(indices, c)), int(p))
        for c, p in zip(canon, dst_pos, strict=True)
        if c in set(indices.tolist())
    )
    imap = IndexMap.build(src, dst)
    assert imap is not None  # views of a C-contiguous tensor are nested
    sel, pos = imap.map(indices)
    assert sorted(zip(sel.tolist(), pos.tolist(), strict=True)) == want
    sel2, pos2 = enumerate_map(src, dst, indices)
    assert sorted(zip(sel2.tolist(), pos2.tolist(), strict=True)) == want


def test_broadcast_is_not_nested_but_enumerates() -> None:
    src = ViewGeometry(storage="s", offset=0, shape=(5,), stride=(1,), dtype=torch.float16)
    src = src.broadcast_to((3, 5))
    dst = ViewGeometry(storage="d", offset=0, shape=(3, 5), stride=(5, 1), dtype=torch.float16)
    assert IndexMap.build(src, dst) is None
    sel, pos = enumerate_map(src, dst, np.array([1, 4], dtype=np.int64))
    assert sorted(zip(sel.tolist(), pos.tolist(), strict=True)) == [
        (0, 1),
        (0, 6),
        (0, 11),
        (1, 4),
        (1, 9),
        (1, 14),
    ]


@settings(max_examples=200, deadline=None)
@given(_views())
def test_byte_intervals_cover_exactly_the_view(case: tuple[tuple[int, ...], torch.Tensor]) -> None:
    _, view = case
    g = ViewGeometry.of(view, "x")
    starts, ends = byte_intervals(g)
    covered = np.concatenate([np.arange(s, e) for s, e in zip(starts, ends, strict=True)])
    elements = g.positions() * g.itemsize
    want = np.sort((elements[:, None] + np.arange(g.itemsize)).reshape(-1))
    assert np.array_equal(np.sort(covered), want)


def test_overlapping_groups() -> None:
    starts = np.array([0, 10, 4, 20, 25, 40], dtype=np.int64)
    ends = np.array([5, 12, 8, 30, 26, 40], dtype=np.int64)  # the last one is empty
    labels = np.array([1, 2, 3, 4, 5, 6], dtype=np.int64)
    groups = sorted(sorted(g.tolist()) for g in overlapping_groups(starts, ends, labels))
    assert groups == [[1, 3], [4, 5]]
