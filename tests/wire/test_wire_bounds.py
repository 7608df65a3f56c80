"""Decoding cost is bounded by the input: no payload or control frame of at
most 64 KiB costs more than 64 MiB or 1 s of CPU to reject or decode with a small catalog.

Peak memory is tracemalloc's (numpy's allocations are traced); CPU time is
``time.process_time``.  The bounds are bounds, not timings: the costs measured here are far
below them (the tests also check a tenth of the CPU bound, so a slow machine still passes the
real one).
"""

from __future__ import annotations

import hashlib
import random
import struct
import time
import tracemalloc
from collections.abc import Callable

import msgspec
import numpy as np
import pytest
import torch
import zstandard

from dcr.adapters.control.codec import ControlCodec
from dcr.errors import ControlMessageRejected, PayloadRejected
from dcr.protocol.messages import MESSAGES
from dcr.tensors.records import Encoding, Item, TensorSpec
from dcr.wire.decode import decode_payload
from dcr.wire.encode import encode_payload
from dcr.wire.format import PayloadHeader

INPUT = 64 << 10
MEMORY = 64 << 20
CPU = 1.0
ATTEMPT = 4

CATALOG = {
    "emb": TensorSpec(name="emb", shape=(1024, 1024), dtype=torch.bfloat16),
    "norm": TensorSpec(name="norm", shape=(4096,), dtype=torch.float32),
    "q": TensorSpec(name="q", shape=(64, 64), dtype=torch.int8),
    "mask": TensorSpec(name="mask", shape=(100,), dtype=torch.bool),
}

_HEADER = struct.Struct("<4sHHQIIBBHiIIQQ")
_V1_ENTRY = struct.Struct("<HBBBBQQQ")
_V2_PRE = struct.Struct("<IIQQQ")
_V2_TENSOR = struct.Struct("<HBB")
_V2_RECORD = struct.Struct("<IBBBBQQ")
_V3_RECORD = struct.Struct("<IBBBBQQQQQ")  # the version 2 record, then last, period, gap


def seal(compressed: bytes, *, version: int, body_bytes: int, n_items: int) -> bytes:
    fixed = _HEADER.pack(
        b"DCRP", version, 0, ATTEMPT, 0, 0, 1, 1, 0, 1, n_items, 0, body_bytes, len(compressed)
    )
    return fixed + hashlib.blake2b(fixed + compressed, digest_size=16).digest() + compressed


def sealed(raw: bytes, *, version: int, n_items: int) -> bytes:
    compressed = zstandard.ZstdCompressor(level=3, write_content_size=True).compress(raw)
    return seal(compressed, version=version, body_bytes=len(raw), n_items=n_items)


def rle_frame(size: int, *, single_segment: bool = True) -> bytes:
    """A valid zstd frame of ``size`` zero bytes in 4 bytes per 128 KiB (RLE blocks); with a
    1 MiB window unless it is a single segment (whose window is the whole content)."""
    block = 1 << 17
    assert size % block == 0
    if single_segment:
        out = [struct.pack("<IB", 0xFD2FB528, 0x20 | 0xC0), struct.pack("<Q", size)]
    else:
        out = [struct.pack("<IBB", 0xFD2FB528, 0xC0, 10 << 3), struct.pack("<Q", size)]
    n = size // block
    for i in range(n):
        header = (1 if i == n - 1 else 0) | (1 << 1) | (block << 3)
        out.append(header.to_bytes(3, "little") + b"\0")
    return b"".join(out)


def v1_entry(name: bytes, *, dtype: int = 3, shape: tuple[int, ...] = (4096,), count: int = 0,
             location: int = 0, value: int = 0, kind: int = 0) -> bytes:  # fmt: skip
    return (
        _V1_ENTRY.pack(len(name), dtype, 0, kind, len(shape), count, location, value)
        + struct.pack(f"<{len(shape)}Q", *shape)
        + name
    )


def v2_tensor(name: bytes, dtype: int = 3, shape: tuple[int, ...] = (4096,)) -> bytes:
    return (
        _V2_TENSOR.pack(len(name), dtype, len(shape))
        + struct.pack(f"<{len(shape)}Q", *shape)
        + name
    )


def v2_body(tensors: list[bytes], records: bytes, streams: bytes = b"") -> bytes:
    listed = b"".join(tensors)
    return _V2_PRE.pack(len(tensors), 0, len(listed), 0, 0) + listed + records + streams


def _run(fn: Callable[[], object]) -> str:
    try:
        fn()
    except (PayloadRejected, ControlMessageRejected) as exc:
        return exc.check or "?"
    return "decoded"


def empty_items_body(n: int, version: int) -> bytes:
    """The body ``encode_payload`` writes for ``n`` empty XOR items of ``norm``."""
    if version == 1:
        return struct.pack("<QQQ", (30 + 8 + 4) * n, 0, 0) + v1_entry(b"norm") * n
    return v2_body([v2_tensor(b"norm")], _V2_RECORD.pack(0, 0, 0, 0, 0, 0, 0) * n)


