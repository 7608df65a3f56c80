"""The rules ``docs/wire-format.md`` decides, one test each: the catalog's body bound uses the
limits' ``max_ndim`` and ``max_name_bytes``; every entry of one name carries one shape and
dtype (version 1); items of one tensor never share a position; every unknown flag bit is
refused; a single-segment zstd frame's window is its content size (8 MiB at most in version 2,
128 MiB in version 1, like any frame's window in version 1).

Payloads are built by hand from the document (zstd frames too, from RFC 8878: a raw block then
RLE blocks of zeros) and sealed with a fresh digest, so the structural checks are what decide.
"""

from __future__ import annotations

import hashlib
import struct
import tracemalloc

import blake3
import numpy as np
import pytest
import torch

from dcr.errors import PayloadRejected
from dcr.tensors.records import Encoding, Item, TensorSpec
from dcr.wire.decode import decode_payload
from dcr.wire.encode import encode_payload
from dcr.wire.format import EXPANSION_FLOOR, FLAGS_KNOWN, DecodeLimits, PayloadHeader

# Every test runs with the C kernels and with numpy only (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("both_paths")

ATTEMPT = 9
MIB = 1 << 20
_HEADER = struct.Struct("<4sHHQIIBBHiIIQQ")  # docs: header fields before the digest
_V1_ENTRY = struct.Struct("<HBBBBQQQ")
_V2_PRE = struct.Struct("<IIQQQ")
_V2_RECORD = struct.Struct("<IBBBBQQ")
BF16, F32, INT8 = 1, 3, 5
OVERWRITE, RUN = 1, 0
ZSTD_MAGIC = 0xFD2FB528
H = PayloadHeader(attempt=ATTEMPT, owner=1, payload_id=0)


def seal(
    compressed: bytes, *, version: int, body_bytes: int, n_items: int, flags: int = 0
) -> bytes:
    """A payload around ``compressed`` with a correct digest (BLAKE3 with flag bit 1)."""
    fixed = _HEADER.pack(
        b"DCRP", version, flags, ATTEMPT, 1, 0, 1, 0, 0, 1, n_items, 0, body_bytes,
        len(compressed),
    )  # fmt: skip
    if flags & 0x0002:
        digest = blake3.blake3(fixed + compressed).digest()[:16]
    else:
        digest = hashlib.blake2b(fixed + compressed, digest_size=16).digest()
    return fixed + digest + compressed


def zstd_frame(head: bytes, zeros: int, *, window_log: int | None) -> bytes:
    """A zstd frame of ``head`` then ``zeros`` zero bytes, stating its content size: one raw
    block, then RLE blocks of at most 128 KiB.  ``window_log=None`` makes it a single-segment
    frame (no Window_Descriptor: the window is the content size)."""
    size = len(head) + zeros
    if window_log is None:
        out = [struct.pack("<IB", ZSTD_MAGIC, 0xC0 | 0x20)]
    else:
        out = [struct.pack("<IBB", ZSTD_MAGIC, 0xC0, (window_log - 10) << 3)]
    out.append(struct.pack("<Q", size))
    blocks: list[tuple[int, int, bytes]] = []  # (type, size, content)
    if head:
        blocks.append((0, len(head), head))
    while zeros:
        n = min(zeros, 1 << 17)
        blocks.append((1, n, b"\0"))
        zeros -= n
    for i, (kind, n, content) in enumerate(blocks):
        last = 1 if i == len(blocks) - 1 else 0
        out.append(((n << 3) | (kind << 1) | last).to_bytes(3, "little") + content)
    return b"".join(out)


def _v2_head(numel: int) -> bytes:
    """A version 2 body up to its values: tensor ``w`` (int8 ``[numel]``) overwritten whole
    by one run; ``numel`` value bytes follow."""
    listed = struct.pack("<HBBQ", 1, INT8, 1, numel) + b"w"
    return (
        _V2_PRE.pack(1, 0, len(listed), 0, 0)
        + listed
        + _V2_RECORD.pack(0, OVERWRITE, RUN, 0, 0, numel, 0)
    )


