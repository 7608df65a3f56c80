"""A payload decoded without a catalog and refused by the receiver costs what its input allows.

The reported case: 49 KB of format 2 with 2**20 empty item records over 16,384 one-element
tensors, decoded without a catalog and handed to ``Applier.apply_items``, which made an item
object per record (5-10 s, +257 MB) before refusing item 0's unknown name.  Now the decoder
refuses it on its header (more items than compressed bytes), and a decoded payload whose names
the receiver does not know is refused on its distinct tensors, before any item object is made.

Memory: tracemalloc's peak (Python and numpy allocations) and, for everything else (torch),
the growth of the process's peak RSS, reset through ``/proc/self/clear_refs`` where Linux
allows it.  Seconds are measured by the caller, never asserted.
"""

from __future__ import annotations

import hashlib
import struct
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard
from apply_helpers import bit_diff, catalog_of, dense_reference, snapshot

from dcr.apply import Applier
from dcr.errors import PayloadRejected
from dcr.models.families import random_state_dict, tiny_config
from dcr.wire.decode import decode_payload
from dcr.wire.format import Items

FAMILY = "llama"
CONFIG = tiny_config(FAMILY)
INPUT = 64 << 10
MIB = 1 << 20
ATTEMPT = 3

_HEADER = struct.Struct("<4sHHQIIBBHiIIQQ")  # docs/wire-format.md: the header before the digest
_PRE = struct.Struct("<IIQQQ")  # version 2 preamble
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
INT8, F32, OVERWRITE = 5, 3, 1


def _payload(tensors: int, dtype: int, numel: int, records: np.ndarray, values: bytes) -> bytes:
    """A version 2 payload of tensors ``t00000``, ``t00001``, ... (names no receiver knows)."""
    listed = b"".join(
        struct.pack("<HBBQ", 6, dtype, 1, numel) + b"t%05d" % i for i in range(tensors)
    )
    raw = _PRE.pack(tensors, 0, len(listed), 0, 0) + listed + records.tobytes() + values
    params = zstandard.ZstdCompressionParameters.from_level(
        3, window_log=23, write_content_size=True
    )
    body = zstandard.ZstdCompressor(compression_params=params).compress(raw)
    fixed = _HEADER.pack(
        b"DCRP", 2, 0, ATTEMPT, 0, 0, 1, 0, 0, 3, records.shape[0], 0, len(raw), len(body)
    )
    return fixed + hashlib.blake2b(fixed + body, digest_size=16).digest() + body


def reported_payload() -> bytes:
    """2**20 empty records, 64 on each of 16,384 one-element float32 tensors."""
    records = np.zeros(1 << 20, dtype=RECORD)
    records["tensor"] = np.repeat(np.arange(1 << 14), 64)
    records["encoding"] = OVERWRITE
    return _payload(1 << 14, F32, 1, records, b"")


def most_items_allowed() -> bytes:
    """64,000 one-entry overwrite items (64 on each of 1,000 int8 tensors of 64 elements):
    about as many as a 64 KiB input may hold, one per compressed byte."""
    tensors, n = 1000, 64_000
    records = np.zeros(n, dtype=RECORD)
    records["tensor"] = np.arange(n) % tensors
    records["encoding"] = OVERWRITE
    records["count"] = 1
    records["start"] = np.arange(n) // tensors
    values = np.zeros(n, dtype=np.uint8)
    values[:43_500] = np.random.default_rng(5).integers(0, 256, 43_500, dtype=np.uint8)
    return _payload(tensors, INT8, 64, records, values.tobytes())


def _rss_peak_reset() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _measured(run: Callable[[], object]) -> tuple[int, int | None]:
    """tracemalloc's peak and (where Linux lets us reset it) the peak RSS growth of ``run``."""
    rss = _rss_peak_reset()
    base = _status("VmRSS") if rss else 0
    tracemalloc.start()
    try:
        run()
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return peak, (_status("VmHWM") - base) if rss else None


@pytest.fixture(scope="module")
def receiver() -> tuple[Applier, torch.nn.Module]:
    w0 = random_state_dict(CONFIG, FAMILY, seed=0)
    loader = dense_reference(CONFIG, FAMILY, w0, 1, 0, extra=False)
    applier = Applier(loader, catalog_of(w0))
    applier.prewarm()
    return applier, loader.module


def test_unknown_names_are_refused_before_any_item_is_made(receiver) -> None:
    applier, module = receiver
    data = most_items_allowed()
    assert len(data) <= INPUT
    payload = decode_payload(data)  # no catalog: names are the receiver's to check
    items = payload.items
    assert isinstance(items, Items) and len(items) == 64_000 <= len(data) - 72
    before = snapshot(module)
    failures: list[PayloadRejected] = []

    def run() -> None:
        try:
            applier.apply_items(items, attempt=ATTEMPT)
        except PayloadRejected as exc:
            failures.append(exc)

    peak, rss = _measured(run)
    assert [(f.check, f.tensor) for f in failures] == [("name", "t00000")]
    # The work: nothing per item (64,000 item objects took about 25 MB).
    assert peak <= MIB, f"{peak / MIB:.1f} MiB traced"
    assert rss is None or rss <= 64 * MIB, f"{rss / MIB:.1f} MiB of RSS"
    assert bit_diff(snapshot(module), before) == []


@pytest.mark.parametrize(
    "make,check", [(reported_payload, "oversized"), (most_items_allowed, "name")]
)
def test_decode_and_refusal_together_stay_within_the_bound(receiver, make, check) -> None:
    """What a receiver that decodes without its catalog spends on a payload of at most
    64 KiB of unknown names: the reported one is refused by the decoder (it cost 126 MB to
    decode and 257 MB more to refuse), the largest the decoder allows by the receiver."""
    applier, module = receiver
    data = make()
    assert len(data) <= INPUT
    before = snapshot(module)
    failures: list[PayloadRejected] = []

    def run() -> None:
        try:
            applier.apply_items(decode_payload(data).items, attempt=ATTEMPT)
        except PayloadRejected as exc:
            failures.append(exc)

    peak, rss = _measured(run)
    assert [f.check for f in failures] == [check]
    assert peak <= 64 * MIB, f"{peak / MIB:.1f} MiB traced"
    assert rss is None or rss <= 64 * MIB, f"{rss / MIB:.1f} MiB of RSS"
    assert bit_diff(snapshot(module), before) == []