def _cost(fn: Callable[[], object]) -> tuple[int, float, str]:
    """Peak traced memory (one run under tracemalloc) and CPU seconds (one run without it,
    since tracing slows every Python allocation down) of ``fn``, and its outcome."""
    tracemalloc.start()
    try:
        outcome = _run(fn)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    start = time.process_time()
    assert _run(fn) == outcome
    return peak, time.process_time() - start, outcome


def _adversarial_payloads() -> dict[str, bytes]:
    rng = random.Random(7)
    cases: dict[str, bytes] = {}
    # 2**20 empty items of one tensor (the issue's reproduction, in both versions).
    cases["v1 2**20 empty items"] = sealed(
        b"".join(
            [struct.pack("<QQQ", (30 + 8 + 4) * (1 << 20), 0, 0)] + [v1_entry(b"norm")] * (1 << 20)
        ),
        version=1,
        n_items=1 << 20,
    )
    cases["v2 2**20 empty items"] = sealed(
        v2_body([v2_tensor(b"norm")], _V2_RECORD.pack(0, 0, 0, 0, 0, 0, 0) * (1 << 20)),
        version=2,
        n_items=1 << 20,
    )
    # A zstd frame declaring a 1.5 GiB body (within max_body_bytes), in both versions.
    for single in (True, False):
        bomb = rle_frame(3 << 29, single_segment=single)
        kind = "one segment" if single else "1 MiB window"
        for version in (1, 2, 3):
            for n_items in (0, 1):
                cases[f"v{version} 1.5 GiB zstd bomb, {kind}, {n_items} items"] = seal(
                    bomb, version=version, body_bytes=3 << 29, n_items=n_items
                )
    # Many one-entry items: within the catalog's allowance, and far beyond it.
    for n, tag in ((64, "64"), (1 << 14, "16384")):
        records = b"".join(_V2_RECORD.pack(0, 1, 0, 0, 0, 1, i % 4096) for i in range(n))
        cases[f"v2 {tag} one-entry items"] = sealed(
            v2_body([v2_tensor(b"norm")], records, np.zeros(n, dtype="<u4").tobytes()),
            version=2,
            n_items=n,
        )
        entries = [v1_entry(b"norm", count=1, location=i % 4096, value=i) for i in range(n)]
        v1_raw = struct.pack("<QQQ", sum(map(len, entries)), 0, 4 * n) + b"".join(entries)
        cases[f"v1 {tag} one-entry items"] = sealed(v1_raw + bytes(4 * n), version=1, n_items=n)
    # Names of the maximal length, random (incompressible), not in the catalog.
    names = [
        bytes(rng.choice(b"abcdefghijklmnopqrstuvwxyz") for _ in range(1024)) for _ in range(60)
    ]
    cases["v2 max-length names"] = sealed(
        v2_body(
            [v2_tensor(x) for x in names],
            b"".join(_V2_RECORD.pack(i, 0, 0, 0, 0, 0, 0) for i in range(60)),
        ),
        version=2,
        n_items=60,
    )
    cases["v1 max-length names"] = sealed(
        struct.pack("<QQQ", sum(len(v1_entry(x)) for x in names), 0, 0)
        + b"".join(v1_entry(x) for x in names),
        version=1,
        n_items=60,
    )
    # Huge shapes with runs over all of them (values would be terabytes).
    huge = (1 << 24, 1 << 24)
    cases["v2 huge shape"] = sealed(
        v2_body([v2_tensor(b"emb", 1, huge)], _V2_RECORD.pack(0, 1, 0, 0, 0, 1 << 40, 0)),
        version=2,
        n_items=1,
    )
    # Version 3: strided rows over half of a huge shape, every other row of 2**24 elements.
    count = 1 << 47
    last = count - 1 + (count - 1 >> 24 << 24)
    cases["v3 huge rows"] = sealed(
        v2_body(
            [v2_tensor(b"emb", 1, huge)],
            _V3_RECORD.pack(0, 1, 6, 0, 0, count, 0, last, 1 << 24, 1 << 24),
        ),
        version=3,
        n_items=1,
    )
    cases["v1 huge shape"] = sealed(
        struct.pack("<QQQ", len(v1_entry(b"emb", dtype=1, shape=huge, count=1 << 40)), 0, 0)
        + v1_entry(b"emb", dtype=1, shape=huge, count=1 << 40),
        version=1,
        n_items=1,
    )
    # Tables of maximal-ndim entries.
    eight = (1,) * 8
    many = [v2_tensor(b"t%05d" % i, 3, eight) for i in range(4000)]
    cases["v2 max-ndim tensors"] = sealed(
        v2_body(many, b"".join(_V2_RECORD.pack(i, 0, 0, 0, 0, 0, 0) for i in range(4000))),
        version=2,
        n_items=4000,
    )
    v1_many = [v1_entry(b"t%05d" % i, shape=eight) for i in range(4000)]
    cases["v1 max-ndim entries"] = sealed(
        struct.pack("<QQQ", sum(map(len, v1_many)), 0, 0) + b"".join(v1_many),
        version=1,
        n_items=4000,
    )
    # The most a small catalog allows: every element of every tensor, overwritten.
    full = [
        Item(
            name=name,
            shape=spec.shape,
            dtype=spec.dtype,
            encoding=Encoding.OVERWRITE,
            indices=np.arange(spec.numel, dtype=np.int64),
            values=np.zeros(spec.numel, dtype=f"u{spec.itemsize}"),
        )
        for name, spec in CATALOG.items()
    ]
    header = PayloadHeader(attempt=ATTEMPT, owner=0, payload_id=0)
    for version in (1, 2, 3):
        cases[f"v{version} whole catalog"] = encode_payload(header, full, level=19, version=version)
    # Garbage behind a valid digest.
    cases["v2 random body"] = seal(rng.randbytes(60_000), version=2, body_bytes=1 << 30, n_items=9)
    return cases


