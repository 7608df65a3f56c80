"""Payload format version 3: item records carry their last index, and strided row spans travel
as ROWS locations (period and gap, no index per entry) and decode back to spans.

The documented bytes, round trips of every location kind and encoding, the overlap check on
rows, and a rejection, with the right ``check``, of every record field version 3 adds.
Corrupted payloads are valid encodings whose decompressed body is patched at the record
offsets of ``docs/wire-format.md``, then recompressed and sealed with a fresh digest, so the
digest check passes and the record checks are what reject them.
"""

from __future__ import annotations

import hashlib
import struct

import blake3
import numpy as np
import pytest
import torch
import zstandard

from dcr.errors import PayloadRejected
from dcr.tensors.bits import numpy_bits_dtype
from dcr.tensors.records import Encoding, Item, Span, TensorSpec
from dcr.wire.decode import decode_payload
from dcr.wire.encode import encode_bucket, encode_payload
from dcr.wire.format import (
    FORMAT_VERSION,
    SUPPORTED_VERSIONS,
    Items,
    PayloadHeader,
    ValueLayout,
)

# Every test runs with the C kernels and with numpy only (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("both_paths")

ATTEMPT = 13
H = PayloadHeader(attempt=ATTEMPT, owner=2, payload_id=5, final=True)
_HEADER = struct.Struct("<4sHHQIIBBHiIIQQ")  # docs: header fields before the digest
_PRE = struct.Struct("<IIQQQ")  # docs: version 2 and 3 preamble
_TENSOR = struct.Struct("<HBB")  # docs: fixed part of a tensor list entry
_RECORD_V3 = struct.Struct("<IBBBBQQQQQ")  # docs: version 3 item record, 48 bytes
_V1_PRE = 24  # docs: version 1 preamble
# docs, "Item records (version 3)": field -> (offset, struct format)
FIELDS = {
    "kind": (5, "<B"),
    "count": (8, "<Q"),
    "start": (16, "<Q"),
    "last": (24, "<Q"),
    "period": (32, "<Q"),
    "gap": (40, "<Q"),
}
RUN, RICE, ROWS = 0, 5, 6
BF16, F32 = 1, 3


# ------------------------------------------------------------------------------------------
# Forging: a valid payload, its decompressed body patched, recompressed and resealed


def body_of(data: bytes) -> bytes:
    return zstandard.ZstdDecompressor().decompress(data[72:])


def reseal(data: bytes, raw: bytes) -> bytes:
    """``data``'s header around the body ``raw``: lengths updated, zstd level 1 with the
    content size stated, a fresh digest of the function the flags select."""
    fields = list(_HEADER.unpack_from(data))
    compressed = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(raw)
    fields[-2], fields[-1] = len(raw), len(compressed)
    fixed = _HEADER.pack(*fields)
    if fields[2] & 0x0002:
        digest = blake3.blake3(fixed + compressed).digest()[:16]
    else:
        digest = hashlib.blake2b(fixed + compressed, digest_size=16).digest()
    return fixed + digest + compressed


def record_at(raw: bytes, item: int, size: int = 48) -> int:
    """Body offset of record ``item`` (version 2: ``size=24``)."""
    (tensor_bytes,) = struct.unpack_from("<Q", raw, 8)
    return _PRE.size + int(tensor_bytes) + item * size


def patch(data: bytes, item: int, **values: int) -> bytes:
    """``data`` (version 3) with fields of record ``item`` replaced."""
    raw = bytearray(body_of(data))
    at = record_at(bytes(raw), item)
    for field, value in values.items():
        offset, fmt = FIELDS[field]
        struct.pack_into(fmt, raw, at + offset, value)
    return reseal(data, bytes(raw))


def record(data: bytes, item: int) -> dict[str, int]:
    raw = body_of(data)
    at = record_at(raw, item)
    return {f: struct.unpack_from(fmt, raw, at + off)[0] for f, (off, fmt) in FIELDS.items()}


