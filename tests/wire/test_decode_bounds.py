"""Decoding without a catalog costs what its input allows: the item count is bounded by the
compressed bytes received (``DecodeLimits.max_items_per_byte``), checked on the header before
anything is decompressed.

The reported payload: 49 KB of format 2 holding 1,048,576 empty item records over 16,384
one-element tensors (64 each, so the per-tensor limit holds).  Decoded without a catalog it
was accepted after decompressing a 26 MB body into per-item arrays (0.4-0.8 s, +126 MB), and
a receiver's ``apply_items`` then spent 5-10 s and +257 MB making an item object per record
before refusing the first unknown name (``tests/apply/test_apply_decode_bounds.py``).
Refusing empty records alone would not bound the cost: records that carry an entry compress as
well (2**20 disjoint one-entry items take 23 KB at zstd level 19).

Memory is tracemalloc's peak (numpy's allocations are traced).  Seconds are not asserted; the
work is: a payload is refused on its header (nothing is decompressed: a peak of a few KB), and
one that decodes has no more items than compressed bytes.
"""

from __future__ import annotations

import hashlib
import struct
import tracemalloc
from collections.abc import Callable

import numpy as np
import pytest
import torch
import zstandard

from dcr.errors import PayloadRejected
from dcr.tensors.records import TensorSpec
from dcr.wire.decode import decode_payload
from dcr.wire.format import DecodeLimits, Payload

INPUT = 64 << 10
MEMORY = 64 << 20
ATTEMPT = 6
HEADER = 72

_HEADER = struct.Struct("<4sHHQIIBBHiIIQQ")  # docs: header fields before the digest
_V1_PRE = struct.Struct("<QQQ")
_V1_ENTRY = struct.Struct("<HBBBBQQQ")
_V2_PRE = struct.Struct("<IIQQQ")
_V2_TENSOR = struct.Struct("<HBB")
RECORD = np.dtype(
    [
        ("tensor", "<u4"),
        ("encoding", "u1"),
        ("kind", "u1"),
        ("location_k", "u1"),
        ("value_k", "u1"),
        ("count", "<u8"),
        ("start", "<u8"),
    ]
)
F32, INT8 = 3, 5
OVERWRITE = 1

CATALOG = {"w": TensorSpec(name="w", shape=(64,), dtype=torch.float32)}


def seal(compressed: bytes, *, version: int, body_bytes: int, n_items: int) -> bytes:
    fixed = _HEADER.pack(
        b"DCRP", version, 0, ATTEMPT, 0, 0, 1, 0, 0, 3, n_items, 0, body_bytes, len(compressed)
    )
    return fixed + hashlib.blake2b(fixed + compressed, digest_size=16).digest() + compressed


def frame(raw: bytes, level: int = 3) -> bytes:
    """One zstd frame stating its content size, window at most 8 MiB (version 2's rule)."""
    params = zstandard.ZstdCompressionParameters.from_level(
        level, window_log=23, write_content_size=True
    )
    return zstandard.ZstdCompressor(compression_params=params).compress(raw)


def sealed(raw: bytes, *, version: int, n_items: int) -> bytes:
    return seal(frame(raw), version=version, body_bytes=len(raw), n_items=n_items)


def names(n: int) -> list[bytes]:
    return [b"t%05d" % i for i in range(n)]


def v2_body(
    tensors: int, dtype: int, numel: int, records: np.ndarray, values: bytes = b""
) -> bytes:
    listed = b"".join(
        _V2_TENSOR.pack(6, dtype, 1) + struct.pack("<Q", numel) + x for x in names(tensors)
    )
    return _V2_PRE.pack(tensors, 0, len(listed), 0, 0) + listed + records.tobytes() + values


