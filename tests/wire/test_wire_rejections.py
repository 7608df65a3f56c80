"""The strict decoder on format version 1: every check rejects what it should, with the right
``check`` name.

Bodies for the structural checks are built here by hand from ``docs/wire-format.md`` and sealed
with a fresh digest, so the digest check passes and the structural checks are what reject them.
"""

from __future__ import annotations

import hashlib
import struct
import tracemalloc
from functools import cache

import blake3
import numpy as np
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcr.errors import ConfigError, PayloadRejected
from dcr.tensors.records import Encoding, Item, TensorSpec
from dcr.wire.decode import decode_payload, read_header
from dcr.wire.encode import encode_payload
from dcr.wire.format import FLAG_BLAKE3, DecodeLimits, Payload, PayloadHeader, ValueLayout

# Every test runs with the C kernels and with numpy only (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("both_paths")

ATTEMPT = 5
_HEADER = struct.Struct("<4sHHQIIBBHiIIQQ")  # docs: header fields before the digest
_ENTRY = struct.Struct("<HBBBBQQQ")  # docs: fixed part of an item table entry
BF16, F32, BOOL = 1, 3, 10  # docs: dtype codes
RUN, GAPS_U8, GAPS_U64 = 0, 1, 4  # docs: location kinds
XOR, OVERWRITE = 0, 1


def seal(
    compressed: bytes,
    *,
    body_bytes: int,
    n_items: int,
    layout: int = 0,
    flags: int = 0,
    codec: int = 1,
    version: int = 1,
    reserved16: int = 0,
    reserved32: int = 0,
) -> bytes:
    """A payload around ``compressed`` with a correct BLAKE2b-128 digest."""
    fixed = _HEADER.pack(
        b"DCRP",
        version,
        flags,
        ATTEMPT,
        2,
        3,
        codec,
        layout,
        reserved16,
        1,
        n_items,
        reserved32,
        body_bytes,
        len(compressed),
    )
    return fixed + hashlib.blake2b(fixed + compressed, digest_size=16).digest() + compressed


def entry(
    name: bytes | str,
    *,
    dtype: int = BF16,
    encoding: int = XOR,
    kind: int = RUN,
    shape: tuple[int, ...] = (8,),
    count: int = 0,
    location: int = 0,
    value: int = 0,
    name_len: int | None = None,
) -> bytes:
    raw = name.encode() if isinstance(name, str) else name
    n = len(raw) if name_len is None else name_len
    fixed = _ENTRY.pack(n, dtype, encoding, kind, len(shape), count, location, value)
    return fixed + struct.pack(f"<{len(shape)}Q", *shape) + raw


def body(
    entries: list[bytes],
    locations: bytes = b"",
    values: bytes = b"",
    *,
    lengths: tuple[int, int, int] | None = None,
) -> bytes:
    table = b"".join(entries)
    t, lo, v = lengths or (len(table), len(locations), len(values))
    return struct.pack("<QQQ", t, lo, v) + table + locations + values


def payload_of(raw_body: bytes, n_items: int, **kw: int) -> bytes:
    compressed = zstandard.ZstdCompressor(level=1).compress(raw_body)
    return seal(compressed, body_bytes=len(raw_body), n_items=n_items, **kw)


def words(values: list[int], dtype: str) -> bytes:
    return np.array(values, dtype=dtype).tobytes()


def reject(data: bytes, **kw: object) -> PayloadRejected:
    with pytest.raises(PayloadRejected) as err:
        decode_payload(data, **kw)  # type: ignore[arg-type]
    return err.value


def _items() -> list[Item]:
    rng = np.random.default_rng(3)
    scattered = np.array([1, 5, 6, 300, 1000, 4095], dtype=np.int64)
    return [
        Item(
            name="model.layers.0.mlp.up_proj.weight",
            shape=(64, 64),
            dtype=torch.bfloat16,
            encoding=Encoding.XOR,
            indices=scattered,
            values=rng.integers(0, 2**16, 6, dtype=np.uint16),
        ),
        Item(
            name="model.norm.weight",
            shape=(64,),
            dtype=torch.float32,
            encoding=Encoding.OVERWRITE,
            indices=np.arange(10, 20, dtype=np.int64),
            values=rng.integers(0, 2**32, 10, dtype=np.uint32),
        ),
    ]


CATALOG = {it.name: it.spec for it in _items()}
VALID = {
    layout: encode_payload(
        PayloadHeader(attempt=ATTEMPT, owner=2, payload_id=3, final=True),
        _items(),
        layout=layout,
        version=1,
    )
    for layout in ValueLayout
}
"""Version 1 payloads (this file checks version 1; ``test_wire_v2.py`` checks version 2)."""


