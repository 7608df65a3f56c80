"""Rice-split coding (format version 2): bit packing, zigzag, nibbles, parameter choice, and
payloads below the gap + XOR order-0 floor on the paper's workload."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dcr.delta.entropy import gap_xor_floor_bytes
from dcr.tensors.bits import bits
from dcr.tensors.ordered import ulp_delta
from dcr.tensors.records import Encoding, Item
from dcr.wire.encode import encode_payload
from dcr.wire.format import PayloadHeader
from dcr.wire.split import (
    GAP_CAP,
    gap_k,
    pack_bits,
    pack_nibbles,
    remainder_bytes,
    split,
    unpack_bits,
    unpack_nibbles,
    unzigzag,
    value_k,
    zigzag,
)


@pytest.mark.parametrize("k", range(1, 65))
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1000])
def test_bits_round_trip(k: int, n: int) -> None:
    rng = np.random.default_rng(k * 1000 + n)
    words = rng.integers(0, 2**63, n, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    words &= np.uint64((1 << k) - 1) if k < 64 else np.uint64(2**64 - 1)
    packed = pack_bits(words, k)
    assert packed.shape[0] == remainder_bytes(n, k) == n * (k // 8) + (n * (k % 8) + 7) // 8
    got = unpack_bits(packed, k, n)
    assert got is not None and np.array_equal(got, words)


def test_bits_layout_is_planes_then_packed_bits() -> None:
    # k = 11: one byte plane of bits 0-7, then 3 bits per word, least significant first.
    words = np.array([0x7FF, 0x001, 0x502], dtype=np.uint16)
    packed = pack_bits(words, 11)
    assert packed[:3].tolist() == [0xFF, 0x01, 0x02]
    assert int.from_bytes(packed[3:].tobytes(), "little") == 0b111 | 0b000 << 3 | 0b101 << 6


def test_padding_bits_must_be_zero() -> None:
    packed = pack_bits(np.array([5, 6, 7], dtype=np.uint8), 3)  # 9 bits: 2 bytes
    for bit in range(9, 16):
        damaged = packed.copy()
        damaged[1] |= 1 << (bit - 8)
        assert unpack_bits(damaged, 3, 3) is None


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64])
def test_zigzag_is_a_bijection_onto_small_codes(dtype: type) -> None:
    width = np.dtype(dtype).itemsize
    signed = np.array([0, -1, 1, -2, 2, -(2 ** (8 * width - 1)), 2 ** (8 * width - 1) - 1])
    words = signed.astype(np.int64).astype(f"i{width}").view(dtype)
    z = zigzag(words)
    assert z.dtype == np.dtype(dtype)
    assert z[:5].tolist() == [0, 1, 2, 3, 4]
    assert int(z[5]) == 2 ** (8 * width) - 1 and int(z[6]) == 2 ** (8 * width) - 2
    assert np.array_equal(unzigzag(z.copy()), words)
    every = np.arange(256, dtype=np.uint8)
    assert np.array_equal(np.sort(zigzag(every)), every)


def test_nibbles_pair_symbols_low_first() -> None:
    assert pack_nibbles(np.array([1, 2, 3], dtype=np.uint8)).tolist() == [0x21, 0x03]
    got = unpack_nibbles(np.array([0x21, 0x03], dtype=np.uint8), 3)
    assert got is not None and got.tolist() == [1, 2, 3]
    assert unpack_nibbles(np.array([0x21, 0x13], dtype=np.uint8), 3) is None


def test_split_escapes_large_quotients() -> None:
    x = np.array([3, 255 * 4, 255 * 4 - 1, 10**9], dtype=np.uint64)
    sym, esc, rem = split(x, 2, GAP_CAP)
    assert sym.tolist() == [0, 255, 254, 255]
    assert esc.tolist() == [255, 10**9 >> 2]
    assert rem.tolist() == [3, 0, 3, 10**9 & 3]


def test_parameters_follow_the_data() -> None:
    assert gap_k(2, 0, 1) == 0
    assert gap_k(1001, 0, 1000 * 129) == 5  # mean gap 128: an eighth is 16 = 2**4..2**5
    assert value_k(np.arange(14, dtype=np.uint16)) == 0
    assert value_k(np.full(1000, 1 << 20, dtype=np.uint32)) == 17


def _workload(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The paper's workload: ``fraction`` of ``n`` BF16 weights chosen uniformly, each set to
    ``bf16(w * (1 + 0.01 * eps))``; returns changed indices, old and new bits there."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=gen, dtype=torch.bfloat16)
    chosen = torch.randperm(n, generator=gen)[: round(fraction * n)]
    eps = torch.randn(chosen.shape[0], generator=gen, dtype=torch.float32)
    new = w.clone()
    new[chosen] = (w[chosen].float() * (1 + 0.01 * eps)).to(torch.bfloat16)
    old_bits, new_bits = bits(w), bits(new)
    idx = np.flatnonzero(old_bits != new_bits).astype(np.int64)
    return idx, old_bits[idx], new_bits[idx]


@pytest.mark.parametrize(
    ("fraction", "n"), [(0.01, 4_000_000), (0.03, 2_000_000), (0.05, 2_000_000)]
)
def test_ulp_payloads_are_below_the_gap_xor_floor(fraction: float, n: int) -> None:
    idx, old, new = _workload(n, fraction, seed=0)
    floor = gap_xor_floor_bytes([(idx, old ^ new)])
    header = PayloadHeader(attempt=0, owner=0, payload_id=0, final=True)

    def size(encoding: Encoding, values: np.ndarray, version: int = 2) -> int:
        item = Item(
            name="w",
            shape=(n,),
            dtype=torch.bfloat16,
            encoding=encoding,
            indices=idx,
            values=values,
        )
        return len(encode_payload(header, [item], version=version))

    ulp = size(Encoding.ULP, ulp_delta(new, old))
    assert ulp <= 0.95 * floor, (fraction, ulp / floor)
    # Version 1 with XOR masks (what was sent before) is above the floor.
    assert size(Encoding.XOR, old ^ new, version=1) > floor
    # Version 2's positions alone (all-zero values: the header, the records and near-empty
    # value planes come on top) cost within 2% of the gap part of the floor.
    positions = size(Encoding.XOR, np.zeros_like(old))
    gap_floor = gap_xor_floor_bytes([(idx, np.zeros_like(old))])
    assert positions <= 1.02 * gap_floor + 256, positions / gap_floor
