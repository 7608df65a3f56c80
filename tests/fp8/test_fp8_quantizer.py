"""The FP8 quantizer (``dcr.tensors.fp8``) against its specification in ``docs/fp8.md``: a
reference written here from the rule alone (``float32`` scale arithmetic in numpy, rounding to
the 254 finite ``e4m3fn`` values by search, ties to even), compared bit for bit; partial tiles,
zero and tiny tiles, saturation, signed zeros and refused non-finite weights; and
:func:`requantize` of only the touched tiles giving exactly the bits of a full quantization."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dcr.errors import ConfigError
from dcr.tensors.fp8 import (
    FP8_DTYPE,
    Fp8Scheme,
    dequantize,
    quantize,
    requantize,
    touched_tiles,
)

SCHEMES = [Fp8Scheme(128), Fp8Scheme(32), Fp8Scheme(None)]


def _e4m3_magnitudes() -> np.ndarray:
    """The 127 finite non-negative ``e4m3fn`` values, by code 0..126 (increasing)."""
    out = []
    for code in range(127):
        e, m = code >> 3, code & 7
        out.append(m * 2.0**-9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return np.array(out)


MAGS = _e4m3_magnitudes()


def _round_e4m3(x: np.ndarray) -> np.ndarray:
    """Codes of ``x`` (float32, |x| <= 448): nearest finite value, ties to the even code."""
    a = np.abs(x.astype(np.float64))
    hi = np.searchsorted(MAGS, a, side="left").clip(0, 126)
    lo = (hi - 1).clip(0, 126)
    d_lo, d_hi = a - MAGS[lo], MAGS[hi] - a
    code = np.where(d_lo < d_hi, lo, hi)
    tie = d_lo == d_hi
    code = np.where(tie, np.where(lo % 2 == 0, lo, hi), code)
    code = np.where(a == MAGS[hi], hi, code)
    return (code | (np.signbit(x).astype(np.int64) << 7)).astype(np.uint8)


def _reference(w: torch.Tensor, scheme: Fp8Scheme) -> tuple[np.ndarray, np.ndarray]:
    """The rule of docs/fp8.md, element by element in numpy."""
    x = w.to(torch.float32).numpy()
    rows, cols = x.shape
    b_r, b_c = (1, cols) if scheme.block is None else (scheme.block, scheme.block)
    tr, tc = -(-rows // b_r), -(-cols // b_c)
    s = np.empty((tr, tc), np.float32)
    q = np.empty((rows, cols), np.uint8)
    for i in range(tr):
        for j in range(tc):
            tile = x[i * b_r : (i + 1) * b_r, j * b_c : (j + 1) * b_c]
            amax = np.float32(np.abs(tile).max())
            scale = np.maximum(np.float32(amax / np.float32(448.0)), np.float32(2.0**-126))
            s[i, j] = scale
            y = np.clip(tile / scale, np.float32(-448.0), np.float32(448.0))
            q[i * b_r : (i + 1) * b_r, j * b_c : (j + 1) * b_c] = _round_e4m3(y)
    return q, s


def _weights(shape: tuple[int, int], seed: int, scale: float = 0.02) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(torch.bfloat16)


def test_the_reference_rounding_agrees_with_the_format_on_every_code() -> None:
    """The reference's table is the format's: each code's value rounds back to that code, and
    the midpoints between neighbours round to the even one."""
    codes = np.arange(127)
    assert np.array_equal(_round_e4m3(MAGS.astype(np.float32)), codes.astype(np.uint8))
    mids = ((MAGS[:-1] + MAGS[1:]) / 2).astype(np.float32)
    got = _round_e4m3(mids)
    assert np.array_equal(got, np.where(codes[:-1] % 2 == 0, codes[:-1], codes[1:]))
    table = torch.tensor(MAGS, dtype=torch.float32).to(FP8_DTYPE).view(torch.uint8).numpy()
    assert np.array_equal(table, codes.astype(np.uint8))


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.describe())
@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (7, 130)])
def test_quantize_follows_the_rule_bit_for_bit(scheme: Fp8Scheme, shape: tuple[int, int]) -> None:
    w = _weights(shape, seed=shape[0])
    # Values at every tile's extremes, ties and subnormals of the FP8 range.
    w.view(-1)[::97] = torch.tensor(1e-30, dtype=torch.bfloat16)
    w.view(-1)[5::131] = -w.view(-1)[5::131] * 7
    q, s = quantize(w, scheme)
    ref_q, ref_s = _reference(w, scheme)
    assert q.dtype == FP8_DTYPE and s.dtype == torch.float32
    assert tuple(s.shape) == scheme.scale_shape(shape)
    assert np.array_equal(q.view(torch.uint8).numpy(), ref_q)
    assert np.array_equal(s.view(torch.int32).numpy(), ref_s.view(np.int32))


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.describe())
def test_tile_extremes_saturate_to_448_and_zeros_keep_their_sign(scheme: Fp8Scheme) -> None:
    w = _weights((128, 128), seed=3)
    w[0, 0] = 5.0
    w[1, 1] = -0.0
    w[1, 2] = 0.0
    q, s = quantize(w, scheme)
    qf = q.to(torch.float32)
    assert float(qf[0, 0]) == 448.0
    assert int(q.view(torch.uint8)[1, 1]) == 0x80 and int(q.view(torch.uint8)[1, 2]) == 0
    assert float(qf.abs().max()) == 448.0
    err = (dequantize(q, s, scheme) - w.to(torch.float32)).abs()
    # e4m3 keeps 3 mantissa bits: within half a step (1/16 relative) of each tile's scale range.
    assert float((err / s.max()).max()) <= 448.0 / 16


def test_a_tile_of_zeros_or_tiny_values_gets_the_smallest_normal_scale() -> None:
    scheme = Fp8Scheme(4)
    w = torch.zeros(8, 8, dtype=torch.bfloat16)
    w[4:, 4:] = torch.tensor(1e-40, dtype=torch.bfloat16)  # a bf16 subnormal
    q, s = quantize(w, scheme)
    assert s.view(torch.int32).tolist() == [[0x00800000, 0x00800000], [0x00800000, 0x00800000]]
    assert int(q.view(torch.uint8)[:4].max()) == 0
    ref_q, _ = _reference(w, scheme)
    assert np.array_equal(q.view(torch.uint8).numpy(), ref_q)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_weights_that_are_not_finite_are_refused(bad: float) -> None:
    w = _weights((64, 64), seed=1)
    w[3, 5] = bad
    with pytest.raises(ConfigError, match="not finite") as err:
        quantize(w, Fp8Scheme(32), name="layer.weight")
    assert err.value.tensor == "layer.weight"


def test_schemes_and_shapes_are_checked() -> None:
    with pytest.raises(ConfigError, match="positive"):
        Fp8Scheme(0)
    with pytest.raises(ConfigError, match="matrix"):
        quantize(torch.zeros(4, dtype=torch.bfloat16), Fp8Scheme(128))
    assert Fp8Scheme(128).scale_name("a.weight") == "a.weight_scale_inv"
    assert Fp8Scheme(None).scale_name("a.weight") == "a.weight_scale"


def _changed(shape: tuple[int, int], n: int, seed: int) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(shape[0] * shape[1], generator=g)[:n].sort().values.numpy()


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.describe())
@pytest.mark.parametrize("shape", [(256, 384), (300, 200)])
def test_requantizing_the_touched_tiles_gives_the_full_quantization(
    scheme: Fp8Scheme, shape: tuple[int, int]
) -> None:
    """Over three versions: the delta is exactly the elements whose bits differ between full
    quantizations, and the baseline updated in place is the new full quantization."""
    w = _weights(shape, seed=11)
    q, s = quantize(w, scheme)
    for version, n in enumerate((40, 900, 0), start=1):
        idx = _changed(shape, n, seed=version)
        new = w.clone()
        flat = new.view(-1)
        flat[idx] = (flat[idx].to(torch.float32) * 1.5).to(torch.bfloat16)
        full_q, full_s = quantize(new, scheme)
        tiles = touched_tiles(idx, shape, scheme)
        before_q, before_s = q.clone(), s.clone()
        delta = requantize(new, q, s, tiles, scheme, update=True)
        want_q = np.flatnonzero(
            (before_q.view(torch.uint8) != full_q.view(torch.uint8)).numpy().reshape(-1)
        )
        want_s = np.flatnonzero(
            (before_s.view(torch.int32) != full_s.view(torch.int32)).numpy().reshape(-1)
        )
        assert np.array_equal(delta.q_index, want_q)
        assert np.array_equal(delta.q_values, full_q.view(torch.uint8).numpy().reshape(-1)[want_q])
        assert np.array_equal(np.sort(delta.s_index), want_s)
        assert np.array_equal(q.view(torch.uint8).numpy(), full_q.view(torch.uint8).numpy())
        assert np.array_equal(s.view(torch.int32).numpy(), full_s.view(torch.int32).numpy())
        assert delta.tiles == len(tiles) and delta.empty == (n == 0)
        w = new


def test_a_changed_scale_changes_values_whose_weights_did_not_change() -> None:
    """Only the tile's largest weight changes; the scale moves with it, and so do the FP8 bits
    of unchanged weights, while the changed weight stays at 448 (the tile's maximum): the delta
    carries the scale and the others (paper Fig. D.1)."""
    scheme = Fp8Scheme(32)
    w = _weights((64, 64), seed=5)
    w[0, 0] = 0.5
    q, s = quantize(w, scheme)
    new = w.clone()
    new[0, 0] = 0.625
    delta = requantize(new, q, s, touched_tiles(np.array([0]), (64, 64), scheme), scheme)
    assert delta.s_index.tolist() == [0]
    moved = {int(i) for i in delta.q_index}
    assert 0 not in moved and len(moved) > 100
    assert all((i // 64) < 32 and (i % 64) < 32 for i in moved)


def test_touched_tiles_maps_elements_to_their_tiles() -> None:
    shape = (300, 200)
    idx = np.array([0, 127, 128, 199, 128 * 200, 299 * 200 + 199])
    assert touched_tiles(idx, shape, Fp8Scheme(128)).tolist() == [0, 1, 2, 5]
    assert touched_tiles(idx, shape, Fp8Scheme(None)).tolist() == [0, 128, 299]
    assert touched_tiles(np.empty(0, np.int64), shape, Fp8Scheme(128)).tolist() == []