def _v1_head(numel: int) -> bytes:
    """The same in version 1."""
    entry = _V1_ENTRY.pack(1, INT8, OVERWRITE, RUN, 1, numel, 0, 0) + struct.pack("<Q", numel)
    return struct.pack("<QQQ", len(entry) + 1, 0, numel) + entry + b"w"


def whole_overwrite(version: int, body_bytes: int, *, window_log: int | None) -> bytes:
    """A valid payload whose body is ``body_bytes`` long, mostly zero values."""
    head_of = _v1_head if version == 1 else _v2_head
    numel = body_bytes - len(head_of(0))
    head = head_of(numel)
    frame = zstd_frame(head, numel, window_log=window_log)
    return seal(frame, version=version, body_bytes=body_bytes, n_items=1)


def refusal(data: bytes, **kw: object) -> PayloadRejected:
    with pytest.raises(PayloadRejected) as err:
        decode_payload(data, **kw)  # type: ignore[arg-type]
    assert err.value.attempt == ATTEMPT
    return err.value


# ------------------------------------------------------------------------------------------
# The catalog's body bound


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("limits", [DecodeLimits(), DecodeLimits(max_ndim=2, max_name_bytes=7)])
def test_the_catalog_bound_uses_the_limits_fields(version: int, limits: DecodeLimits) -> None:
    """``max_ndim`` and ``max_name_bytes`` in the bound are ``DecodeLimits`` fields, not the
    catalog's largest (here 1 dimension, 1-byte name): a body of exactly the bound passes the
    check (and fails later, its frame being another length), one byte more is refused."""
    catalog = {"w": TensorSpec(name="w", shape=(64,), dtype=torch.bfloat16)}
    meta = 8 * limits.max_ndim + limits.max_name_bytes
    # docs: 24 + n_items·(30 + meta) + 16·E (version 1), 32 + n_items·(28 + meta) + 34·E
    bound = 24 + (30 + meta) + 16 * 64 if version == 1 else 32 + (28 + meta) + 34 * 64
    frame = zstd_frame(b"\1" * 64, 0, window_log=None)
    at = seal(frame, version=version, body_bytes=bound, n_items=1)
    over = seal(frame, version=version, body_bytes=bound + 1, n_items=1)
    assert refusal(at, catalog=catalog, limits=limits).check == "decompress"
    err = refusal(over, catalog=catalog, limits=limits)
    assert err.check == "oversized" and f"the {bound} the catalog allows" in str(err)


# ------------------------------------------------------------------------------------------
# One shape and dtype per name (version 1 entries carry their own)


def _v1_entries(*specs: tuple[int, tuple[int, ...], int]) -> bytes:
    """Entries of name ``w``: (dtype, shape, start) each, a 2-entry run of overwrites."""
    table, values = b"", b""
    width = {BF16: 2, F32: 4}
    for i, (dtype, shape, start) in enumerate(specs):
        before = sum(2 for d, _, _ in specs[:i] if width[d] == width[dtype])
        table += _V1_ENTRY.pack(1, dtype, OVERWRITE, RUN, len(shape), 2, start, before)
        table += struct.pack(f"<{len(shape)}Q", *shape) + b"w"
    for w in (2, 4):
        values += bytes(w * 2 * sum(1 for d, _, _ in specs if width[d] == w))
    raw = struct.pack("<QQQ", len(table), 0, len(values)) + table + values
    frame = zstd_frame(raw, 0, window_log=None)
    return seal(frame, version=1, body_bytes=len(raw), n_items=len(specs))


def test_every_entry_of_a_name_carries_one_shape_and_dtype() -> None:
    same = decode_payload(_v1_entries((BF16, (8,), 0), (BF16, (8,), 4)))
    assert [(it.name, it.shape) for it in same.items] == [("w", (8,)), ("w", (8,))]
    err = refusal(_v1_entries((BF16, (8,), 0), (BF16, (4,), 4)))
    assert (err.check, err.tensor) == ("shape", "w")
    err = refusal(_v1_entries((BF16, (8,), 0), (F32, (8,), 4)))
    assert (err.check, err.tensor) == ("dtype", "w")