# ------------------------------------------------------------------------------------------
# The documented format


def test_hand_built_body_matches_the_encoder() -> None:
    """The byte-by-byte description in docs/wire-format.md is what the encoder writes."""
    a, b = _items()
    gaps = words([1, 3, 0, 293, 699, 3094], "<u2")
    raw = body(
        [
            entry(a.name, kind=2, shape=(64, 64), count=6, location=0, value=0),
            entry(b.name, dtype=F32, encoding=OVERWRITE, shape=(64,), count=10, location=10),
        ],
        gaps,
        words(a.values.tolist(), "<u2") + words(b.values.tolist(), "<u4"),
    )
    data = VALID[ValueLayout.PLAIN]
    assert zstandard.ZstdDecompressor().decompress(data[72:]) == raw
    assert data[:56] == _HEADER.pack(
        b"DCRP", 1, 3, ATTEMPT, 2, 3, 1, 0, 0, 1, 2, 0, len(raw), len(data) - 72
    )
    assert data[56:72] == blake3.blake3(data[:56] + data[72:]).digest()[:16]


def test_byteplane_body_stores_each_width_class_column_major() -> None:
    a, b = _items()
    plain = zstandard.ZstdDecompressor().decompress(VALID[ValueLayout.PLAIN][72:])
    planes = zstandard.ZstdDecompressor().decompress(VALID[ValueLayout.BYTEPLANE][72:])
    gaps = np.array([1, 3, 0, 293, 699, 3094], dtype="<u2")
    expect_locations = gaps.view(np.uint8).reshape(-1, 2).T.tobytes()
    expect_values = a.values.astype("<u2").view(np.uint8).reshape(-1, 2).T.tobytes()
    expect_values += b.values.astype("<u4").view(np.uint8).reshape(-1, 4).T.tobytes()
    table_end = 24 + struct.unpack_from("<Q", plain)[0]
    assert planes[:table_end] == plain[:table_end]
    assert planes[table_end:] == expect_locations + expect_values


def test_hand_built_payload_decodes() -> None:
    raw = body(
        [entry("w", kind=GAPS_U8, count=3, shape=(9,))],
        bytes([2, 2, 2]),
        words([1, 2, 3], "<u2"),
    )
    payload = decode_payload(payload_of(raw, 1))
    (item,) = payload.items
    assert item.indices.tolist() == [2, 5, 8]
    assert item.values.tolist() == [1, 2, 3]


# ------------------------------------------------------------------------------------------
# Damage in transit


@pytest.mark.parametrize("layout", list(ValueLayout))
def test_every_flipped_byte_is_rejected(layout: ValueLayout) -> None:
    data = VALID[layout]
    for i in range(len(data)):
        for mask in (0x01, 0x80):
            damaged = bytearray(data)
            damaged[i] ^= mask
            with pytest.raises(PayloadRejected):
                decode_payload(bytes(damaged))


def test_flipped_body_and_digest_bytes_fail_the_digest_check() -> None:
    data = VALID[ValueLayout.BYTEPLANE]
    for i in (8, 20, 40, 56, 71, 72, len(data) - 1):
        damaged = bytearray(data)
        damaged[i] ^= 0x10
        assert reject(bytes(damaged)).check == "digest"
        assert reject(bytes(damaged)).attempt is not None


def test_blake2b_sealed_payloads_of_earlier_releases_still_decode() -> None:
    """Without FLAG_BLAKE3 the digest is BLAKE2b-128; the body decodes to the same items."""
    header = PayloadHeader(attempt=ATTEMPT, owner=2, payload_id=3, final=True)
    new = encode_payload(header, _items(), layout=ValueLayout.PLAIN)
    old = encode_payload(header, _items(), layout=ValueLayout.PLAIN, digest="blake2b")
    assert new[6] & FLAG_BLAKE3 and not old[6] & FLAG_BLAKE3 and new[72:] == old[72:]
    assert old[56:72] == hashlib.blake2b(old[:56] + old[72:], digest_size=16).digest()
    for a, b in zip(decode_payload(old).items, decode_payload(new).items, strict=True):
        assert a.name == b.name and a.indices.tolist() == b.indices.tolist()
        assert a.values.tolist() == b.values.tolist()
    # The flag is covered by the digest: switching the algorithm fails the check either way.
    for data in (new, old):
        damaged = bytearray(data)
        damaged[6] ^= FLAG_BLAKE3
        assert reject(bytes(damaged)).check == "digest"
    with pytest.raises(ConfigError, match="unknown digest"):
        encode_payload(header, _items(), digest="md5")


