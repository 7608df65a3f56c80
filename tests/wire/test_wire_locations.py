"""Location coding: runs, gaps in the smallest type, and bounds-checked decoding."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dcr.errors import PayloadRejected
from dcr.wire.locations import (
    GAP_WIDTHS,
    LocationKind,
    decode_gaps,
    decode_run,
    encode_locations,
    gap_kind,
)


def _decode(indices: np.ndarray, numel: int) -> np.ndarray:
    loc = encode_locations(indices)
    if loc.kind is LocationKind.RUN:
        return decode_run(loc.start, indices.shape[0], numel)
    return decode_gaps(loc.gaps, numel)


def test_paper_example_gaps_2_2_2_are_positions_2_5_8() -> None:
    loc = encode_locations(np.array([2, 5, 8], dtype=np.int64))
    assert loc.kind is LocationKind.GAPS_U8
    assert loc.gaps.tolist() == [2, 2, 2]
    assert decode_gaps(np.array([2, 2, 2], dtype=np.uint8), 9).tolist() == [2, 5, 8]


@pytest.mark.parametrize(
    ("indices", "start"),
    [([], 0), ([7], 7), ([3, 4, 5, 6], 3), ([0, 1], 0)],
)
def test_contiguous_sets_are_runs(indices: list[int], start: int) -> None:
    loc = encode_locations(np.array(indices, dtype=np.int64))
    assert loc.kind is LocationKind.RUN
    assert loc.start == start
    assert loc.gaps.size == 0


@pytest.mark.parametrize(
    ("max_gap", "kind"),
    [
        (0, LocationKind.GAPS_U8),
        (255, LocationKind.GAPS_U8),
        (256, LocationKind.GAPS_U16),
        (65535, LocationKind.GAPS_U16),
        (65536, LocationKind.GAPS_U32),
        (2**32 - 1, LocationKind.GAPS_U32),
        (2**32, LocationKind.GAPS_U64),
        (2**64 - 1, LocationKind.GAPS_U64),
    ],
)
def test_gap_kind_is_smallest_type(max_gap: int, kind: LocationKind) -> None:
    assert gap_kind(max_gap) is kind


def test_gap_width_follows_largest_gap() -> None:
    # First gap 300 (from -1 to 300) needs u16 although the others fit a byte.
    loc = encode_locations(np.array([300, 302, 304], dtype=np.int64))
    assert loc.kind is LocationKind.GAPS_U16
    assert loc.gaps.dtype.itemsize == 2
    assert loc.gaps.tolist() == [300, 1, 1]


def test_huge_gaps_use_u64() -> None:
    numel = 2**62 + 10
    indices = np.array([1, 2**40, 2**62 + 5], dtype=np.int64)
    loc = encode_locations(indices)
    assert loc.kind is LocationKind.GAPS_U64
    assert GAP_WIDTHS[loc.kind] == 8
    assert decode_gaps(loc.gaps, numel).tolist() == indices.tolist()


@st.composite
def index_sets(draw: st.DrawFn) -> tuple[np.ndarray, int]:
    numel = draw(st.one_of(st.integers(1, 300), st.integers(1, 2**62)))
    kind = draw(st.sampled_from(["scattered", "run", "dense"]))
    if kind == "run" or numel > 100_000:
        size = draw(st.integers(0, min(numel, 50)))
        if kind == "run":
            start = draw(st.integers(0, numel - size))
            return np.arange(start, start + size, dtype=np.int64), numel
        picks = draw(st.sets(st.integers(0, numel - 1), max_size=size))
        return np.array(sorted(picks), dtype=np.int64), numel
    seed = draw(st.integers(0, 2**32 - 1))
    density = 0.95 if kind == "dense" else draw(st.floats(0.0, 1.0))
    rng = np.random.default_rng(seed)
    return np.flatnonzero(rng.random(numel) < density).astype(np.int64), numel


@given(index_sets())
def test_round_trip(case: tuple[np.ndarray, int]) -> None:
    indices, numel = case
    out = _decode(indices, numel)
    assert out.dtype == np.int64
    assert out.tolist() == indices.tolist()


def test_decode_rejects_gap_past_the_tensor() -> None:
    with pytest.raises(PayloadRejected) as err:
        decode_gaps(np.array([1, 9], dtype=np.uint8), 10, tensor="t", attempt=4)
    assert (err.value.check, err.value.tensor, err.value.attempt) == ("bounds", "t", 4)


def test_decode_rejects_last_position_past_the_tensor() -> None:
    # Every gap is small, but the positions 3, 7, 11 run past 10 elements.
    with pytest.raises(PayloadRejected, match="out of range"):
        decode_gaps(np.array([3, 3, 3], dtype=np.uint8), 10)


def test_decode_rejects_more_positions_than_elements() -> None:
    with pytest.raises(PayloadRejected):
        decode_gaps(np.zeros(11, dtype=np.uint8), 10)


def test_decode_rejects_int64_wraparound() -> None:
    # Four steps of 2**62 + 1 sum to 2**64 + 4: int64 arithmetic wraps to position 3, which is
    # in range, so only the monotonicity check can catch it.
    gaps = np.full(4, 2**62, dtype=np.uint64)
    with pytest.raises(PayloadRejected, match="overflow"):
        decode_gaps(gaps, 2**63 - 1)


def test_decode_accepts_large_sums_without_wraparound() -> None:
    gaps = np.array([2**61, 2**61], dtype=np.uint64)
    assert decode_gaps(gaps, 2**63 - 1).tolist() == [2**61, 2**62 + 1]


@pytest.mark.parametrize(("start", "count", "numel"), [(5, 6, 10), (10, 1, 10), (3, 0, 10)])
def test_decode_run_rejects_bad_runs(start: int, count: int, numel: int) -> None:
    with pytest.raises(PayloadRejected) as err:
        decode_run(start, count, numel)
    assert err.value.check == "bounds"


def test_decode_run_accepts_a_run_up_to_the_end() -> None:
    assert decode_run(7, 3, 10).tolist() == [7, 8, 9]
    assert decode_run(0, 0, 0).tolist() == []