def test_version_1_refuses_2_to_the_63_elements_like_version_2() -> None:
    entry = _V1_ENTRY.pack(1, BF16, OVERWRITE, RUN, 2, 0, 0, 0) + struct.pack("<2Q", 2**32, 2**31)
    raw = struct.pack("<QQQ", len(entry) + 1, 0, 0) + entry + b"w"
    data = seal(zstd_frame(raw, 0, window_log=None), version=1, body_bytes=len(raw), n_items=1)
    assert refusal(data, limits=DecodeLimits(max_numel=2**70)).check == "shape"


# ------------------------------------------------------------------------------------------
# Items of one tensor never share a position


def _item(encoding: Encoding, indices: list[int], name: str = "w") -> Item:
    return Item(
        name=name,
        shape=(64,),
        dtype=torch.bfloat16,
        encoding=encoding,
        indices=np.array(indices, dtype=np.int64),
        values=np.ones(len(indices), dtype=np.uint16),
    )


XOR, OW = Encoding.XOR, Encoding.OVERWRITE
SHARED = {
    "two runs": [_item(XOR, [0, 1, 2, 3]), _item(XOR, [2, 3, 4, 5])],
    "run and listed, other encodings": [_item(XOR, [0, 1, 2, 3]), _item(OW, [3, 10])],
    "listed, interleaved": [_item(OW, [1, 5, 9]), _item(OW, [2, 6, 9])],
    "a long run over a later item": [
        _item(OW, list(range(10, 40))),
        _item(OW, [50, 60]),
        _item(XOR, [5, 39]),
    ],
    "empty items between": [_item(XOR, []), _item(XOR, [7, 8]), _item(XOR, []), _item(OW, [8])],
}
DISJOINT = {
    "interleaved": [_item(OW, [1, 5, 9]), _item(XOR, [2, 6, 10]), _item(OW, [0, 3])],
    "runs end to end": [_item(XOR, [0, 1, 2]), _item(XOR, [3, 4]), _item(OW, [5, 6, 7])],
    "other tensors": [_item(XOR, [1, 2]), _item(XOR, [1, 2], "v"), _item(OW, [3], "v")],
}


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("case", list(SHARED))
def test_items_of_one_tensor_sharing_a_position_are_refused(version: int, case: str) -> None:
    items = SHARED[case]
    if version == 1:
        items = [i for i in items if i.encoding is not Encoding.ULP]
    err = refusal(encode_payload(H, items, version=version))
    assert (err.check, err.tensor) == ("overlap", "w")


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("case", list(DISJOINT))
def test_disjoint_items_of_one_tensor_decode(version: int, case: str) -> None:
    items = DISJOINT[case]
    payload = decode_payload(encode_payload(H, items, version=version))
    got = [(it.name, it.encoding, it.indices.tolist()) for it in payload.items]
    assert got == [(it.name, it.encoding, it.indices.tolist()) for it in items]


@pytest.mark.parametrize("version", [1, 2])
def test_the_overlap_check_agrees_with_sets_of_positions(version: int) -> None:
    """Random payloads of runs, listed positions and empty items on three tensors: refused
    exactly when two items of one tensor share a position (as ``bounds`` when their entries
    even outnumber its elements)."""
    rng = np.random.default_rng(version)
    refused = 0
    for _ in range(150):
        items = []
        for _ in range(int(rng.integers(2, 7))):
            name = str(rng.choice(["a", "b", "c"]))
            kind = int(rng.integers(0, 3))
            if kind == 0:
                start = int(rng.integers(0, 60))
                idx = list(range(start, start + int(rng.integers(1, 64 - start))))
            elif kind == 1:
                idx = sorted(set(rng.integers(0, 64, int(rng.integers(1, 6))).tolist()))
            else:
                idx = []
            items.append(_item(Encoding(int(rng.integers(0, 2))), idx, name))
        seen: dict[str, set[int]] = {}
        shared = False
        for it in items:
            mine = set(it.indices.tolist())
            shared |= bool(seen.setdefault(it.name, set()) & mine)
            seen[it.name] |= mine
        data = encode_payload(H, items, version=version)
        if shared:
            refused += 1
            # More entries than elements (which implies sharing) is found first.
            too_many = any(sum(i.count for i in items if i.name == n) > 64 for n in seen)
            assert refusal(data).check == ("bounds" if too_many else "overlap")
        else:
            assert len(decode_payload(data).items) == len(items)
    assert 20 < refused < 130