def test_every_truncation_is_rejected() -> None:
    data = VALID[ValueLayout.BYTEPLANE]
    for size in range(len(data)):
        with pytest.raises(PayloadRejected) as err:
            read_header(data[:size])
        assert err.value.check == "truncated"
        with pytest.raises(PayloadRejected):
            decode_payload(memoryview(data)[:size])


def test_trailing_bytes_are_rejected() -> None:
    assert reject(VALID[ValueLayout.PLAIN] + b"\0").check == "schema"


def test_wrong_magic_and_version() -> None:
    data = VALID[ValueLayout.PLAIN]
    assert reject(b"XCRP" + data[4:]).check == "magic"
    assert reject(b"PK\x03\x04").check == "magic"
    assert reject(data[:4] + struct.pack("<H", 4) + data[6:]).check == "version"
    assert reject(data[:4] + struct.pack("<H", 0) + data[6:]).check == "version"


# ------------------------------------------------------------------------------------------
# Header fields with a valid digest


def _header_case(**kw: int) -> bytes:
    raw = body([entry("w")])
    return payload_of(raw, 1, **kw)


@pytest.mark.parametrize(
    "kw",
    [
        {"flags": 4},
        {"flags": 0x8000},
        {"codec": 0},
        {"layout": 2},
        {"reserved16": 1},
        {"reserved32": 9},
    ],
)
def test_unknown_header_values_are_schema_errors(kw: dict[str, int]) -> None:
    decode_payload(_header_case())  # the unmodified case is valid
    err = reject(_header_case(**kw))
    assert (err.check, err.attempt) == ("schema", ATTEMPT)


def test_body_shorter_than_its_preamble() -> None:
    assert reject(payload_of(b"\0" * 8, 0)).check == "schema"


@pytest.mark.parametrize("field", ["max_payload_bytes", "max_body_bytes", "max_items"])
def test_limits_reject_oversized_payloads(field: str) -> None:
    data = VALID[ValueLayout.PLAIN]
    header = read_header(data)
    size = {"max_payload_bytes": len(data), "max_body_bytes": header.body_bytes, "max_items": 2}
    decode_payload(data, limits=DecodeLimits(**{field: size[field]}))
    assert reject(data, limits=DecodeLimits(**{field: size[field] - 1})).check == "oversized"


def test_declared_huge_body_is_rejected_before_decompressing() -> None:
    raw = body([entry("w")])
    compressed = zstandard.ZstdCompressor().compress(raw)
    data = seal(compressed, body_bytes=1 << 50, n_items=1)
    assert reject(data).check == "oversized"


# ------------------------------------------------------------------------------------------
# Decompression


@cache
def _bomb(states_size: bool) -> bytes:
    """1 GiB of zeros in one zstd frame, with or without its content size in the frame header."""
    out = zstandard.ZstdCompressor(level=1).compressobj(size=1 << 30 if states_size else -1)
    chunk = bytes(16 << 20)
    parts = [out.compress(chunk) for _ in range(64)]
    return b"".join([*parts, out.flush()])


@pytest.mark.parametrize("states_size", [False, True])
@pytest.mark.parametrize("declared", [4096, 1 << 20])
def test_decompression_bomb_is_rejected_without_allocating_it(
    states_size: bool, declared: int
) -> None:
    bomb = _bomb(states_size)
    assert (zstandard.frame_content_size(bomb) == 1 << 30) is states_size
    data = seal(bomb, body_bytes=declared, n_items=0)
    assert len(data) < 64 << 10
    tracemalloc.start()
    try:
        err = reject(data, limits=DecodeLimits(max_body_bytes=1 << 20))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert err.check == "decompress"
    assert peak < 16 << 20


def test_frame_content_size_must_match_the_header() -> None:
    raw = body([entry("w")])
    compressed = zstandard.ZstdCompressor(write_content_size=True).compress(raw + b"\0" * 1000)
    assert reject(seal(compressed, body_bytes=len(raw), n_items=1)).check == "decompress"


def test_frame_shorter_than_declared() -> None:
    raw = body([entry("w")])
    compressed = zstandard.ZstdCompressor(write_content_size=False).compress(raw)
    assert reject(seal(compressed, body_bytes=len(raw) + 8, n_items=1)).check == "decompress"


@pytest.mark.parametrize("junk", [b"", b"\0", b"junk after the frame"])
def test_not_one_clean_zstd_frame(junk: bytes) -> None:
    raw = body([entry("w")])
    frame = zstandard.ZstdCompressor().compress(raw)
    cases = [seal(b"not zstd at all" + junk, body_bytes=len(raw), n_items=1)]
    if junk:
        cases.append(seal(frame + junk, body_bytes=len(raw), n_items=1))
    for data in cases:
        assert reject(data).check == "decompress"


