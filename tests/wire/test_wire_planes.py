"""Byte planes: byte k of every word together, little-endian, lossless."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dcr.wire.planes import join_planes, split_planes


def test_planes_are_low_byte_first() -> None:
    words = np.array([0x0102, 0x0304, 0xA0B0], dtype=np.uint16)
    out = np.empty((2, 3), dtype=np.uint8)
    split_planes(words, out)
    assert out.tolist() == [[0x02, 0x04, 0xB0], [0x01, 0x03, 0xA0]]


def test_big_endian_input_is_planed_by_value() -> None:
    words = np.array([0x01020304], dtype=">u4")
    out = np.empty((4, 1), dtype=np.uint8)
    split_planes(words, out)
    assert out[:, 0].tolist() == [4, 3, 2, 1]


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64])
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 300))
def test_round_trip(dtype: type[np.unsignedinteger], seed: int, n: int) -> None:
    info = np.iinfo(dtype)
    words = np.random.default_rng(seed).integers(0, info.max, n, dtype=dtype, endpoint=True)
    planes = np.empty((words.dtype.itemsize, n), dtype=np.uint8)
    split_planes(words, planes)
    back = join_planes(planes, np.dtype(dtype))
    assert back.dtype == np.dtype(dtype)
    assert back.tolist() == words.tolist()
    assert back.flags.writeable
    assert not np.shares_memory(back, planes)


def test_join_reads_a_strided_column_slice() -> None:
    matrix = np.arange(2 * 6, dtype=np.uint8).reshape(2, 6)
    words = join_planes(matrix[:, 2:5], np.dtype(np.uint16))
    assert words.tolist() == [2 | 8 << 8, 3 | 9 << 8, 4 | 10 << 8]
