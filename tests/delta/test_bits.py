"""Change detection on stored bits, for every dtype dcr carries and any block size."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dcr.errors import ConfigError
from dcr.tensors.bits import (
    DTYPE_CODES,
    bits,
    bits_dtype,
    changed_indices,
    differing,
    numpy_bits_dtype,
)

DTYPES = sorted(DTYPE_CODES, key=str)


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    n=st.integers(0, 3000),
    block=st.sampled_from([1, 7, 64, 1 << 20]),
    data=st.data(),
)
def test_changed_indices_equal_a_bitwise_reference(dtype, n, block, data):
    width = torch.empty((), dtype=dtype).element_size()
    raw = np.frombuffer(
        data.draw(st.binary(min_size=n * width, max_size=n * width)), dtype=np.uint8
    ).copy()
    old = torch.from_numpy(raw).view(dtype) if n else torch.empty(0, dtype=dtype)
    new = old.clone()
    flips = data.draw(st.lists(st.integers(0, max(n - 1, 0)), max_size=n // 3 + 1)) if n else []
    nb = bits(new)
    for i in flips:
        nb[i] ^= np.array(1 << data.draw(st.integers(0, width * 8 - 1))).astype(nb.dtype)
    got = changed_indices(bits(new), bits(old), block=block)
    expect = np.flatnonzero(bits(new) != bits(old))
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, expect)


def test_float_equal_values_with_different_bits_are_changes():
    old = torch.tensor([0.0, float("nan"), 1.0, 5e-41], dtype=torch.float32)
    new = old.clone()
    b = bits(new)
    b[0] = 0x80000000  # -0.0 == +0.0 as floats
    b[1] = 0x7FC00001  # another NaN payload
    b[3] ^= 1  # a subnormal's last bit
    np.testing.assert_array_equal(changed_indices(bits(new), bits(old), block=2), [0, 1, 3])


def test_differing_counts_elements_whose_bits_differ():
    old = torch.tensor([0.0, float("nan"), 1.0, 2.0], dtype=torch.bfloat16)
    new = old.clone()
    view = new.view(torch.int16)
    assert differing(view, old.view(torch.int16)) == 0
    view[0] = -0x8000  # -0.0, equal to +0.0 as a float
    view[1] ^= 1  # another NaN payload
    assert differing(view, old.view(torch.int16)) == 2


def test_bits_are_zero_copy_views():
    t = torch.zeros(4, 3, dtype=torch.bfloat16)
    v = bits(t)
    assert v.dtype == np.uint16 and v.shape == (4, 3)
    v[1, 2] = 0x3F80
    assert t[1, 2].item() == 1.0
    assert bits_dtype(torch.bool) == torch.uint8 and numpy_bits_dtype(torch.float64) == np.uint64


def test_mismatched_arrays_raise():
    with pytest.raises(ConfigError):
        changed_indices(np.zeros(3, np.uint16), np.zeros(4, np.uint16))
    with pytest.raises(ConfigError):
        bits(torch.zeros(2, dtype=torch.complex64))
