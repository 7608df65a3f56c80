"""Order-preserving patterns and ULP deltas: bijective, order-preserving, exact round trips."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from dcr.tensors.bits import bits_dtype, numpy_bits_dtype
from dcr.tensors.ordered import ULP_DTYPES, add_ordered, ordered, ulp_delta, unordered
from dcr.tensors.records import Encoding


@pytest.mark.parametrize("width", [1, 2])
def test_ordered_is_a_bijection_of_every_pattern(width: int) -> None:
    dt = {1: np.uint8, 2: np.uint16}[width]
    every = np.arange(1 << (8 * width), dtype=dt)
    o = ordered(every)
    assert np.array_equal(np.sort(o), every)
    assert np.array_equal(unordered(o), every)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_ordered_follows_float_order(dtype: torch.dtype) -> None:
    special = [-float("inf"), -1e4, -1.0, -1e-6, -0.0, 0.0, 1e-6, 1.0, 1e4, float("inf")]
    t = torch.tensor(special, dtype=dtype)
    w = t.view(bits_dtype(dtype)).numpy().view(numpy_bits_dtype(dtype))
    o = ordered(w)
    assert all(int(a) < int(b) for a, b in itertools.pairwise(o))


@pytest.mark.parametrize("dtype", sorted(ULP_DTYPES, key=str))
def test_ulp_delta_round_trips_through_torch(dtype: torch.dtype) -> None:
    rng = np.random.default_rng(7)
    np_dt = numpy_bits_dtype(dtype)
    width = np.dtype(np_dt).itemsize
    old = rng.integers(0, 1 << (8 * width) - 1, size=4096, dtype=np_dt, endpoint=True)
    new = rng.integers(0, 1 << (8 * width) - 1, size=4096, dtype=np_dt, endpoint=True)
    # NaN, +-0 and inf patterns in both directions
    old[:4] = np.array([0, 1 << (8 * width - 1), (1 << (8 * width)) - 1, 1], dtype=np_dt)
    new[:4] = old[[1, 0, 3, 2]]
    delta = ulp_delta(new, old)
    tv = bits_dtype(dtype)
    got = add_ordered(torch.from_numpy(old.copy()).view(tv), torch.from_numpy(delta).view(tv))
    assert np.array_equal(got.numpy().view(np_dt), new)


def test_small_updates_give_small_deltas() -> None:
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(3)).bfloat16()
    noise = torch.randn(10_000, generator=torch.Generator().manual_seed(4))
    y = (x.float() * (1 + 0.01 * noise)).bfloat16()
    old = x.view(torch.int16).numpy().view(np.uint16)
    new = y.view(torch.int16).numpy().view(np.uint16)
    d = ulp_delta(new, old).view(np.int16).astype(np.int64)
    assert np.abs(d).max() < 64  # a relative change of ~1e-2 is a few ULPs of bf16
    assert Encoding.ULP.relative and Encoding.XOR.relative and not Encoding.OVERWRITE.relative