def refusal(data: bytes, **kw: object) -> PayloadRejected:
    with pytest.raises(PayloadRejected) as err:
        decode_payload(data, **kw)  # type: ignore[arg-type]
    assert err.value.attempt == ATTEMPT
    return err.value


# ------------------------------------------------------------------------------------------
# Items


def words(dtype: torch.dtype, n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    bits = np.dtype(numpy_bits_dtype(dtype))
    if dtype == torch.bool:
        return rng.integers(0, 2, n).astype(bits)
    return rng.integers(0, 1 << (8 * bits.itemsize), n, dtype=np.uint64).astype(bits)


def span_item(
    span: Span,
    count: int,
    *,
    name: str = "w",
    shape: tuple[int, ...] = (64, 48),
    dtype: torch.dtype = torch.bfloat16,
    encoding: Encoding = Encoding.OVERWRITE,
    seed: int = 0,
) -> Item:
    return Item(
        name=name,
        shape=shape,
        dtype=dtype,
        encoding=encoding,
        span=span,
        values=words(dtype, count, seed),
    )


def listed_item(
    indices: list[int] | np.ndarray,
    *,
    name: str = "w",
    shape: tuple[int, ...] = (64, 48),
    dtype: torch.dtype = torch.bfloat16,
    encoding: Encoding = Encoding.OVERWRITE,
    seed: int = 0,
) -> Item:
    idx = np.asarray(indices, dtype=np.int64)
    return Item(
        name=name,
        shape=shape,
        dtype=dtype,
        encoding=encoding,
        indices=idx,
        values=words(dtype, int(idx.shape[0]), seed),
    )


def same(decoded: Item, item: Item) -> None:
    """``decoded`` carries exactly ``item``'s entries."""
    assert (decoded.name, decoded.shape, decoded.dtype) == (item.name, item.shape, item.dtype)
    assert decoded.encoding is item.encoding
    assert decoded.count == item.count
    assert decoded.values.dtype == item.values.dtype
    assert np.array_equal(decoded.indices, item.indices)
    assert np.array_equal(decoded.values, item.values)
    assert decoded.verified


# Row spans of a [64, 48] tensor (numel 3072): (span, count)
ROW_SPANS = {
    "period 1 gap 1": (Span(1, 1, 1), 1000),
    "period 3 gap 5 partial last row": (Span(2, 3, 5), 301),
    "column block of 16 of 48": (Span(16, 16, 32), 64 * 16),
    "column block, partial last row": (Span(32, 16, 32), 63 * 16 + 5),
    "two rows exactly": (Span(100, 7, 1000), 14),
    "gap 1 every other element": (Span(0, 1, 1), 1536),
    "last row ends at the last element": (Span(40, 8, 40), 64 * 8),
}


def test_version_3_is_the_default() -> None:
    assert FORMAT_VERSION == 3
    assert SUPPORTED_VERSIONS == (1, 2, 3)
    span, count = ROW_SPANS["column block of 16 of 48"]
    data = encode_payload(H, [span_item(span, count)])
    assert struct.unpack_from("<H", data, 4)[0] == 3
    bucket = encode_bucket(
        items=[span_item(span, count)], attempt=ATTEMPT, owner=2, payload_id=5, final=True
    )
    assert struct.unpack_from("<H", bucket, 4)[0] == 3
    assert bucket == data


# ------------------------------------------------------------------------------------------
# The documented bytes


def _example() -> list[Item]:
    return [
        Item(
            name="A",
            shape=(4, 8),
            dtype=torch.bfloat16,
            encoding=Encoding.OVERWRITE,
            span=Span(2, 3, 5),
            values=np.arange(1, 8, dtype=np.uint16),
        ),
        Item(
            name="B",
            shape=(10,),
            dtype=torch.float32,
            encoding=Encoding.XOR,
            indices=np.array([2, 5, 8], dtype=np.int64),
            values=np.array([0x3F800000, 0x7FC00000, 0x80000000], dtype=np.uint32),
        ),
    ]


def test_worked_example_matches_the_encoder() -> None:
    """docs/wire-format.md, version 3 worked example, byte for byte."""

    def tensor(name: bytes, dtype: int, shape: tuple[int, ...]) -> bytes:
        return (
            _TENSOR.pack(len(name), dtype, len(shape))
            + struct.pack(f"<{len(shape)}Q", *shape)
            + name
        )

    tensors = tensor(b"A", BF16, (4, 8)) + tensor(b"B", F32, (10,))
    head = (
        _PRE.pack(2, 0, len(tensors), 0, 0)
        + tensors
        + _RECORD_V3.pack(0, 1, ROWS, 0, 0, 7, 2, 18, 3, 5)
        + _RECORD_V3.pack(1, 0, RICE, 0, 0, 3, 2, 8, 0, 0)
        + bytes([2, 2])  # B's gaps 2, 2 (k = 0)
    )
    a_words = np.arange(1, 8, dtype="<u2").tobytes()
    b_words = np.array([0x3F800000, 0x7FC00000, 0x80000000], dtype="<u4").tobytes()
    expected = {
        ValueLayout.PLAIN: head + a_words + b_words,
        ValueLayout.BYTEPLANE: head
        + bytes([1, 2, 3, 4, 5, 6, 7, 0, 0, 0, 0, 0, 0, 0])
        + bytes([0, 0, 0, 0, 0, 0, 0x80, 0xC0, 0, 0x3F, 0x7F, 0x80]),
    }
    assert len(expected[ValueLayout.PLAIN]) == 190
    for layout in ValueLayout:
        data = encode_payload(
            PayloadHeader(attempt=7, owner=1, payload_id=0, final=True), _example(), layout=layout
        )
        raw = body_of(data)
        assert raw == expected[layout]
        assert data[:56] == _HEADER.pack(
            b"DCRP", 3, 3, 7, 1, 0, 1, int(layout), 0, 1, 2, 0, 190, len(data) - 72
        )
        assert data[56:72] == blake3.blake3(data[:56] + data[72:]).digest()[:16]
        a, b = decode_payload(data).items
        assert a.span == Span(2, 3, 5) and a.listed is None
        assert a.indices.tolist() == [2, 3, 4, 10, 11, 12, 18]
        assert a.values.tolist() == [1, 2, 3, 4, 5, 6, 7]
        assert b.span is None and b.indices.tolist() == [2, 5, 8]


# ------------------------------------------------------------------------------------------
# Round trips


@pytest.mark.parametrize("layout", list(ValueLayout))
@pytest.mark.parametrize("case", list(ROW_SPANS))
def test_row_spans_round_trip_as_spans(case: str, layout: ValueLayout) -> None:
    span, count = ROW_SPANS[case]
    item = span_item(span, count)
    assert item.bounds[1] < 64 * 48
    data = encode_payload(H, [item], layout=layout)
    assert record(data, 0) == {
        "kind": ROWS,
        "count": count,
        "start": span.start,
        "last": span.index(count - 1),
        "period": span.period,
        "gap": span.gap,
    }
    (decoded,) = decode_payload(data).items
    same(decoded, item)
    assert decoded.span == span
    assert decoded.listed is None


def test_a_rows_item_adds_nothing_to_the_location_streams() -> None:
    span, count = ROW_SPANS["column block, partial last row"]
    item = span_item(span, count)
    data = encode_payload(H, [item], layout=ValueLayout.PLAIN)
    raw = body_of(data)
    # preamble, the tensor list, one record, then only the values (no gap symbols).
    assert len(raw) == record_at(raw, 1) + 2 * count
    assert raw[record_at(raw, 1) :] == item.values.astype("<u2").tobytes()
    assert struct.unpack_from("<QQ", raw, 16) == (0, 0)  # no escapes
    payload = decode_payload(data)
    assert isinstance(payload.items, Items)
    assert payload.items.indices.shape == (0,)  # no index array held
    assert payload.items[0].listed is None
    # Version 2 lists the same item's gaps, one symbol per entry, and decodes it listed.
    v2 = encode_payload(H, [item], layout=ValueLayout.PLAIN, version=2)
    assert len(body_of(v2)) == len(raw) - 24 + (count - 1)
    (listed,) = decode_payload(v2).items
    same(listed, item)
    assert listed.span is None and listed.listed is not None


@pytest.mark.parametrize("layout", list(ValueLayout))
@pytest.mark.parametrize(
    ("dtype", "encoding"),
    [
        (torch.bfloat16, Encoding.XOR),
        (torch.bfloat16, Encoding.OVERWRITE),
        (torch.bfloat16, Encoding.ULP),
        (torch.float32, Encoding.ULP),
        (torch.float64, Encoding.XOR),
        (torch.int8, Encoding.OVERWRITE),
        (torch.bool, Encoding.OVERWRITE),
    ],
)
def test_every_kind_and_encoding_round_trips(
    dtype: torch.dtype, encoding: Encoding, layout: ValueLayout
) -> None:
    """Listed indices (Rice and contiguous), runs, row spans of several shapes (and a span of
    one row, which travels as a run), one entry and none, in one payload."""
    rng = np.random.default_rng(3)
    rice = np.sort(rng.choice(3072, 200, replace=False))

    def listed(indices: list[int] | np.ndarray, name: str) -> Item:
        return listed_item(indices, name=name, dtype=dtype, encoding=encoding)

    def spanned(span: Span, count: int, name: str) -> Item:
        return span_item(span, count, name=name, dtype=dtype, encoding=encoding)

    items = [
        listed(rice, "rice"),
        listed(np.arange(17, 90), "contiguous"),
        spanned(Span(5), 700, "run"),
        spanned(Span(16, 16, 32), 64 * 16, "rows"),
        spanned(Span(2, 3, 5), 301, "partial"),
        spanned(Span(48 * 5 + 8, 16, 32), 12, "one row"),
        listed([3071], "one"),
        listed([], "empty"),
    ]
    data = encode_payload(H, items, layout=layout)
    kinds = [record(data, i)["kind"] for i in range(len(items))]
    assert kinds == [RICE, RUN, RUN, ROWS, ROWS, RUN, RUN, RUN]
    lasts = [record(data, i)["last"] for i in range(len(items))]
    assert lasts == [int(rice[-1]), 89, 704, 16 + 1023 + 63 * 32, 2 + 300 + 100 * 5, 259, 3071, 0]
    decoded = decode_payload(data).items
    assert len(decoded) == len(items)
    for got, item in zip(decoded, items, strict=True):
        same(got, item)
    spans = [None if it.span is None else (it.span, it.listed) for it in decoded]
    assert spans[0] is None and decoded[0].listed is not None
    assert spans[1] == (Span(17), None)
    assert spans[2] == (Span(5), None)
    assert spans[3] == (Span(16, 16, 32), None)
    assert spans[4] == (Span(2, 3, 5), None)
    assert spans[5] == (Span(48 * 5 + 8), None)
    assert spans[6] == (Span(3071), None)
    assert spans[7] == (Span(0), None)
    # The compact index array holds the Rice item's positions only.
    assert isinstance(decoded, Items)
    assert np.array_equal(decoded.indices, rice)
    # The same items through encode_bucket, and still decodable in versions 1 and 2.
    bucket = encode_bucket(
        items=items, attempt=ATTEMPT, owner=2, payload_id=5, final=True, layout=layout
    )
    assert bucket == data
    for version in (1, 2):
        if version == 1 and encoding is Encoding.ULP:
            continue
        old = encode_payload(H, items, layout=layout, version=version)
        assert struct.unpack_from("<H", old, 4)[0] == version
        back = decode_payload(old).items
        for got, item in zip(back, items, strict=True):
            same(got, item)
        assert back[3].span is None and back[3].listed is not None


def test_rows_decode_against_a_catalog() -> None:
    span, count = ROW_SPANS["column block of 16 of 48"]
    item = span_item(span, count, encoding=Encoding.XOR)
    catalog = {"w": TensorSpec(name="w", shape=(64, 48), dtype=torch.bfloat16)}
    data = encode_payload(H, [item])
    (decoded,) = decode_payload(data, catalog=catalog, xor_allowed={"w"}).items
    same(decoded, item)
    assert decoded.span == span
    assert refusal(data, catalog=catalog, xor_allowed=set()).check == "classification"


# ------------------------------------------------------------------------------------------
# Items of one tensor never share a position, rows included


def _interleaved(parts: int, rows: int = 64, cols: int = 48) -> list[Item]:
    """Each column block of a [rows, cols] tensor as one row span (one per training rank)."""
    period = cols // parts
    return [
        span_item(
            Span(k * period, period, cols - period),
            rows * period,
            shape=(rows, cols),
            encoding=Encoding.OVERWRITE,
            seed=k,
        )
        for k in range(parts)
    ]


@pytest.mark.parametrize("parts", [2, 3, 4])
def test_interleaved_row_spans_of_one_tensor_decode(parts: int) -> None:
    items = _interleaved(parts)
    decoded = decode_payload(encode_payload(H, items)).items
    for got, item in zip(decoded, items, strict=True):
        same(got, item)
        assert got.span == item.span and got.listed is None
    union = np.sort(np.concatenate([it.indices for it in decoded]))
    assert np.array_equal(union, np.arange(64 * 48))


@pytest.mark.parametrize(
    "other",
    [
        "rows shifted by one",
        "listed index in a row",
        "run across a row",
        "run in a late row",
        "rows of another period",
    ],
)
def test_rows_sharing_a_position_are_refused(other: str) -> None:
    rows = span_item(Span(16, 16, 32), 64 * 16)
    second = {
        "rows shifted by one": span_item(Span(31, 16, 32), 60 * 16, encoding=Encoding.XOR),
        "listed index in a row": listed_item([0, 1, 2, 48 * 10 + 20], encoding=Encoding.XOR),
        "run across a row": span_item(Span(48 * 3 + 10), 7, encoding=Encoding.XOR),
        # past start + count: only the rows' real last index shows that the two meet
        "run in a late row": span_item(Span(48 * 40 + 20), 3, encoding=Encoding.XOR),
        "rows of another period": span_item(Span(0, 17, 31), 17 * 10, encoding=Encoding.XOR),
    }[other]
    shared = set(rows.indices.tolist()) & set(second.indices.tolist())
    assert shared
    for items in ([rows, second], [second, rows]):
        err = refusal(encode_payload(H, items))
        assert err.check == "overlap" and err.tensor == "w"


@pytest.mark.parametrize(
    "other",
    ["rows in the gaps", "listed in the gaps", "run in a gap", "rows of another period"],
)
def test_rows_beside_other_items_of_their_tensor_decode(other: str) -> None:
    rows = span_item(Span(16, 16, 32), 64 * 16)
    second = {
        "rows in the gaps": span_item(Span(32, 16, 32), 63 * 16 + 16, encoding=Encoding.XOR),
        "listed in the gaps": listed_item([0, 15, 32, 47, 48 * 63 + 47], encoding=Encoding.XOR),
        "run in a gap": span_item(Span(48 * 3 + 32), 32, encoding=Encoding.XOR),
        "rows of another period": span_item(Span(0, 8, 40), 8 * 64, encoding=Encoding.XOR),
    }[other]
    assert not set(rows.indices.tolist()) & set(second.indices.tolist())
    items = [rows, second]
    decoded = decode_payload(encode_payload(H, items)).items
    for got, item in zip(decoded, items, strict=True):
        same(got, item)


# ------------------------------------------------------------------------------------------
# Corrupted records


def _rows_payload() -> bytes:
    span, count = ROW_SPANS["column block, partial last row"]  # [64, 48], numel 3072
    return encode_payload(H, [listed_item([1, 5, 9, 700], name="r"), span_item(span, count)])


def test_the_base_payload_decodes_and_resealing_keeps_it() -> None:
    data = _rows_payload()
    assert record(data, 1) == {
        "kind": ROWS,
        "count": 63 * 16 + 5,
        "start": 32,
        "last": 32 + 63 * 16 + 4 + 63 * 32,
        "period": 16,
        "gap": 32,
    }
    again = reseal(data, body_of(data))
    a, b = decode_payload(again).items
    assert a.indices.tolist() == [1, 5, 9, 700]
    assert b.span == Span(32, 16, 32) and b.listed is None
    # An unchanged patch is the same payload.
    assert patch(data, 1, last=record(data, 1)["last"]) == again


_LAST = 32 + (63 * 16 + 4) + 63 * 32  # the rows item's: start + (count - 1) + 63 gaps
_CORRUPT: dict[str, tuple[int, dict[str, int], str, str]] = {
    # name: (item, fields, check, message fragment)
    "rows period 0": (1, {"period": 0}, "schema", "period 0"),
    "rows gap 0": (1, {"gap": 0}, "schema", "gap 0"),
    "rows last one too far": (1, {"last": _LAST + 1}, "schema", "disagrees with the rows"),
    "rows last one short": (1, {"last": _LAST - 1}, "schema", "disagrees with the rows"),
    "rows last of a run": (1, {"last": 32 + 63 * 16 + 4}, "schema", "disagrees with the rows"),
    "rows last below start": (1, {"last": 0}, "schema", "disagrees with the rows"),
    "rows period changed": (1, {"period": 15}, "schema", "disagrees with the rows"),
    "rows gap changed": (1, {"gap": 31}, "schema", "disagrees with the rows"),
    "rows reach past the tensor": (
        1,
        {"start": 32 + 28, "last": _LAST + 28},
        "bounds",
        "past the tensor",
    ),
    "rows start past the tensor": (
        1,
        {"start": 3072, "last": _LAST - 32 + 3072},
        "bounds",
        "outside the tensor",
    ),
    "rows start near 2**64": (1, {"start": 2**64 - 5}, "bounds", "outside the tensor"),
    "rows last near 2**64": (1, {"last": 2**64 - 1}, "schema", "disagrees with the rows"),
    "rows gap of 2**63": (1, {"gap": 2**63, "last": 2**63}, "bounds", "gap exceeds"),
    "rows without entries": (1, {"count": 0, "start": 0, "last": 0}, "schema", "without entries"),
    "rice last disagrees": (0, {"last": 699}, "schema", "decoded positions"),
    "rice last past the tensor": (0, {"last": 3072}, "schema", "decoded positions"),
    "rice with a period": (0, {"period": 4}, "schema", "a period without ROWS"),
    "rice with a gap": (0, {"gap": 4}, "schema", "a gap without ROWS"),
    "kind 7": (1, {"kind": 7}, "encoding", "unknown location kind"),
    "rows as a run": (1, {"kind": RUN}, "schema", "a period without ROWS"),
    "rows as a run, no period or gap": (
        1,
        {"kind": RUN, "period": 0, "gap": 0},
        "schema",
        "disagrees with the run",
    ),
}


@pytest.mark.parametrize("case", list(_CORRUPT))
def test_corrupted_records_are_refused(case: str) -> None:
    item, fields, check, fragment = _CORRUPT[case]
    err = refusal(patch(_rows_payload(), item, **fields))
    assert err.check == check, err
    assert fragment in str(err), err
    assert err.tensor == ("r" if item == 0 else "w"), err


def test_a_single_row_with_a_gap_beyond_the_tensor_is_refused() -> None:
    # A ROWS record of one row is valid (an encoder may write it) ...
    data = encode_payload(H, [span_item(Span(16, 16, 32), 16)])
    assert record(data, 0)["kind"] == RUN
    rows = patch(data, 0, kind=ROWS, period=16, gap=32)
    (decoded,) = decode_payload(rows).items
    assert decoded.span == Span(16, 16, 32) and decoded.indices.tolist() == list(range(16, 32))
    # ... but its period and gap stay inside the tensor.
    err = refusal(patch(data, 0, kind=ROWS, period=16, gap=3072))
    assert (err.check, "gap exceeds" in str(err)) == ("bounds", True)
    err = refusal(patch(data, 0, kind=ROWS, period=3073, gap=1))
    assert (err.check, "period exceeds" in str(err)) == ("bounds", True)


@pytest.mark.parametrize(
    ("fields", "check", "fragment"),
    [
        ({"last": 31}, "schema", "disagrees with the run"),
        ({"last": 33}, "schema", "disagrees with the run"),
        ({"period": 16}, "schema", "a period without ROWS"),
        ({"gap": 1}, "schema", "a gap without ROWS"),
    ],
)
def test_a_run_whose_record_disagrees_is_refused(
    fields: dict[str, int], check: str, fragment: str
) -> None:
    data = encode_payload(H, [span_item(Span(16), 17)])
    assert record(data, 0) == {
        "kind": RUN, "count": 17, "start": 16, "last": 32, "period": 0, "gap": 0
    }  # fmt: skip
    err = refusal(patch(data, 0, **fields))
    assert (err.check, fragment in str(err)) == (check, True), err


def test_an_empty_item_states_last_0() -> None:
    data = encode_payload(H, [listed_item([]), listed_item([4], name="x")])
    assert record(data, 0)["last"] == 0
    decode_payload(data)
    err = refusal(patch(data, 0, last=1))
    assert (err.check, "empty item" in str(err)) == ("schema", True)


# ------------------------------------------------------------------------------------------
# Earlier versions


def test_version_1_and_2_payloads_still_decode_as_before() -> None:
    items = [
        listed_item([1, 5, 9, 700], name="r"),
        span_item(Span(16, 16, 32), 64 * 16),
        span_item(Span(5), 300, name="run"),
    ]
    for version in (1, 2):
        data = encode_payload(H, items, version=version)
        assert struct.unpack_from("<H", data, 4)[0] == version
        decoded = decode_payload(data).items
        for got, item in zip(decoded, items, strict=True):
            same(got, item)
        # Without ROWS, strided rows come back listed; runs stay runs.
        assert decoded[1].span is None and decoded[1].listed is not None
        assert decoded[2].span == Span(5)
    # Version 2 bytes are unchanged: 24-byte records, the rows' gaps Rice-coded.
    raw = body_of(encode_payload(H, items, version=2))
    at = record_at(raw, 1, size=24)
    kind, count, start = struct.unpack_from("<xxxxxBxxQQ", raw, at)
    assert (kind, count, start) == (RICE, 64 * 16, 16)


def test_version_2_refuses_rows() -> None:
    """Kind 6 is version 3's: a version 2 record naming it is refused, as is version 1's."""
    items = [span_item(Span(16, 16, 32), 64 * 16)]
    data = encode_payload(H, [span_item(Span(16), 64 * 16)], version=2)
    raw = bytearray(body_of(data))
    struct.pack_into("<B", raw, record_at(bytes(raw), 0, size=24) + 5, ROWS)
    err = refusal(reseal(data, bytes(raw)))
    assert (err.check, "unknown location kind" in str(err)) == ("encoding", True)
    # A version 3 body relabelled as version 2 is refused too (its records are 48 bytes).
    v3 = encode_payload(H, items)
    fields = list(_HEADER.unpack_from(v3))
    fields[1] = 2
    err = refusal(reseal(_HEADER.pack(*fields) + v3[56:], body_of(v3)))
    assert (err.check, "unknown location kind" in str(err)) == ("encoding", True)
    # Version 1: an entry of location kind 6 (offset 4 of the entry, after the 24-byte preamble).
    v1 = encode_payload(H, [span_item(Span(16), 64 * 16)], version=1)
    raw = bytearray(body_of(v1))
    struct.pack_into("<B", raw, _V1_PRE + 4, ROWS)
    err = refusal(reseal(v1, bytes(raw)))
    assert (err.check, "unknown location kind" in str(err)) == ("encoding", True)
