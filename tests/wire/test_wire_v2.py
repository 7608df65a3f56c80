"""Payload format version 2: the documented bytes, round trips of every location and value
coding at every dtype and edge, and a rejection, with the right ``check``, of every field.

Bodies are built here by hand from ``docs/wire-format.md`` and sealed with a fresh digest, so
the digest check passes and the structural checks are what reject them.
"""

from __future__ import annotations

import hashlib
import math
import struct

import blake3
import numpy as np
import pytest
import torch
import zstandard

from dcr.errors import PayloadRejected
from dcr.tensors.bits import DTYPE_CODES, numpy_bits_dtype
from dcr.tensors.ordered import ULP_DTYPES
from dcr.tensors.records import Encoding, Item, TensorSpec
from dcr.wire.decode import decode_payload
from dcr.wire.encode import encode_payload
from dcr.wire.format import DecodeLimits, Items, PayloadHeader, ValueLayout

# Every test runs with the C kernels and with numpy only (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("both_paths")

ATTEMPT = 11
_HEADER = struct.Struct("<4sHHQIIBBHiIIQQ")  # docs: header fields before the digest
_PRE = struct.Struct("<IIQQQ")  # docs: version 2 preamble
_TENSOR = struct.Struct("<HBB")  # docs: fixed part of a tensor list entry
_RECORD = struct.Struct("<IBBBBQQ")  # docs: item record
BF16, F32, F64, INT8, BOOL = 1, 3, 4, 5, 10  # docs: dtype codes
XOR, OVERWRITE, ULP = 0, 1, 2
RUN, RICE = 0, 5
H = PayloadHeader(attempt=ATTEMPT, owner=2, payload_id=3, final=True)


def seal(compressed: bytes, *, body_bytes: int, n_items: int, layout: int = 0) -> bytes:
    fixed = _HEADER.pack(
        b"DCRP", 2, 0, ATTEMPT, 2, 3, 1, layout, 0, 1, n_items, 0, body_bytes, len(compressed)
    )
    return fixed + hashlib.blake2b(fixed + compressed, digest_size=16).digest() + compressed


def tensor(name: str | bytes = "w", dtype: int = BF16, shape: tuple[int, ...] = (64,)) -> bytes:
    raw = name.encode() if isinstance(name, str) else name
    return _TENSOR.pack(len(raw), dtype, len(shape)) + struct.pack(f"<{len(shape)}Q", *shape) + raw


def record(
    t: int = 0,
    enc: int = XOR,
    kind: int = RUN,
    lk: int = 0,
    vk: int = 0,
    count: int = 0,
    start: int = 0,
) -> bytes:
    return _RECORD.pack(t, enc, kind, lk, vk, count, start)


def body2(
    tensors: list[bytes],
    records: list[bytes],
    streams: bytes = b"",
    *,
    n_tensors: int | None = None,
    loc_esc: int = 0,
    val_esc: int = 0,
    reserved: int = 0,
) -> bytes:
    listed = b"".join(tensors)
    pre = _PRE.pack(
        len(tensors) if n_tensors is None else n_tensors, reserved, len(listed), loc_esc, val_esc
    )
    return pre + listed + b"".join(records) + streams


def payload2(raw: bytes, n_items: int, layout: int = 0) -> bytes:
    compressed = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(raw)
    return seal(compressed, body_bytes=len(raw), n_items=n_items, layout=layout)


def reject(data: bytes, **kw: object) -> PayloadRejected:
    with pytest.raises(PayloadRejected) as err:
        decode_payload(data, **kw)  # type: ignore[arg-type]
    assert err.value.attempt == ATTEMPT
    return err.value


def u16(*values: int) -> bytes:
    return np.array(values, dtype="<u2").tobytes()


def u64(*values: int) -> bytes:
    return np.array(values, dtype="<u8").tobytes()


# ------------------------------------------------------------------------------------------
# The documented bytes


def _example() -> list[Item]:
    return [
        Item(
            name="A",
            shape=(4, 4),
            dtype=torch.bfloat16,
            encoding=Encoding.ULP,
            indices=np.array([5, 6, 7], dtype=np.int64),
            values=np.array([1, 0xFFFF, 3], dtype=np.uint16),  # deltas +1, -1, +3
        ),
        Item(
            name="B",
            shape=(10,),
            dtype=torch.float32,
            encoding=Encoding.OVERWRITE,
            indices=np.array([2, 5, 8], dtype=np.int64),
            values=np.array([0x3F800000, 0x7FC00000, 0x80000000], dtype=np.uint32),
        ),
    ]