def empty_record_bomb() -> bytes:
    """The reported payload: 2**20 empty records, 64 on each of 16,384 one-element tensors."""
    tensors, per = 1 << 14, 64
    records = np.zeros(tensors * per, dtype=RECORD)
    records["tensor"] = np.repeat(np.arange(tensors), per)
    records["encoding"] = OVERWRITE
    return sealed(v2_body(tensors, F32, 1, records), version=2, n_items=tensors * per)


def one_entry_bomb() -> bytes:
    """2**17 disjoint one-entry items (2,048 tensors of 64 elements, each element its own
    item), all values zero: nothing refuses these records but their number."""
    tensors, per = 1 << 11, 64
    n = tensors * per
    records = np.zeros(n, dtype=RECORD)
    records["tensor"] = np.arange(n) % tensors
    records["encoding"] = OVERWRITE
    records["count"] = 1
    records["start"] = np.arange(n) // tensors
    return sealed(v2_body(tensors, INT8, per, records, bytes(n)), version=2, n_items=n)


def v1_bomb() -> bytes:
    """Version 1: 2**18 empty entries, 64 on each of 4,096 names."""
    tensors, per = 1 << 12, 64
    entry = [_V1_ENTRY.pack(6, F32, OVERWRITE, 0, 1, 0, 0, 0) + struct.pack("<Q", 1) + x
             for x in names(tensors)]  # fmt: skip
    table = b"".join(e for e in entry for _ in range(per))
    return sealed(_V1_PRE.pack(len(table), 0, 0) + table, version=1, n_items=tensors * per)


