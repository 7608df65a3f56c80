"""Payload round trips: every dtype, shape, index set, encoding and value layout."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dcr.errors import ConfigError
from dcr.tensors.bits import DTYPE_CODES, numpy_bits_dtype
from dcr.tensors.ordered import ULP_DTYPES
from dcr.tensors.records import Encoding, Item, TensorSpec
from dcr.wire.decode import decode_payload, read_header
from dcr.wire.encode import encode_payload
from dcr.wire.format import HEADER_SIZE, PayloadHeader, ValueLayout

# Every test runs with the C kernels and with numpy only (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("both_paths")

# Bit patterns float comparisons get wrong or that sit at the edges of a word.
_SPECIAL: dict[int, list[int]] = {
    1: [0x00, 0x01, 0x7F, 0x80, 0xFF],
    2: [0x0000, 0x8000, 0x7FC0, 0x7FC1, 0x7F80, 0xFF80, 0x7C00, 0x7E00, 0x0001, 0x7FFF, 0xFFFF],
    4: [0, 0x80000000, 0x7FC00000, 0x7FC00001, 0x7F800000, 0xFF800000, 1, 0x7FFFFFFF, 2**32 - 1],
    8: [0, 1 << 63, 0x7FF8000000000000, 0x7FF0000000000000, 0xFFF0000000000000, 1, 2**64 - 1],
}
_DTYPES = sorted(DTYPE_CODES, key=DTYPE_CODES.__getitem__)


def _values(dtype: torch.dtype, n: int, rng: np.random.Generator) -> np.ndarray:
    np_dtype = numpy_bits_dtype(dtype)
    if dtype == torch.bool:
        return rng.integers(0, 1, n, dtype=np.uint8, endpoint=True)
    width = np.dtype(np_dtype).itemsize
    out = rng.integers(0, np.iinfo(np_dtype).max, n, dtype=np_dtype, endpoint=True)
    special = np.array(_SPECIAL[width], dtype=np_dtype)
    mask = rng.random(n) < 0.3
    out[mask] = special[rng.integers(0, special.shape[0], int(mask.sum()))]
    return out


def _indices(kind: str, numel: int, rng: np.random.Generator) -> np.ndarray:
    if numel == 0 or kind == "empty":
        return np.empty(0, dtype=np.int64)
    if kind == "single":
        return np.array([rng.integers(0, numel)], dtype=np.int64)
    if kind == "full":
        return np.arange(numel, dtype=np.int64)
    if kind == "run":
        start = int(rng.integers(0, numel))
        stop = int(rng.integers(start + 1, numel + 1))
        return np.arange(start, stop, dtype=np.int64)
    if numel > 1 << 20:  # far apart: gaps of u32/u64
        picks = rng.integers(0, numel, 20, dtype=np.int64)
        return np.unique(picks)
    density = {"scattered": 0.05, "dense": 0.9, "half": 0.5}[kind]
    return np.flatnonzero(rng.random(numel) < density).astype(np.int64)


@st.composite
def items(draw: st.DrawFn, name: str) -> Item:
    dtype = draw(st.sampled_from(_DTYPES))
    shape = draw(
        st.one_of(
            st.lists(st.integers(0, 7), min_size=0, max_size=4).map(tuple),
            st.tuples(st.integers(300, 70_000)),
            st.tuples(st.sampled_from([2**33, 2**40 + 3])),
        )
    )
    numel = math.prod(shape)
    kind = draw(st.sampled_from(["empty", "single", "full", "run", "scattered", "dense", "half"]))
    if numel > 1 << 20 and kind in ("full", "run", "dense", "half"):
        kind = "scattered"
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    indices = _indices(kind, numel, rng)
    return Item(
        name=name,
        shape=shape,
        dtype=dtype,
        encoding=draw(
            st.sampled_from(
                list(Encoding) if dtype in ULP_DTYPES else [Encoding.XOR, Encoding.OVERWRITE]
            )
        ),
        indices=indices,
        values=_values(dtype, indices.shape[0], rng),
    )


@st.composite
def payload_cases(draw: st.DrawFn) -> tuple[PayloadHeader, list[Item]]:
    names = draw(st.lists(st.text(min_size=1, max_size=12), max_size=6, unique=True))
    header = PayloadHeader(
        attempt=draw(st.integers(0, 2**64 - 1)),
        owner=draw(st.integers(0, 2**32 - 1)),
        payload_id=draw(st.integers(0, 2**32 - 1)),
        final=draw(st.booleans()),
    )
    return header, [draw(items(n)) for n in names]


def _assert_same(decoded: Item, item: Item) -> None:
    assert decoded.name == item.name
    assert decoded.shape == item.shape
    assert decoded.dtype == item.dtype
    assert decoded.encoding is item.encoding
    assert decoded.indices.dtype == np.int64
    assert decoded.indices.tolist() == item.indices.tolist()
    assert decoded.values.dtype == np.dtype(numpy_bits_dtype(item.dtype))
    assert decoded.values.tolist() == item.values.tolist()
    for array in (decoded.indices, decoded.values):
        # Copied out of the decompressed body: writable, not a view of received bytes.
        assert array.flags.writeable
        base = array
        while isinstance(base, np.ndarray) and base.base is not None:
            base = base.base
        assert not isinstance(base, bytes | memoryview)


def _v1_items(its: list[Item]) -> list[Item]:
    """``its`` with ULP items carried as XOR (version 1 has no ULP encoding)."""
    return [
        Item(
            name=it.name,
            shape=it.shape,
            dtype=it.dtype,
            encoding=Encoding.XOR if it.encoding is Encoding.ULP else it.encoding,
            indices=it.indices,
            values=it.values,
        )
        for it in its
    ]


@settings(max_examples=60, deadline=None)
@given(
    case=payload_cases(),
    layout=st.sampled_from(ValueLayout),
    level=st.sampled_from([1, 3]),
    version=st.sampled_from([1, 2]),
)
def test_round_trip(
    case: tuple[PayloadHeader, list[Item]], layout: ValueLayout, level: int, version: int
) -> None:
    header, its = case
    if version == 1:
        its = _v1_items(its)
    data = encode_payload(header, its, layout=layout, level=level, version=version)
    assert data[4:6] == bytes([version, 0])
    catalog = {it.name: it.spec for it in its}
    payload = decode_payload(data, catalog=catalog)
    got = payload.header
    assert got.key == header.key
    assert got.final == header.final
    assert got.layout is layout
    assert got.level == level
    assert got.n_items == len(its)
    assert got.compressed_bytes == len(data) - HEADER_SIZE
    assert read_header(data) == got
    assert len(payload.items) == len(its)
    for decoded, item in zip(payload.items, its, strict=True):
        _assert_same(decoded, item)
        decoded.validate()


def test_item_order_and_repeated_names_are_kept() -> None:
    its = [
        Item(
            name=n,
            shape=(10,),
            dtype=torch.float16,
            encoding=e,
            indices=np.array([i], dtype=np.int64),
            values=np.array([i], dtype=np.uint16),
        )
        for i, (n, e) in enumerate(
            [("b", Encoding.XOR), ("a", Encoding.OVERWRITE), ("b", Encoding.OVERWRITE)]
        )
    ]
    for layout, version in [(lay, v) for lay in ValueLayout for v in (1, 2)]:
        payload = decode_payload(
            encode_payload(
                PayloadHeader(attempt=1, owner=0, payload_id=0), its, layout=layout, version=version
            )
        )
        assert [(it.name, it.encoding, int(it.indices[0])) for it in payload.items] == [
            ("b", Encoding.XOR, 0),
            ("a", Encoding.OVERWRITE, 1),
            ("b", Encoding.OVERWRITE, 2),
        ]


def test_empty_payload_round_trips() -> None:
    header = PayloadHeader(attempt=9, owner=3, payload_id=1, final=True)
    for version in (1, 2):
        payload = decode_payload(encode_payload(header, [], version=version))
        assert len(payload.items) == 0 and list(payload.items) == []
        assert payload.header.final and payload.header.key == (9, 3, 1)


def test_encoding_is_deterministic() -> None:
    rng = np.random.default_rng(0)
    idx = np.unique(rng.integers(0, 10_000, 500)).astype(np.int64)
    item = Item(
        name="w",
        shape=(100, 100),
        dtype=torch.bfloat16,
        encoding=Encoding.XOR,
        indices=idx,
        values=rng.integers(0, 2**16, idx.shape[0], dtype=np.uint16),
    )
    header = PayloadHeader(attempt=1, owner=2, payload_id=3)
    for version in (1, 2):
        once = encode_payload(header, [item], version=version)
        assert once == encode_payload(header, [item], version=version)


def test_byte_planes_shrink_small_xor_masks() -> None:
    rng = np.random.default_rng(1)
    idx = np.unique(rng.integers(0, 1_000_000, 30_000)).astype(np.int64)
    masks = (1 << rng.integers(0, 4, idx.shape[0])).astype(np.uint16)  # low-bit flips
    item = Item(
        name="w",
        shape=(1_000_000,),
        dtype=torch.bfloat16,
        encoding=Encoding.XOR,
        indices=idx,
        values=masks,
    )
    header = PayloadHeader(attempt=1, owner=0, payload_id=0)
    plain = encode_payload(header, [item], layout=ValueLayout.PLAIN, version=1)
    planes = encode_payload(header, [item], layout=ValueLayout.BYTEPLANE, version=1)
    assert len(planes) < 0.9 * len(plain)
    # Version 2 Rice-codes the locations in both layouts; planes still shrink the masks.
    plain = encode_payload(header, [item], layout=ValueLayout.PLAIN)
    planes = encode_payload(header, [item], layout=ValueLayout.BYTEPLANE)
    assert len(planes) < 0.95 * len(plain)


def _item(**kw: object) -> Item:
    base: dict[str, object] = {
        "name": "w",
        "shape": (4,),
        "dtype": torch.bfloat16,
        "encoding": Encoding.XOR,
        "indices": np.array([0, 2], dtype=np.int64),
        "values": np.array([1, 2], dtype=np.uint16),
    }
    base.update(kw)
    return Item(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "bad",
    [
        {"indices": np.array([2, 0], dtype=np.int64)},
        {"indices": np.array([1, 1], dtype=np.int64)},
        {"indices": np.array([0, 4], dtype=np.int64)},
        {"indices": np.array([-1, 2], dtype=np.int64)},
        {"indices": np.array([0, 2], dtype=np.int32)},
        {"values": np.array([1, 2], dtype=np.uint32)},
        {"values": np.array([1], dtype=np.uint16)},
        {"name": ""},
        {"name": "x" * 70_000},
        {"name": "bad\udc80"},
        {"encoding": 5},
    ],
)
def test_encode_rejects_bad_items(bad: dict[str, object]) -> None:
    for version in (1, 2):
        with pytest.raises(ConfigError):
            encode_payload(
                PayloadHeader(attempt=0, owner=0, payload_id=0),
                [_item(), _item(**bad)],
                version=version,
            )


def test_ulp_items_need_a_float_dtype_and_version_2() -> None:
    header = PayloadHeader(attempt=0, owner=0, payload_id=0)
    ulp = _item(encoding=Encoding.ULP)
    encode_payload(header, [ulp])
    with pytest.raises(ConfigError) as err:
        encode_payload(header, [ulp], version=1)
    assert err.value.check == "encoding"
    with pytest.raises(ConfigError) as err:
        encode_payload(
            header,
            [_item(encoding=Encoding.ULP, dtype=torch.int16)],
        )
    assert err.value.check == "encoding"


def test_one_name_with_two_specs_is_refused() -> None:
    with pytest.raises(ConfigError) as err:
        encode_payload(
            PayloadHeader(attempt=0, owner=0, payload_id=0),
            [_item(), _item(shape=(8,), encoding=Encoding.OVERWRITE)],
        )
    assert err.value.check == "name"


@pytest.mark.parametrize("kw", [{"level": 23}, {"layout": 7}, {"version": 4}, {"version": 0}])
def test_encode_rejects_bad_options(kw: dict[str, int]) -> None:
    with pytest.raises(ConfigError):
        encode_payload(PayloadHeader(attempt=0, owner=0, payload_id=0), [_item()], **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kw", [{"attempt": -1}, {"attempt": 2**64}, {"owner": 2**32}, {"payload_id": -1}]
)
def test_header_ids_must_fit_their_fields(kw: dict[str, int]) -> None:
    ids = {"attempt": 0, "owner": 0, "payload_id": 0} | kw
    with pytest.raises(ConfigError):
        PayloadHeader(**ids)


def test_header_order_is_payload_id_then_owner() -> None:
    headers = [PayloadHeader(attempt=1, owner=o, payload_id=p) for o, p in [(2, 0), (1, 1), (0, 1)]]
    assert [h.order for h in sorted(headers, key=lambda h: h.order)] == [(0, 2), (1, 0), (1, 1)]


@pytest.mark.heavy
def test_ten_million_entries_round_trip_quickly() -> None:
    rng = np.random.default_rng(0)
    n = 10_000_000
    idx = np.cumsum(rng.integers(1, 300, n))  # u16 gaps
    numel = int(idx[-1]) + 1
    masks = (1 << rng.integers(0, 8, n)).astype(np.uint16)
    item = Item(
        name="w",
        shape=(numel,),
        dtype=torch.bfloat16,
        encoding=Encoding.XOR,
        indices=idx,
        values=masks,
    )
    header = PayloadHeader(attempt=0, owner=0, payload_id=0)
    spec = {"w": TensorSpec(name="w", shape=(numel,), dtype=torch.bfloat16)}
    start = time.perf_counter()
    payload = decode_payload(encode_payload(header, [item]), catalog=spec)
    elapsed = time.perf_counter() - start
    assert np.array_equal(payload.items[0].indices, idx)
    assert np.array_equal(payload.items[0].values, masks)
    assert elapsed < 5.0


@pytest.mark.parametrize("version", [1, 2])
def test_decoded_items_are_marked_verified_and_items_built_in_memory_are_not(version: int) -> None:
    """The decoder checks every index (increasing, in bounds): receivers may trust its items;
    items built anywhere else carry ``verified=False`` and are scanned again."""
    item = Item(
        name="w",
        shape=(100,),
        dtype=torch.bfloat16,
        encoding=Encoding.OVERWRITE,
        indices=np.array([1, 5, 9], np.int64),
        values=np.array([1, 2, 3], np.uint16),
    )
    assert not item.verified
    data = encode_payload(PayloadHeader(attempt=1, owner=0, payload_id=0), [item], version=version)
    decoded = decode_payload(data).items
    assert [it.verified for it in decoded] == [True]
    from dcr.wire.format import Items

    assert [it.verified for it in Items.of([item])] == [False]