# ------------------------------------------------------------------------------------------
# Flag bits


@pytest.mark.parametrize("bit", [b for b in range(16) if not FLAGS_KNOWN & (1 << b)])
def test_every_unknown_flag_bit_is_refused(bit: int) -> None:
    """A flag bit selects the seal function or marks the payload; one a decoder does not know
    is refused even under a valid digest."""
    raw = _v2_head(4) + bytes(4)
    frame = zstd_frame(raw, 0, window_log=None)
    good = seal(frame, version=2, body_bytes=len(raw), n_items=1, flags=0x0002)
    assert len(decode_payload(good).items) == 1
    bad = seal(frame, version=2, body_bytes=len(raw), n_items=1, flags=0x0002 | (1 << bit))
    assert refusal(bad).check == "schema"


# ------------------------------------------------------------------------------------------
# zstd windows

TRUSTED = DecodeLimits(max_expansion=1 << 20)
"""Whole-tensor overwrites of zeros compress far beyond 64:1: decoded without a catalog, they
need a trusting limit (with the catalog, the catalog bounds them)."""


@pytest.mark.parametrize("version", [1, 2])
def test_without_a_catalog_the_body_is_bounded_by_the_bytes_received(version: int) -> None:
    """The zero bomb: a whole-tensor overwrite of 64 MiB of zeros fits in a few KiB.  Without
    a catalog it is refused on its header (nothing decompressed, under 1 MiB traced); a body
    of ``max(64 x compressed, 4 MiB)`` still decodes; with its catalog, the catalog bounds
    it and it decodes."""
    bomb = whole_overwrite(version, 64 * MIB, window_log=20)
    assert len(bomb) < 64 << 10
    tracemalloc.start()
    try:
        err = refusal(bomb)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert err.check == "oversized" and "without a catalog" in str(err) and peak < MIB
    floor = whole_overwrite(version, EXPANSION_FLOOR, window_log=20)
    assert len(floor) * 64 < EXPANSION_FLOOR
    assert decode_payload(floor).items[0].count == EXPANSION_FLOOR - len(
        (_v1_head if version == 1 else _v2_head)(0)
    )
    assert refusal(whole_overwrite(version, EXPANSION_FLOOR + 1, window_log=20)).check == (
        "oversized"
    )
    numel = 64 * MIB - len((_v1_head if version == 1 else _v2_head)(0))
    catalog = {"w": TensorSpec(name="w", shape=(numel,), dtype=torch.int8)}
    assert decode_payload(bomb, catalog=catalog).items[0].count == numel


def test_a_single_segment_frames_window_is_its_content_size_version_2() -> None:
    at = decode_payload(whole_overwrite(2, 8 * MIB, window_log=None), limits=TRUSTED)
    assert at.items[0].count == 8 * MIB - len(_v2_head(0))
    err = refusal(whole_overwrite(2, 8 * MIB + 1, window_log=None), limits=TRUSTED)
    assert err.check == "decompress" and "window" in str(err)
    # The same content in a frame with a 1 MiB window is fine.
    decode_payload(whole_overwrite(2, 8 * MIB + 1, window_log=20), limits=TRUSTED)
    err = refusal(whole_overwrite(2, 4096, window_log=24), limits=TRUSTED)
    assert err.check == "decompress" and "window" in str(err)


def test_version_1_windows_stop_at_128_mib() -> None:
    """Version 1 allows any window up to 128 MiB (the largest zstd level's), single-segment
    frames' included, and refuses larger ones before decompressing anything."""
    assert decode_payload(
        whole_overwrite(1, 8 * MIB + 1, window_log=None), limits=TRUSTED
    ).items[0].count
    decode_payload(whole_overwrite(1, 4096, window_log=27), limits=TRUSTED)
    for data in (
        whole_overwrite(1, 128 * MIB + 1, window_log=None),
        whole_overwrite(1, 4096, window_log=28),
    ):
        err = refusal(data, limits=TRUSTED)
        assert err.check == "decompress" and "window" in str(err)
