"""The gap + XOR order-0 floor on hand-computed cases, and XOR masks of every encoding."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dcr.delta.entropy import (
    floor_of_items,
    gap_xor_floor_bytes,
    item_gaps,
    order0_bits,
    xor_masks,
)
from dcr.errors import ConfigError
from dcr.tensors.bits import bits
from dcr.tensors.ordered import ulp_delta
from dcr.tensors.records import Encoding, Item


def test_hand_computed_floor_of_one_item():
    idx = np.array([0, 2, 3, 7], dtype=np.int64)
    masks = np.array([1, 1, 2, 1], dtype=np.uint16)
    np.testing.assert_array_equal(item_gaps(idx), [0, 1, 0, 3])
    # gaps {0: 2, 1: 1, 3: 1}: 2*1 + 1*2 + 1*2 = 6 bits
    assert order0_bits(item_gaps(idx)) == pytest.approx(6.0)
    # masks {1: 3, 2: 1}: 3*log2(4/3) + 1*2 bits
    mask_bits = 3 * math.log2(4 / 3) + 2
    assert order0_bits(masks) == pytest.approx(mask_bits)
    assert gap_xor_floor_bytes([(idx, masks)]) == pytest.approx((6.0 + mask_bits) / 8)


def test_gaps_restart_per_item_and_widths_are_separate_alphabets():
    a = (np.array([1, 2], dtype=np.int64), np.array([5, 5], dtype=np.uint16))  # gaps 1, 0
    b = (np.array([1], dtype=np.int64), np.array([5], dtype=np.uint32))  # gap 1 (first index)
    # gaps {1: 2, 0: 1} -> 2*log2(3/2) + log2(3); u16 masks {5: 2} -> 0; u32 masks {5: 1} -> 0
    expect = 2 * math.log2(3 / 2) + math.log2(3)
    assert gap_xor_floor_bytes([a, b]) == pytest.approx(expect / 8)
    assert gap_xor_floor_bytes([]) == 0.0
    # one constant symbol carries no information
    assert order0_bits(np.zeros(10, dtype=np.int64)) == 0.0
    # large symbols take the unique() path and give the same answer
    big = np.array([1 << 40, 1 << 40, 3], dtype=np.int64)
    assert order0_bits(big) == pytest.approx(order0_bits(np.array([9, 9, 3])))


def test_bad_entries_raise():
    with pytest.raises(ConfigError):
        gap_xor_floor_bytes([(np.array([3, 3], dtype=np.int64), np.zeros(2, np.uint16))])
    with pytest.raises(ConfigError):
        gap_xor_floor_bytes([(np.array([3], dtype=np.int64), np.zeros(2, np.uint16))])


def test_xor_masks_of_every_encoding():
    old_t = torch.tensor([1.0, -2.0, 0.0, 3.5, float("inf")], dtype=torch.bfloat16)
    new_t = torch.tensor([1.5, -2.0, -0.0, 3.25, float("nan")], dtype=torch.bfloat16)
    old, new = bits(old_t), bits(new_t)
    idx = np.array([0, 2, 3, 4], dtype=np.int64)
    want = new[idx] ^ old[idx]

    def item(enc: Encoding, values: np.ndarray) -> Item:
        return Item(
            name="t", shape=(5,), dtype=torch.bfloat16, encoding=enc, indices=idx, values=values
        )

    for enc, values in (
        (Encoding.XOR, want),
        (Encoding.OVERWRITE, new[idx]),
        (Encoding.ULP, ulp_delta(new[idx], old[idx])),
    ):
        np.testing.assert_array_equal(xor_masks(item(enc, values), old), want)
    floor = floor_of_items([item(Encoding.OVERWRITE, new[idx])], {"t": old})
    assert floor == pytest.approx(gap_xor_floor_bytes([(idx, want)]))
    with pytest.raises(ConfigError):
        xor_masks(item(Encoding.XOR, want), old.astype(np.uint32))
