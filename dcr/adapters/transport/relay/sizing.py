"""The largest payload an owner can produce (paper §7.2, App. D), so that a relay node can refuse
anything larger: :func:`largest_payload`, the default of a fleet's ``max_payload_bytes``.

How an owner cuts buckets (:class:`~dcr.delta.build.BuildConfig`): its shards are grouped into
chunks of at most ``chunk_bytes`` (a larger shard is a chunk of its own: tensors are never
split), residual tensors come whole, and a bucket closes once the input bytes of its
record-emitting chunks reach ``bucket_bytes``.  So a bucket holds the records of less than
``bucket_bytes`` of input plus one last chunk: ``chunk_bytes``, or the largest shard (without
the training plan: the three largest tensors together, a fused QKV shard).  One input element
yields at most ``fan`` records (2 where embeddings are tied; 2 without the plan), and no payload
carries more records than the catalog has elements.

What one record costs in a version 3 body (``docs/wire-format.md``), at most: its value (``w``
bytes for XOR and overwrite; for ULP a nibble, ``k < 8w`` remainder bits and escape words, which
the parameter keeps rare: counted as ``w + 2``) and, unless its item is a run, its location: a
gap symbol byte, ``k <= bit_length(numel) - 3`` remainder bits, and escape words, which the
Rice parameter keeps below ``8/255`` per gap (one byte more).  An item adds a 48-byte record
(at most three items per tensor, one per encoding), a tensor its list entry, a body its preamble
and the padding of its streams.  zstd's output is at most ``zstd_bound(body)`` plus a block
header per section, and the payload header is :data:`~dcr.wire.format.HEADER_SIZE` bytes.  A
receiver refuses a payload above its :class:`~dcr.wire.format.DecodeLimits` anyway, so the
bound is capped there too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from dcr.errors import ConfigError
from dcr.tensors.ordered import ULP_DTYPES
from dcr.tensors.records import TensorSpec
from dcr.wire.format import HEADER_SIZE, ITEM_RECORD_V3, PREAMBLE_V2, TENSOR_ENTRY, DecodeLimits

__all__ = ["entry_bytes", "largest_payload", "zstd_bound"]

_FUSED = 3
"""Canonical tensors one shard may span without the plan saying so (fused QKV)."""
_ENCODINGS = 3
"""Items one tensor may have in one payload: one per encoding (XOR, ULP, overwrite)."""
_SECTIONS = 2 * 64 + 16
"""Streams a body pads to a byte (remainders per Rice parameter, symbols) and sections that
may each end a zstd block (a 3-byte block header)."""
_FRAME = 18 + 4
"""A zstd frame's largest header and its checksum."""


def zstd_bound(size: int) -> int:
    """zstd's worst-case compressed size of ``size`` bytes (``ZSTD_COMPRESSBOUND``)."""
    small = ((128 << 10) - size) >> 11 if size < (128 << 10) else 0
    return size + (size >> 8) + small


def entry_bytes(spec: TensorSpec) -> int:
    """The most one record of ``spec`` costs in a body: its value plus its location."""
    w = spec.itemsize
    value = w + 2 if spec.dtype in ULP_DTYPES else w
    remainder = max(0, spec.numel.bit_length() - 3)
    return value + 1 + math.ceil(remainder / 8) + 1


def largest_payload(
    catalog: Mapping[str, TensorSpec],
    *,
    bucket_bytes: int,
    chunk_bytes: int,
    largest_shard_bytes: int | None = None,
    fan: int | None = None,
    limits: DecodeLimits | None = None,
) -> int:
    """The largest payload, in bytes, an owner building against ``catalog`` with buckets of
    ``bucket_bytes`` and chunks of ``chunk_bytes`` can produce (the module docstring derives
    it).  ``largest_shard_bytes`` is the owner's largest shard or residual tensor and ``fan``
    the most canonical tensors one of its elements lands in, from its training plan; unknown,
    they default to the three largest tensors together and 2.  Capped by ``limits`` (default
    :class:`DecodeLimits`), what receivers accept."""
    if bucket_bytes < 1 or chunk_bytes < 1:
        raise ConfigError("bucket_bytes and chunk_bytes must be positive")
    specs = list(catalog.values())
    if not specs:
        raise ConfigError("an empty catalog has no payloads")
    if largest_shard_bytes is None:
        largest_shard_bytes = sum(sorted(s.nbytes for s in specs)[-_FUSED:])
    fan = 2 if fan is None else fan
    if largest_shard_bytes < 0 or fan < 1:
        raise ConfigError("largest_shard_bytes must be >= 0 and fan >= 1")
    per_byte = max(entry_bytes(s) / max(s.itemsize, 1) for s in specs)
    inputs = bucket_bytes + max(chunk_bytes, largest_shard_bytes)
    records = min(sum(s.numel * entry_bytes(s) for s in specs), math.ceil(inputs * per_byte * fan))
    tensors = sum(TENSOR_ENTRY.size + 8 * len(s.shape) + len(s.name.encode()) for s in specs)
    items = _ENCODINGS * len(specs) * ITEM_RECORD_V3.itemsize
    body = PREAMBLE_V2.size + tensors + items + records + _SECTIONS
    payload = HEADER_SIZE + zstd_bound(body) + 3 * _SECTIONS + _FRAME
    return min(payload, (limits or DecodeLimits()).max_payload_bytes)