# ------------------------------------------------------------------------------------------
# Body structure with a valid digest


def _case(
    entries: list[bytes],
    locations: bytes = b"",
    values: bytes = b"",
    *,
    n_items: int | None = None,
    lengths: tuple[int, int, int] | None = None,
) -> bytes:
    raw = body(entries, locations, values, lengths=lengths)
    return payload_of(raw, len(entries) if n_items is None else n_items)


GOOD_GAPS = [entry("w", kind=GAPS_U8, count=3, shape=(9,))]


def test_preamble_lengths_must_add_up() -> None:
    good = body(GOOD_GAPS, bytes([2, 2, 2]), words([1, 2, 3], "<u2"))
    t = len(good) - 24 - 3 - 6
    assert (
        reject(_case(GOOD_GAPS, bytes([2, 2, 2]), words([1, 2, 3], "<u2"), lengths=(t, 3, 7))).check
        == "schema"
    )
    assert (
        reject(
            _case(GOOD_GAPS, bytes([2, 2, 2]), words([1, 2, 3], "<u2"), lengths=(t + 1, 3, 5))
        ).check
        == "schema"
    )


def test_item_count_must_match_the_table() -> None:
    vals = words([1, 2, 3], "<u2")
    assert reject(_case(GOOD_GAPS, bytes([2, 2, 2]), vals, n_items=2)).check == "schema"
    assert reject(_case(GOOD_GAPS, bytes([2, 2, 2]), vals, n_items=0)).check == "schema"


def test_trailing_bytes_in_the_table() -> None:
    err = reject(_case([entry("w") + b"\0"]))
    assert err.check == "schema"


@pytest.mark.parametrize(
    ("locations", "values"),
    [
        (bytes([2, 2, 2, 0]), words([1, 2, 3], "<u2")),  # location buffer too long
        (bytes([2, 2]), words([1, 2, 3], "<u2")),  # location buffer too short
        (bytes([2, 2, 2]), words([1, 2, 3, 4], "<u2")),  # trailing value bytes
        (bytes([2, 2, 2]), words([1, 2], "<u2")),  # missing value bytes
    ],
)
def test_buffers_must_be_consumed_exactly(locations: bytes, values: bytes) -> None:
    err = reject(_case(GOOD_GAPS, locations, values))
    assert (err.check, err.attempt) == ("bounds", ATTEMPT)


@pytest.mark.parametrize(
    ("entries", "locations", "values", "check"),
    [
        ([entry("w", dtype=99)], b"", b"", "dtype"),
        ([entry("w", dtype=0)], b"", b"", "dtype"),
        ([entry("w", encoding=2)], b"", b"", "encoding"),
        ([entry("w", kind=5)], b"", b"", "encoding"),
        ([entry(b"\xff\xfe")], b"", b"", "name"),
        ([entry(b"")], b"", b"", "name"),
        ([entry("w", name_len=2000)], b"", b"", "name"),
        ([entry("w", count=9, shape=(8,))], b"", words([0] * 9, "<u2"), "bounds"),
        ([entry("w", count=2, location=7, shape=(8,))], b"", words([0, 0], "<u2"), "bounds"),
        ([entry("w", count=0, location=3)], b"", b"", "bounds"),
        ([entry("w", count=1, location=2**64 - 1)], b"", words([0], "<u2"), "bounds"),
        ([entry("w", count=1, value=1)], b"", words([0, 0], "<u2"), "bounds"),
        (  # swapped value offsets: the buffer is tiled, but not in item order
            [entry("a", count=1, value=1), entry("b", count=1, value=0)],
            b"",
            words([0, 0], "<u2"),
            "bounds",
        ),
        (  # swapped gap offsets
            [
                entry("a", kind=GAPS_U8, count=1, location=1, value=0),
                entry("b", kind=GAPS_U8, count=1, location=0, value=1),
            ],
            bytes([1, 2]),
            words([0, 0], "<u2"),
            "bounds",
        ),
        (
            [entry("w", kind=GAPS_U8, count=2, location=1)],
            bytes([0, 1, 1]),
            words([0, 0], "<u2"),
            "bounds",
        ),
        (  # a gap reaching past the tensor
            [entry("w", kind=GAPS_U8, count=2, shape=(8,))],
            bytes([0, 9]),
            words([0, 0], "<u2"),
            "bounds",
        ),
        (  # the last position past the tensor
            [entry("w", kind=GAPS_U8, count=3, shape=(8,))],
            bytes([3, 3, 3]),
            words([0, 0, 0], "<u2"),
            "bounds",
        ),
        (  # u64 gaps whose positions run past the tensor
            [entry("w", kind=GAPS_U64, count=4, shape=(2**48,))],
            words([2**47] * 4, "<u8"),
            words([0] * 4, "<u2"),
            "bounds",
        ),
        ([entry("w", dtype=BOOL, count=1)], b"", bytes([2]), "bounds"),
        ([entry("w", shape=(2,) * 9)], b"", b"", "shape"),
        ([entry("w", shape=(2**30, 2**30))], b"", b"", "shape"),
    ],
)
def test_structural_checks(
    entries: list[bytes], locations: bytes, values: bytes, check: str
) -> None:
    err = reject(_case(entries, locations, values))
    assert (err.check, err.attempt) == (check, ATTEMPT)