_CASES = _adversarial_payloads()


@pytest.mark.parametrize("name", list(_CASES))
@pytest.mark.parametrize("with_catalog", [True, False])
def test_no_small_payload_costs_more_than_the_bound(name: str, with_catalog: bool) -> None:
    data = _CASES[name]
    assert len(data) <= INPUT, (name, len(data))
    catalog = CATALOG if with_catalog else None
    peak, cpu, outcome = _cost(lambda: decode_payload(data, catalog=catalog))
    assert peak <= MEMORY, (name, peak, outcome)
    assert cpu <= CPU, (name, cpu, outcome)
    if with_catalog and not name.endswith(("whole catalog", "64 one-entry items")):
        assert outcome != "decoded", name


@pytest.mark.parametrize("version", [1, 2])
def test_the_issue_reproduction_is_rejected_early(version: int) -> None:
    """Empty items built with ``encode_payload`` (the issue's 2**20 are built by hand above,
    with the same bytes): refused on the header with a catalog, on the preamble (version 2)
    or the 65th entry of one tensor (version 1) without."""
    empty = Item(
        name="norm",
        shape=(4096,),
        dtype=torch.float32,
        encoding=Encoding.XOR,
        indices=np.empty(0, dtype=np.int64),
        values=np.empty(0, dtype=np.uint32),
    )
    header = PayloadHeader(attempt=ATTEMPT, owner=0, payload_id=0)
    data = encode_payload(header, [empty] * 300, version=version)
    raw = zstandard.ZstdDecompressor().decompress(data[72:])
    assert raw == empty_items_body(300, version)
    for catalog in (CATALOG, None):
        peak, cpu, outcome = _cost(lambda catalog=catalog: decode_payload(data, catalog=catalog))
        assert (outcome, peak < 1 << 20, cpu < CPU / 10) == ("oversized", True, True)


def test_a_full_catalog_payload_decodes_within_the_bound() -> None:
    for version in (1, 2, 3):
        data = _CASES[f"v{version} whole catalog"]
        peak, cpu, outcome = _cost(lambda data=data: decode_payload(data, catalog=CATALOG))
        assert outcome == "decoded" and cpu <= CPU
        entries = sum(spec.numel for spec in CATALOG.values())
        # The documented bound: a few words per allowed entry plus the input.
        assert peak <= 40 * entries + 16 * len(data), (version, peak)


# ------------------------------------------------------------------------------------------
# Control messages


def _adversarial_frames() -> dict[str, bytes]:
    rng = random.Random(11)
    enc = msgspec.msgpack.encode
    tag = MESSAGES[0].__name__
    return {
        "random": rng.randbytes(INPUT),
        "nested arrays": b"\x95" + b"\x91" * (INPUT - 1),
        "nested maps": b"\x95\x01" + b"\x81\xc0" * ((INPUT - 2) // 2),
        "huge declared array": b"\x95\x01\xa4GateOpen\x01\xa1x\xdd\xff\xff\xff\xff",
        "huge declared string": b"\x95\x01\xdb\xff\xff\xff\xff",
        "many nils": b"\x95\x01" + b"\xdc\xff\xff" + b"\xc0" * 65530,
        "long sender": enc([1, tag, 1, "x" * (INPUT - 64), {}]),
        "many fields": enc([1, tag, 1, "rx", {f"f{i}": i for i in range(6000)}]),
        "long tag": enc([1, "T" * (INPUT - 32), 1, "rx", {}]),
        "deep body": enc([1, "GateOpen", 1, "rx", 0])[:-1] + b"\x91" * (INPUT - 40) + b"\xc0",
    }


@pytest.mark.parametrize("name", list(_adversarial_frames()))
def test_no_small_control_frame_costs_more_than_the_bound(name: str) -> None:
    data = _adversarial_frames()[name]
    assert len(data) <= INPUT
    codec = ControlCodec()
    peak, cpu, outcome = _cost(lambda: codec.decode(data))
    assert outcome != "decoded", name
    assert peak <= MEMORY, (name, peak)
    assert cpu <= CPU / 10, (name, cpu)