def test_worked_example_matches_the_encoder() -> None:
    """docs/wire-format.md, version 2 worked example, byte for byte."""
    expected = body2(
        [tensor("A", BF16, (4, 4)), tensor("B", F32, (10,))],
        [
            record(0, ULP, RUN, count=3, start=5),
            record(1, OVERWRITE, RICE, count=3, start=2),
        ],
        bytes([2, 2])  # B's gaps 2, 2 (k = 0): location symbols
        + np.array([0x3F800000, 0x7FC00000, 0x80000000], dtype="<u4").tobytes()  # class 4
        + bytes([0x12, 0x06]),  # A's zigzagged deltas 2, 1, 6 as nibbles
    )
    for layout in ValueLayout:
        data = encode_payload(
            PayloadHeader(attempt=7, owner=1, payload_id=0, final=True),
            _example(),
            layout=layout,
            version=2,
        )
        raw = zstandard.ZstdDecompressor().decompress(data[72:])
        if layout is ValueLayout.PLAIN:
            assert raw == expected
        else:  # class 4 as four byte planes
            planes = bytes([0, 0, 0, 0, 0, 0, 0x80, 0xC0, 0, 0x3F, 0x7F, 0x80])
            assert raw == expected.replace(expected[-14:-2], planes)
        assert data[:56] == _HEADER.pack(
            b"DCRP", 2, 3, 7, 1, 0, 1, int(layout), 0, 1, 2, 0, len(raw), len(data) - 72
        )
        assert data[56:72] == blake3.blake3(data[:56] + data[72:]).digest()[:16]
        assert zstandard.get_frame_parameters(data[72:]).content_size == len(raw)
        a, b = decode_payload(data).items
        assert a.indices.tolist() == [5, 6, 7] and a.values.tolist() == [1, 0xFFFF, 3]
        assert b.indices.tolist() == [2, 5, 8] and b.encoding is Encoding.OVERWRITE


def test_hand_built_rice_remainders_and_escapes_decode() -> None:
    # Gaps 5, 300, 7 with k = 2: quotients 1, 75, 1 and remainders 1, 0, 3 (2 bits each);
    # a cap of 255 is not reached.  Then gaps 0, 70000 with k = 0: the second escapes.
    rems = (1 | 0 << 2 | 3 << 4).to_bytes(1, "little")
    raw = body2(
        [tensor("w", shape=(100_000,))],
        [
            record(0, XOR, RICE, lk=2, count=4, start=10),
            record(0, OVERWRITE, RICE, count=3, start=90),
        ],
        bytes([1, 75, 1, 0, 255]) + rems + u64(70_000) + u16(1, 2, 3, 4, 5, 6, 7),
        loc_esc=1,
    )
    a, b = decode_payload(payload2(raw, 2)).items
    assert a.indices.tolist() == [10, 16, 317, 325]
    assert b.indices.tolist() == [90, 91, 70_092]
    assert a.values.tolist() == [1, 2, 3, 4] and b.values.tolist() == [5, 6, 7]


def test_hand_built_ulp_escapes_and_remainders_decode() -> None:
    # zigzag values 3, 40, 17 with k = 1: quotients 1, 20 (escape), 8; remainders 1, 0, 1.
    raw = body2(
        [tensor("w", F32, (8,))],
        [record(0, ULP, RUN, vk=1, count=3, start=0)],
        bytes([0xF1, 0x08]) + bytes([0b101]) + u64(20),
        val_esc=1,
    )
    (item,) = decode_payload(payload2(raw, 1)).items
    # unzigzag(3) = -2, unzigzag(40) = 20, unzigzag(17) = -9, as u32 two's complement
    assert item.values.tolist() == [2**32 - 2, 20, 2**32 - 9]
    assert item.encoding is Encoding.ULP


# ------------------------------------------------------------------------------------------
# Round trips


_DTYPES = sorted(DTYPE_CODES, key=DTYPE_CODES.__getitem__)


