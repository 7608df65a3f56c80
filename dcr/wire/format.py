"""The payload format: constants, the header layout and the types both directions share
(paper App. D).

A payload is a fixed little-endian header followed by one zstd frame, the *body*.  The body holds
a per-item metadata table, one shared location buffer and one shared value buffer; the header
carries the attempt, owner and payload ids, the codec, the value layout, the lengths and a
BLAKE2b-128 digest that binds the header to the compressed body.  ``docs/wire-format.md``
specifies every byte.  :mod:`dcr.wire.encode` writes payloads, :mod:`dcr.wire.decode` reads and
checks them.
"""

from __future__ import annotations

import enum
import hashlib
import struct
from dataclasses import dataclass

from dcr.delta.records import Item
from dcr.errors import ConfigError

__all__ = [
    "BODY_PREAMBLE",
    "CODEC_ZSTD",
    "DEFAULT_LAYOUT",
    "DEFAULT_LEVEL",
    "DIGEST_OFFSET",
    "DIGEST_SIZE",
    "FLAG_FINAL",
    "FORMAT_VERSION",
    "HEADER_FIELDS",
    "HEADER_SIZE",
    "ITEM_ENTRY",
    "MAGIC",
    "U32",
    "U64",
    "WORD_WIDTHS",
    "DecodeLimits",
    "Payload",
    "PayloadHeader",
    "ValueLayout",
    "payload_digest",
]

MAGIC = b"DCRP"
FORMAT_VERSION = 1
CODEC_ZSTD = 1
FLAG_FINAL = 0x0001
DIGEST_SIZE = 16
DEFAULT_LEVEL = 1
"""zstd level of :func:`~dcr.wire.encode.encode_payload` (ARCHITECTURE.md §10)."""

HEADER_FIELDS = struct.Struct("<4sHHQIIBBHiIIQQ")
"""The fixed header up to the digest: magic, version, flags, attempt, owner, payload id, codec,
layout, reserved u16, level, item count, reserved u32, body length, compressed length."""
DIGEST_OFFSET = HEADER_FIELDS.size
HEADER_SIZE = DIGEST_OFFSET + DIGEST_SIZE
"""Bytes before the compressed body (72)."""

BODY_PREAMBLE = struct.Struct("<QQQ")
"""Body preamble: byte lengths of the item table, the location buffer and the value buffer."""
ITEM_ENTRY = struct.Struct("<HBBBBQQQ")
"""Fixed part of one item table entry: name length, dtype code, encoding, location kind, ndim,
entry count, location field (run start or gap offset), value offset.  Shape and name follow."""

WORD_WIDTHS = (1, 2, 4, 8)
"""Word widths of the location and value buffers' width classes, in buffer order."""
U32 = (1 << 32) - 1
U64 = (1 << 64) - 1


class ValueLayout(enum.IntEnum):
    """How the location and value buffers store their words.  Values are wire codes.

    Both buffers hold one *width class* per word width (1, 2, 4, 8 bytes, ascending), each an
    ``n x width`` byte matrix of the class's words in item order.
    """

    PLAIN = 0
    """Row-major: little-endian words one after another (the paper's layout)."""
    BYTEPLANE = 1
    """Column-major: byte 0 of every word in the class, then byte 1, ... (smaller after zstd)."""


DEFAULT_LAYOUT = ValueLayout.BYTEPLANE
"""Byte planes won on every workload measured (``docs/wire-format.md``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PayloadHeader:
    """Identity of a payload, plus the fields :func:`~dcr.wire.decode.read_header` found on
    the wire.

    ``payload_id`` is the payload's sequence number within its owner's attempt; receivers apply
    payloads in the declared order ``(payload_id, owner)``.  ``final`` marks the owner's last
    payload of the attempt.  The fields after ``final`` are ``None`` in a header built for
    :func:`~dcr.wire.encode.encode_payload` (which computes them) and filled in by
    :func:`~dcr.wire.decode.read_header`.
    """

    attempt: int
    owner: int
    payload_id: int
    final: bool = False
    layout: ValueLayout | None = None
    level: int | None = None
    n_items: int | None = None
    body_bytes: int | None = None
    """Length of the decompressed body."""
    compressed_bytes: int | None = None
    """Length of the compressed body (the payload is ``HEADER_SIZE`` bytes longer)."""
    digest: bytes | None = None

    def __post_init__(self) -> None:
        for field, value, top in (
            ("attempt", self.attempt, U64),
            ("owner", self.owner, U32),
            ("payload_id", self.payload_id, U32),
        ):
            if not 0 <= value <= top:
                raise ConfigError(f"{field} {value} is outside [0, {top}]", attempt=self.attempt)

    @property
    def key(self) -> tuple[int, int, int]:
        """``(attempt, owner, payload_id)``: what receivers deduplicate on."""
        return (self.attempt, self.owner, self.payload_id)

    @property
    def order(self) -> tuple[int, int]:
        """``(payload_id, owner)``: the declared application order within an attempt."""
        return (self.payload_id, self.owner)


@dataclass(frozen=True, slots=True, kw_only=True)
class Payload:
    """A fully validated, decoded payload; items keep their encoded order."""

    header: PayloadHeader
    items: tuple[Item, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodeLimits:
    """Upper bounds a receiver enforces before it trusts or allocates anything.

    The defaults admit a whole-tensor overwrite of a multi-GB embedding (tensors are never split
    across payloads) while bounding what one payload can make a receiver allocate.
    """

    max_payload_bytes: int = (4 << 30) + (32 << 20)
    """Whole payload as received: the body limit plus zstd's worst-case expansion."""
    max_body_bytes: int = 4 << 30
    """Declared decompressed body length (checked before decompressing)."""
    max_items: int = 1 << 20
    max_name_bytes: int = 1024
    """UTF-8 bytes of one tensor name."""
    max_ndim: int = 8
    max_numel: int = 1 << 48
    """Elements of one tensor, the product of its shape."""

    def __post_init__(self) -> None:
        for field in (
            "max_payload_bytes",
            "max_body_bytes",
            "max_items",
            "max_name_bytes",
            "max_ndim",
            "max_numel",
        ):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"DecodeLimits.{field} must be a positive int, got {value!r}")


def payload_digest(fixed: bytes | memoryview, compressed: bytes | memoryview) -> bytes:
    """BLAKE2b-128 over the header bytes before the digest, then the compressed body."""
    h = hashlib.blake2b(digest_size=DIGEST_SIZE)
    h.update(fixed)
    h.update(compressed)
    return h.digest()