def test_positions_wrapping_around_int64_are_rejected() -> None:
    # With max_numel raised, four gaps of 2**62 sum past 2**64 and int64 arithmetic lands on
    # position 3, inside the tensor: only the monotonicity check can catch it.
    limits = DecodeLimits(max_numel=2**63 - 1)
    data = _case(
        [entry("w", kind=GAPS_U64, count=4, shape=(2**63 - 1,))],
        words([2**62] * 4, "<u8"),
        words([0] * 4, "<u2"),
    )
    err = reject(data, limits=limits)
    assert (err.check, err.tensor) == ("bounds", "w")


def test_limits_on_names_and_dimensions() -> None:
    data = _case([entry("abcdef", shape=(2, 2, 2))])
    decode_payload(data)
    assert reject(data, limits=DecodeLimits(max_name_bytes=5)).check == "name"
    assert reject(data, limits=DecodeLimits(max_ndim=2)).check == "shape"
    assert reject(data, limits=DecodeLimits(max_numel=7)).check == "shape"


# ------------------------------------------------------------------------------------------
# Prewarm metadata and classification


def test_catalog_accepts_matching_items() -> None:
    for data in VALID.values():
        assert len(decode_payload(data, catalog=CATALOG).items) == 2


@pytest.mark.parametrize(
    ("name", "spec", "check"),
    [
        ("model.norm.weight", None, "name"),
        ("model.norm.weight", TensorSpec(name="x", shape=(8, 8), dtype=torch.float32), "shape"),
        ("model.norm.weight", TensorSpec(name="x", shape=(), dtype=torch.float32), "shape"),
        ("model.norm.weight", TensorSpec(name="x", shape=(64,), dtype=torch.bfloat16), "dtype"),
        ("model.norm.weight", TensorSpec(name="x", shape=(64,), dtype=torch.int32), "dtype"),
    ],
)
def test_catalog_mismatches(name: str, spec: TensorSpec | None, check: str) -> None:
    catalog = dict(CATALOG)
    if spec is None:
        del catalog[name]
    else:
        catalog[name] = spec
    for data in VALID.values():
        err = reject(data, catalog=catalog)
        assert (err.check, err.tensor, err.attempt) == (check, name, ATTEMPT)


def test_xor_items_need_an_xor_path() -> None:
    xor_name = "model.layers.0.mlp.up_proj.weight"
    data = VALID[ValueLayout.BYTEPLANE]
    # The overwrite item needs no permission; the XOR item does.
    decode_payload(data, xor_allowed={xor_name})
    err = reject(data, xor_allowed={"model.norm.weight"})
    assert (err.check, err.tensor) == ("classification", xor_name)
    assert reject(data, xor_allowed=frozenset()).check == "classification"


# ------------------------------------------------------------------------------------------
# Arbitrary damage behind a valid digest


@cache
def _valid_body(layout: ValueLayout) -> bytes:
    return bytes(zstandard.ZstdDecompressor().decompress(VALID[layout][72:]))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layout=st.sampled_from(ValueLayout),
    edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=4),
    cut=st.one_of(st.none(), st.integers(0, 10**6)),
)
def test_damaged_bodies_are_rejected_or_decode_cleanly(
    layout: ValueLayout, edits: list[tuple[int, int]], cut: int | None
) -> None:
    raw = bytearray(_valid_body(layout))
    for pos, byte in edits:
        raw[pos % len(raw)] = byte
    if cut is not None:
        raw = raw[: cut % (len(raw) + 1)]
    data = payload_of(bytes(raw), 2, layout=int(layout))
    try:
        payload = decode_payload(data)
    except PayloadRejected as err:
        assert err.check in {"schema", "bounds", "name", "shape", "dtype", "encoding", "decompress"}
        return
    assert isinstance(payload, Payload)
    for item in payload.items:
        item.validate()