def _values(dtype: torch.dtype, n: int, rng: np.random.Generator, small: bool) -> np.ndarray:
    np_dtype = numpy_bits_dtype(dtype)
    if dtype == torch.bool:
        return rng.integers(0, 1, n, dtype=np.uint8, endpoint=True)
    if small:  # small signed deltas, two's complement, with a few large ones (escapes)
        width = np.dtype(np_dtype).itemsize
        d = rng.integers(-6, 7, n).astype(np.int64)
        d[rng.random(n) < 0.02] = rng.integers(-(2 ** (8 * width - 2)), 2 ** (8 * width - 2), 1)
        return d.astype(np_dtype)
    top = np.iinfo(np_dtype).max
    out = rng.integers(0, top, n, dtype=np_dtype, endpoint=True)
    out[: min(n, 3)] = np.array([0, top, top // 2 + 1], dtype=np_dtype)[: min(n, 3)]
    return out


def _index_sets(numel: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    sets = {
        "empty": np.empty(0, dtype=np.int64),
        "single": np.array([numel - 1], dtype=np.int64),
        "run": np.arange(3, min(numel, 40), dtype=np.int64),
        "full": np.arange(numel, dtype=np.int64),
        "ends": np.array([0, numel - 1], dtype=np.int64),  # the largest gap there is
        "sparse": np.flatnonzero(rng.random(numel) < 0.01).astype(np.int64),
        "dense": np.flatnonzero(rng.random(numel) < 0.6).astype(np.int64),
        "outlier": np.array([1, 2, 3, 5, 8, numel - 2], dtype=np.int64),  # escapes
    }
    return sets


def _check(decoded: Item, item: Item) -> None:
    assert (decoded.name, decoded.shape, decoded.dtype) == (item.name, item.shape, item.dtype)
    assert decoded.encoding is item.encoding
    assert decoded.indices.dtype == np.int64
    assert np.array_equal(decoded.indices, item.indices)
    assert decoded.values.dtype == np.dtype(numpy_bits_dtype(item.dtype))
    assert np.array_equal(decoded.values, item.values)
    decoded.validate()


@pytest.mark.parametrize("layout", list(ValueLayout))
@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
def test_every_coding_round_trips_at_every_dtype(dtype: torch.dtype, layout: ValueLayout) -> None:
    rng = np.random.default_rng(DTYPE_CODES[dtype])
    numel = 5000
    encodings = [Encoding.XOR, Encoding.OVERWRITE] + ([Encoding.ULP] if dtype in ULP_DTYPES else [])
    items = []
    for enc in encodings:
        for kind, idx in _index_sets(numel, rng).items():
            small = enc is Encoding.ULP and kind != "dense"
            items.append(
                Item(
                    name=f"{enc.name}.{kind}",
                    shape=(50, 100),
                    dtype=dtype,
                    encoding=enc,
                    indices=idx,
                    values=_values(dtype, idx.shape[0], rng, small),
                )
            )
    data = encode_payload(H, items, layout=layout)
    catalog = {it.name: it.spec for it in items}
    payload = decode_payload(data, catalog=catalog, xor_allowed=set(catalog))
    assert isinstance(payload.items, Items)
    assert len(payload.items) == len(items)
    for decoded, item in zip(payload.items, items, strict=True):
        _check(decoded, item)


def test_huge_tensors_and_extreme_words_round_trip() -> None:
    rng = np.random.default_rng(5)
    numel = 2**48
    idx = np.array([0, 1, 2**40, 2**48 - 2, 2**48 - 1], dtype=np.int64)
    far = np.unique(rng.integers(0, numel, 300, dtype=np.int64))
    ulp64 = np.array([0, 1, 2**63, 2**64 - 1, 2**63 - 1], dtype=np.uint64)
    items = [
        Item(
            name="a",
            shape=(2**24, 2**24),
            dtype=torch.float64,
            encoding=Encoding.ULP,
            indices=idx,
            values=ulp64,
        ),
        Item(
            name="b",
            shape=(numel,),
            dtype=torch.bfloat16,
            encoding=Encoding.XOR,
            indices=far,
            values=_values(torch.bfloat16, far.shape[0], rng, False),
        ),
        Item(
            name="c",
            shape=(numel,),
            dtype=torch.float8_e4m3fn,
            encoding=Encoding.ULP,
            indices=far,
            values=_values(torch.float8_e4m3fn, far.shape[0], rng, False),
        ),
    ]
    payload = decode_payload(encode_payload(H, items))
    for decoded, item in zip(payload.items, items, strict=True):
        _check(decoded, item)


def test_items_of_one_tensor_and_mixed_parameters_share_streams() -> None:
    """Several items per tensor, Rice parameters that differ per item, odd ULP counts."""
    rng = np.random.default_rng(9)
    items = []
    for i, density in enumerate([0.5, 0.01, 0.001, 0.2, 0.0005]):
        numel = 200_000
        idx = np.flatnonzero(rng.random(numel) < density).astype(np.int64)[: 2 * (i + 3) + 1]
        enc = [Encoding.ULP, Encoding.XOR][i % 2]
        scale = [1, 1000, 10**6, 3, 1][i]
        d = (rng.integers(-4, 5, idx.shape[0]) * scale).astype(np.int64).astype(np.uint32)
        items.append(
            Item(
                name=f"t{i % 2}",
                shape=(numel,),
                dtype=torch.float32,
                encoding=enc,
                indices=idx,
                values=d,
            )
        )
    for layout in ValueLayout:
        payload = decode_payload(encode_payload(H, items, layout=layout))
        for decoded, item in zip(payload.items, items, strict=True):
            _check(decoded, item)


def test_decoded_items_are_views_of_compact_arrays() -> None:
    rng = np.random.default_rng(2)
    items = [
        Item(
            name=f"w{i}",
            shape=(1000,),
            dtype=torch.bfloat16,
            encoding=Encoding.XOR,
            indices=np.sort(rng.choice(1000, 10, replace=False)).astype(np.int64),
            values=rng.integers(0, 2**16, 10, dtype=np.uint16),
        )
        for i in range(5)
    ]
    payload = decode_payload(encode_payload(H, items))
    got = payload.items
    assert isinstance(got, Items)
    assert got.indices.shape == (50,) and got.values[2].shape == (50,)
    for i, it in enumerate(got):
        assert it.indices.base is got.indices or it.indices.base is got.indices.base
        assert np.shares_memory(it.values, got.values[2])
        assert it.indices.flags.writeable
        _check(it, items[i])
    assert [it.name for it in got[1:3]] == ["w1", "w2"] and got[-1].name == "w4"
    # A decoded payload re-encodes to the same bytes (the fault injector relies on it).
    assert encode_payload(H, got) == encode_payload(H, items)


def test_version_1_payloads_still_decode() -> None:
    items = _example()[1:]
    data = encode_payload(H, items, version=1)
    assert data[4:6] == b"\x01\x00"
    (b,) = decode_payload(data).items
    _check(b, items[0])


# ------------------------------------------------------------------------------------------
# Rejections


def _valid_streams() -> tuple[list[bytes], list[bytes], bytes]:
    return (
        [tensor("w", BF16, (64,))],
        [record(0, XOR, RICE, count=3, start=1)],
        bytes([2, 2]) + u16(1, 2, 3),  # positions 1, 4, 7
    )


def test_the_valid_base_case_decodes() -> None:
    t, r, s = _valid_streams()
    (item,) = decode_payload(payload2(body2(t, r, s), 1)).items
    assert item.indices.tolist() == [1, 4, 7]


T = tensor
R = record


@pytest.mark.parametrize(
    ("tensors", "records", "streams", "kw", "check"),
    [
        # preamble
        ([T()], [R()], b"", {"reserved": 1}, "schema"),
        ([T()], [R()], b"", {"n_tensors": 2}, "schema"),
        ([T()], [R()], b"", {"n_tensors": 0}, "schema"),
        ([T()], [R(kind=RICE, count=2)], bytes([0]) + u16(0, 0), {"loc_esc": 2}, "bounds"),
        ([T()], [R(enc=ULP, count=1)], bytes([1]), {"val_esc": 2}, "bounds"),
        # tensor list
        ([T(b"")], [R()], b"", {}, "name"),
        ([T(b"\xff\xfe")], [R()], b"", {}, "name"),
        ([T("x" * 1025)], [R()], b"", {}, "name"),
        ([T(dtype=0)], [R()], b"", {}, "dtype"),
        ([T(dtype=99)], [R()], b"", {}, "dtype"),
        ([T(shape=(2,) * 9)], [R()], b"", {}, "shape"),
        ([T(shape=(2**30, 2**30))], [R()], b"", {}, "shape"),
        ([T("w"), T("w")], [R(0), R(1)], b"", {}, "name"),
        ([T("a"), T("b")], [R(0), R(0)], b"", {}, "schema"),  # b has no item
        ([T() + b"\0"], [R()], b"", {}, "schema"),  # bytes after the last tensor
        # records
        ([T()], [R(t=1)], b"", {}, "schema"),
        ([T()], [R(enc=3)], b"", {}, "encoding"),
        ([T()], [R(kind=1)], b"", {}, "encoding"),
        ([T()], [R(kind=6)], b"", {}, "encoding"),
        ([T(dtype=INT8)], [R(enc=ULP, count=1)], bytes([1]), {}, "encoding"),
        ([T(dtype=BOOL)], [R(enc=ULP, count=1)], bytes([1]), {}, "encoding"),
        ([T()], [R(count=65)], u16(*[0] * 65), {}, "bounds"),
        ([T()], [R(count=40), R(count=30, start=34)], u16(*[0] * 70), {}, "bounds"),
        ([T()], [R(count=2, start=63)], u16(0, 0), {}, "bounds"),  # run past the end
        ([T()], [R(start=3)], b"", {}, "bounds"),  # empty run not at 0
        ([T()], [R(kind=RICE, count=2, start=64)], bytes([0]) + u16(0, 0), {}, "bounds"),
        ([T()], [R(lk=1, count=1)], u16(0), {}, "schema"),  # a run with a Rice parameter
        ([T()], [R(kind=RICE, count=1)], u16(0), {}, "schema"),
        ([T()], [R(kind=RICE, lk=64, count=2)], bytes([0, 0]) + u16(0, 0), {}, "schema"),
        ([T()], [R(vk=1, count=1)], u16(0), {}, "schema"),  # value parameter without ULP
        ([T()], [R(enc=ULP, vk=1)], b"", {}, "schema"),  # ... or without entries
        ([T()], [R(enc=ULP, vk=16, count=1)], bytes([0, 0, 0]), {}, "schema"),
        # buffers
        ([T()], [R(count=2)], u16(0), {}, "bounds"),  # missing value bytes
        ([T()], [R(count=2)], u16(0, 0, 0), {}, "bounds"),  # trailing bytes
        ([T()], [R(kind=RICE, count=3)], bytes([2]) + u16(0, 0, 0), {}, "bounds"),
        ([T()], [R(kind=RICE, count=3)], bytes([30, 40]) + u16(0, 0, 0), {}, "bounds"),  # past
        ([T()], [R(kind=RICE, count=2, start=1)], bytes([62]) + u16(0, 0), {}, "bounds"),  # last
        (
            [T()],
            [R(kind=RICE, count=2)],
            bytes([255]) + u64(254) + u16(0, 0),
            {"loc_esc": 1},
            "bounds",
        ),
        (
            [T()],
            [R(kind=RICE, count=2)],
            bytes([255]) + u64(2**60) + u16(0, 0),
            {"loc_esc": 1},
            "bounds",
        ),
        (
            [T()],
            [R(kind=RICE, count=3)],
            bytes([255, 1]) + u64(300, 300) + u16(0, 0, 0),
            {"loc_esc": 2},
            "bounds",
        ),
        (
            [T()],
            [R(kind=RICE, lk=3, count=2)],
            bytes([0, 0xF8]) + u16(0, 0),
            {},
            "schema",
        ),  # padding bit
        ([T()], [R(kind=RICE, lk=6, count=2)], bytes([1, 0x3F]) + u16(0, 0), {}, "bounds"),  # 64+63
        ([T()], [R(enc=ULP, count=1)], bytes([0x21]), {}, "schema"),  # padding nibble
        ([T()], [R(enc=ULP, count=2)], bytes([0xF1]) + u64(14), {"val_esc": 1}, "bounds"),
        ([T()], [R(enc=ULP, count=2)], bytes([0xF1]) + u64(2**16), {"val_esc": 1}, "bounds"),
        (
            [T()],
            [R(enc=ULP, vk=12, count=1)],
            bytes([0x0F, 0xFF, 0x0F]) + u64(16),
            {"val_esc": 1},
            "bounds",
        ),
        ([T(dtype=BOOL)], [R(count=2)], bytes([1, 2]), {}, "bounds"),
    ],
)
def test_every_field_is_checked(
    tensors: list[bytes], records: list[bytes], streams: bytes, kw: dict[str, int], check: str
) -> None:
    data = payload2(body2(tensors, records, streams, **kw), len(records))
    assert reject(data).check == check


def test_catalog_and_classification() -> None:
    t, r, s = _valid_streams()
    data = payload2(body2(t, r, s), 1)
    spec = TensorSpec(name="w", shape=(64,), dtype=torch.bfloat16)
    decode_payload(data, catalog={"w": spec}, xor_allowed={"w"})
    for catalog, check in [
        ({"v": spec}, "name"),
        ({"w": TensorSpec(name="w", shape=(8, 8), dtype=torch.bfloat16)}, "shape"),
        ({"w": TensorSpec(name="w", shape=(64,), dtype=torch.float16)}, "dtype"),
    ]:
        err = reject(data, catalog=catalog)
        assert (err.check, err.tensor) == (check, "w")
    assert reject(data, xor_allowed=set()).check == "classification"
    ulp = payload2(body2([T()], [R(enc=ULP, count=1)], bytes([1])), 1)
    assert reject(ulp, xor_allowed={"v"}).check == "classification"
    over = payload2(body2([T()], [R()] * 3, b""), 3)
    assert reject(over, limits=DecodeLimits(max_items_per_tensor=2)).check == "oversized"
    decode_payload(over, limits=DecodeLimits(max_items_per_tensor=3))


def test_frame_rules_of_version_2() -> None:
    t, r, s = _valid_streams()
    raw = body2(t, r, s)
    no_size = zstandard.ZstdCompressor(write_content_size=False).compress(raw)
    assert reject(seal(no_size, body_bytes=len(raw), n_items=1)).check == "decompress"
    params = zstandard.ZstdCompressionParameters.from_level(1, window_log=24)
    big = zstandard.ZstdCompressor(compression_params=params).compressobj(size=len(raw))
    wide = big.compress(raw) + big.flush()
    if zstandard.get_frame_parameters(wide).window_size > 1 << 23:
        assert reject(seal(wide, body_bytes=len(raw), n_items=1)).check == "decompress"
    good = zstandard.ZstdCompressor(write_content_size=True).compress(raw)
    for junk in (b"\0", good):
        assert reject(seal(good + junk, body_bytes=len(raw), n_items=1)).check == "decompress"
    assert reject(seal(good[:-1], body_bytes=len(raw), n_items=1)).check == "decompress"


def test_every_flipped_byte_and_truncation_is_rejected() -> None:
    data = encode_payload(H, _example())
    for i in range(len(data)):
        damaged = bytearray(data)
        damaged[i] ^= 0x04
        with pytest.raises(PayloadRejected):
            decode_payload(bytes(damaged))
        with pytest.raises(PayloadRejected):
            decode_payload(data[:i])


@pytest.mark.parametrize("seed", range(3))
def test_damaged_bodies_are_rejected_or_decode_cleanly(seed: int) -> None:
    """Bytes flipped before compression, resealed: a typed rejection or a valid payload."""
    rng = np.random.default_rng(seed)
    items = [
        Item(
            name="a",
            shape=(3000,),
            dtype=torch.bfloat16,
            encoding=Encoding.ULP,
            indices=np.flatnonzero(rng.random(3000) < 0.05).astype(np.int64),
            values=np.zeros(0, dtype=np.uint16),
        ),
    ]
    items[0] = Item(
        name="a",
        shape=(3000,),
        dtype=torch.bfloat16,
        encoding=Encoding.ULP,
        indices=items[0].indices,
        values=_values(torch.bfloat16, items[0].count, rng, True),
    )
    raw = zstandard.ZstdDecompressor().decompress(encode_payload(H, items)[72:])
    catalog = {"a": items[0].spec}
    for _ in range(300):
        damaged = bytearray(raw)
        for pos in rng.integers(0, len(raw), int(rng.integers(1, 4))):
            damaged[pos] ^= int(rng.integers(1, 256))
        try:
            payload = decode_payload(payload2(bytes(damaged), 1), catalog=catalog)
        except PayloadRejected:
            continue
        for it in payload.items:
            it.validate()
            assert it.indices.max(initial=0) < math.prod(it.shape)


def test_shapes_beyond_int64_are_refused_whatever_the_limits() -> None:
    data = payload2(body2([T(shape=(2**32, 2**32))], [R()]), 1)
    assert reject(data).check == "shape"
    assert reject(data, limits=DecodeLimits(max_numel=2**70)).check == "shape"
