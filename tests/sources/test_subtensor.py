"""SubTensor: a DTensor-style box of a canonical tensor, projected three equivalent ways."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dcr.delta.mapping import SubTensor
from dcr.errors import LayoutError


def _coded(shape: tuple[int, ...]) -> torch.Tensor:
    """Canonical tensor whose element ``k`` holds ``k`` (int64): projections read as indices."""
    return torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape)


def _check(m: SubTensor) -> None:
    canon = _coded(m.canonical_shape)
    # Dense reference: the box, read through blocks().
    shard = torch.empty(m.shape, dtype=torch.int64)
    for _, c, s in m.blocks({m.name: canon}, shard):
        s.copy_(c)
    expected = shard.reshape(-1).numpy()
    local = np.arange(m.numel, dtype=np.int64)
    # project(): every element, and a shuffled subset in any order.
    (dest,) = m.project(local) if m.numel else [None]
    if m.numel:
        assert dest is not None and dest.name == m.name and dest.select is None
        np.testing.assert_array_equal(dest.indices, expected)
        rng = np.random.default_rng(m.numel)
        sub = rng.permutation(m.numel)[: max(1, m.numel // 3)]
        np.testing.assert_array_equal(m.project(sub)[0].indices, expected[sub])
    # segments(): cover every element once, in increasing local order, with the same indices.
    seen = np.zeros(m.numel, dtype=np.int64)
    at = 0
    for seg in m.segments():
        assert seg.start == at and seg.stop > seg.start and seg.names == (m.name,)
        idx = np.arange(seg.start, seg.stop, dtype=np.int64)
        np.testing.assert_array_equal(seg.canonical(idx), expected[seg.start : seg.stop])
        seen[seg.start : seg.stop] += 1
        at = seg.stop
    assert at == m.numel and bool((seen == 1).all())


@st.composite
def boxes(draw: st.DrawFn) -> SubTensor:
    dims = draw(st.integers(1, 4))
    canonical = tuple(draw(st.integers(1, 6)) for _ in range(dims))
    offset, shape = [], []
    for c in canonical:
        if draw(st.booleans()):
            offset.append(0)
            shape.append(c)
        else:
            o = draw(st.integers(0, c))
            offset.append(o)
            shape.append(draw(st.integers(0, c - o)))
    return SubTensor("w", canonical, tuple(offset), tuple(shape))


@settings(max_examples=300, deadline=None)
@given(boxes())
def test_project_segments_and_blocks_agree(m: SubTensor) -> None:
    _check(m)


@pytest.mark.parametrize(
    ("canonical", "offset", "shape", "segments"),
    [
        ((10, 4), (0, 0), (10, 4), 1),  # whole tensor (Replicate)
        ((10, 4), (4, 0), (4, 4), 1),  # Shard(0), even
        ((10, 4), (8, 0), (2, 4), 1),  # Shard(0), the short last chunk
        ((6, 8), (0, 4), (6, 4), 1),  # Shard(1)
        ((6, 8), (3, 4), (3, 4), 1),  # Shard(0) x Shard(1) on a 2-D mesh
        ((4, 6, 8), (0, 0, 2), (4, 6, 2), 1),  # Shard(2)
        ((4, 6, 8), (2, 3, 4), (2, 3, 4), 2),  # three sharded dims: one segment per outer row
    ],
)
def test_dtensor_like_boxes(
    canonical: tuple[int, ...], offset: tuple[int, ...], shape: tuple[int, ...], segments: int
) -> None:
    m = SubTensor("w", canonical, offset, shape)
    _check(m)
    assert len(m.segments()) == segments


def test_a_box_outside_the_tensor_is_refused() -> None:
    with pytest.raises(LayoutError, match="outside"):
        SubTensor("w", (4, 4), (3, 0), (2, 4))
    with pytest.raises(LayoutError, match="one entry per dimension"):
        SubTensor("w", (4, 4), (0,), (4, 4))