def largest_allowed(version: int, tensors: int) -> bytes:
    """One-entry overwrite items on 64-element int8 tensors no receiver knows, as many as the
    compressed bytes allow (values random where needed to make the frame that long)."""
    per = 64
    n = tensors * per

    def raw(noise: int) -> bytes:
        values = np.zeros(n, dtype=np.uint8)
        values[:noise] = np.random.default_rng(5).integers(0, 256, noise, dtype=np.uint8)
        if version == 2:
            records = np.zeros(n, dtype=RECORD)
            records["tensor"] = np.arange(n) % tensors
            records["encoding"] = OVERWRITE
            records["count"] = 1
            records["start"] = np.arange(n) // tensors
            return v2_body(tensors, INT8, per, records, values.tobytes())
        listed = names(tensors)
        table = b"".join(
            _V1_ENTRY.pack(6, INT8, OVERWRITE, 0, 1, 1, i // tensors, i)
            + struct.pack("<Q", per)
            + listed[i % tensors]
            for i in range(n)
        )
        return _V1_PRE.pack(len(table), 0, n) + table + values.tobytes()

    noise = 0
    while len(compressed := frame(raw(noise))) < n:
        noise += max(256, n - len(compressed))
    return seal(compressed, version=version, body_bytes=len(raw(noise)), n_items=n)


def _peak(fn: Callable[[], object]) -> tuple[int, object]:
    """tracemalloc's peak while ``fn`` runs, and its result or its rejection."""
    tracemalloc.start()
    try:
        try:
            out: object = fn()
        except PayloadRejected as exc:
            out = exc
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak, out


BOMBS = {"empty records": empty_record_bomb, "one-entry items": one_entry_bomb, "v1": v1_bomb}


@pytest.mark.parametrize("bomb", list(BOMBS))
@pytest.mark.parametrize("catalog", [None, CATALOG], ids=["no catalog", "catalog"])
def test_item_bombs_are_refused_on_the_header(bomb: str, catalog: dict | None) -> None:
    data = BOMBS[bomb]()
    n_items = int.from_bytes(data[32:36], "little")
    assert len(data) <= INPUT and n_items > len(data), (len(data), n_items)
    peak, out = _peak(lambda: decode_payload(data, catalog=catalog))
    assert isinstance(out, PayloadRejected), out
    assert (out.check, out.attempt) == ("oversized", ATTEMPT)
    assert "per byte" in str(out) or catalog is not None
    # Refused before decompressing: the 6-26 MB body is never made.
    assert peak < 256 << 10, peak


def test_the_reported_payload_is_what_it_was() -> None:
    """The generator makes the reported payload: under 50 KB, 2**20 records, 16,384 tensors."""
    data = empty_record_bomb()
    assert 40_000 < len(data) < 50_000
    raw = zstandard.ZstdDecompressor().decompress(data[HEADER:])
    n_tensors, _, listed, _, _ = _V2_PRE.unpack_from(raw)
    records = np.frombuffer(raw[_V2_PRE.size + listed :], dtype=RECORD)
    assert (n_tensors, records.shape[0]) == (1 << 14, 1 << 20)
    assert int(records["count"].max()) == 0
    assert int(np.bincount(records["tensor"]).max()) == 64


@pytest.mark.parametrize("version,tensors", [(2, 1000), (1, 300)])
def test_the_most_items_an_input_allows_decode_within_the_bound(version: int, tensors: int) -> None:
    data = largest_allowed(version, tensors)
    compressed = len(data) - HEADER
    n_items = tensors * 64
    assert len(data) <= INPUT and compressed >= n_items
    peak, out = _peak(lambda: decode_payload(data))
    assert isinstance(out, Payload), out
    assert len(out.items) == n_items  # the work: one item per compressed byte at most
    assert peak <= MEMORY, peak
    assert out.items[n_items - 1].indices.tolist() == [63]


def test_items_per_compressed_byte_is_a_limit() -> None:
    """200 empty records of 4 tensors compress to far fewer bytes than items: refused by
    default, decoded when the receiver allows more items per byte."""
    records = np.zeros(200, dtype=RECORD)
    records["tensor"] = np.arange(200) % 4
    data = sealed(v2_body(4, F32, 1, records), version=2, n_items=200)
    per_byte = -(-200 // (len(data) - HEADER))
    assert per_byte > 1
    with pytest.raises(PayloadRejected) as err:
        decode_payload(data)
    assert err.value.check == "oversized"
    with pytest.raises(PayloadRejected) as err:
        decode_payload(data, limits=DecodeLimits(max_items_per_byte=per_byte - 1))
    assert err.value.check == "oversized"
    payload = decode_payload(data, limits=DecodeLimits(max_items_per_byte=per_byte))
    assert len(payload.items) == 200


@pytest.mark.parametrize("version", [1, 2])
def test_the_densest_entries_an_input_allows_decode_within_the_bound(version: int) -> None:
    """Entries cost memory per entry (positions, values): the most a catalog-less decode may
    meet is a body at the expansion bound, filled with the cheapest entries an encoder
    writes (every position of an int8 tensor, one value).  It fits in 64 KiB and decodes
    within 64 MiB; the same entries in a larger body are refused on the header."""
    from dcr.tensors.records import Encoding, Item
    from dcr.wire.encode import encode_payload
    from dcr.wire.format import EXPANSION_FLOOR, PayloadHeader

    def payload(n: int) -> bytes:
        item = Item(
            name="w", shape=(n,), dtype=torch.int8, encoding=Encoding.XOR,
            indices=np.arange(n, dtype=np.int64), values=np.ones(n, dtype=np.uint8),
        )  # fmt: skip
        header = PayloadHeader(attempt=ATTEMPT, owner=0, payload_id=0, final=True)
        return encode_payload(header, [item], level=19, version=version)

    n = 1 << 16
    while True:  # the most such entries a body within the floor holds
        data = payload(2 * n)
        if struct.unpack_from("<Q", data, 40)[0] > EXPANSION_FLOOR:
            break
        n *= 2
    data = payload(n)
    assert len(data) <= INPUT
    peak, out = _peak(lambda: decode_payload(data))
    assert not isinstance(out, PayloadRejected), out
    assert peak <= MEMORY, f"{peak / 2**20:.1f} MiB"
    peak, out = _peak(lambda: decode_payload(payload(4 * n)))
    assert isinstance(out, PayloadRejected) and out.check == "oversized"
