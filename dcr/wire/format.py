"""The payload format: constants, the header layout and the types both directions share
(paper App. D).

A payload is a fixed little-endian header followed by one zstd frame, the *body*.  The header
carries the format version, the attempt, owner and payload ids, the codec, the value layout, the
lengths and a 128-bit digest (BLAKE3, or BLAKE2b in payloads of earlier releases) that binds
the header to the compressed body; in a fleet with a secret the digest is a keyed BLAKE3 MAC
(:data:`FLAG_KEYED`, keys from :mod:`dcr.wire.seal`), so that only the secret's holders seal.
In version 1 the body holds a per-item metadata table, one shared location buffer and one
shared value buffer; version 2 holds a tensor list, fixed-size item records and
entropy-friendly streams (Rice-split gaps, zigzagged ULP deltas); version 3 (the default) is
version 2 with longer records that carry each item's last index and, for strided rows (a
row-parallel shard sent whole), the rows' period and gap instead of a gap per entry.
``docs/wire-format.md`` specifies every byte.  :mod:`dcr.wire.encode` writes payloads,
:mod:`dcr.wire.decode` reads and checks them.
"""

from __future__ import annotations

import enum
import hashlib
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

import blake3
import numpy as np
import numpy.typing as npt
import torch

from dcr.errors import ConfigError
from dcr.tensors.bits import DTYPE_CODES, numpy_bits_dtype
from dcr.tensors.records import Encoding, Item, Span

__all__ = [
    "BODY_PREAMBLE",
    "CODEC_ZSTD",
    "DEFAULT_LAYOUT",
    "DEFAULT_LEVEL",
    "DIGEST_OFFSET",
    "DIGEST_SIZE",
    "FLAG_BLAKE3",
    "FLAG_FINAL",
    "FLAG_KEYED",
    "FLAGS_KNOWN",
    "FORMAT_VERSION",
    "HEADER_FIELDS",
    "HEADER_SIZE",
    "ITEM_ENTRY",
    "ITEM_RECORD",
    "ITEM_RECORD_V3",
    "MAGIC",
    "PREAMBLE_V2",
    "SUPPORTED_VERSIONS",
    "TENSOR_ENTRY",
    "V1",
    "V2",
    "V3",
    "WINDOW_LOG_MAX",
    "WINDOW_LOG_MAX_V1",
    "U32",
    "U64",
    "WORD_WIDTHS",
    "DecodeLimits",
    "Items",
    "Payload",
    "PayloadHeader",
    "ValueLayout",
    "payload_digest",
]

MAGIC = b"DCRP"
V1 = 1
V2 = 2
V3 = 3
FORMAT_VERSION = V3
"""The version :func:`~dcr.wire.encode.encode_payload` writes by default."""
SUPPORTED_VERSIONS = (V1, V2, V3)
"""Versions the decoder reads (and the encoder can write)."""
WINDOW_LOG_MAX = 23
"""Version 2 and 3 frames use a zstd window of at most ``2**23`` bytes (8 MiB), so a decoder's
streaming buffer stays small whatever the frame asks for.  A single-segment frame has no
window descriptor: its window is its content size."""
WINDOW_LOG_MAX_V1 = 27
"""Version 1 frames use a zstd window of at most ``2**27`` bytes (128 MiB, libzstd's default
decoding limit, which the largest level's window does not exceed); a single-segment frame's
window is its content size."""
CODEC_ZSTD = 1
FLAG_FINAL = 0x0001
FLAG_BLAKE3 = 0x0002
"""The digest is BLAKE3's first 16 bytes; without the flag it is BLAKE2b-128 (the digest of
earlier releases, which decoders still verify).  BLAKE3 hashes about 7x faster on one core."""
FLAG_KEYED = 0x0004
"""The digest is a MAC: the first 16 bytes of BLAKE3 keyed with the payload key
(:func:`dcr.wire.seal.seal_keys`) over the same bytes.  Only with :data:`FLAG_BLAKE3` set too
(flags ``0x0006``); a decoder refuses the bit alone."""
FLAGS_KNOWN = FLAG_FINAL | FLAG_BLAKE3 | FLAG_KEYED
"""Every flag bit a decoder accepts; any other set bit is a schema error."""
_FLAGS = struct.Struct("<H")
DIGEST_SIZE = 16
DEFAULT_LEVEL = 1
"""zstd level of :func:`~dcr.wire.encode.encode_payload` (``docs/architecture.md``, "Defaults")."""

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

PREAMBLE_V2 = struct.Struct("<IIQQQ")
"""Version 2 and 3 body preamble: tensor count, reserved u32, byte length of the tensor list,
location escapes, value escapes."""
TENSOR_ENTRY = struct.Struct("<HBB")
"""Fixed part of one version 2 and 3 tensor list entry: name length, dtype code, ndim.  Shape and
name follow."""
ITEM_RECORD = np.dtype(
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
"""One version 2 item record (24 bytes): tensor index, encoding, location kind, Rice parameter
of the gaps, Rice parameter of ULP values, entry count, first index."""
ITEM_RECORD_V3 = np.dtype(
    [
        ("tensor", "<u4"),
        ("encoding", "u1"),
        ("kind", "u1"),
        ("location_k", "u1"),
        ("value_k", "u1"),
        ("count", "<u8"),
        ("start", "<u8"),
        ("last", "<u8"),
        ("period", "<u8"),
        ("gap", "<u8"),
    ]
)
"""One version 3 item record (48 bytes): :data:`ITEM_RECORD`'s fields, then the item's last
flat index (0 for an empty item), and the period and gap of ROWS locations (rows of
``period`` consecutive elements, ``period + gap`` apart; both 0 for other kinds)."""

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


_ENCODINGS = tuple(Encoding(i) for i in range(len(Encoding)))


class Items(Sequence[Item]):
    """The decoded items of one payload, stored compactly: the listed indices of every item
    that is not a span, concatenated, and one concatenated value array per word width, with
    per-item offsets.

    Indexing or iterating yields :class:`~dcr.tensors.records.Item` objects whose ``indices`` and
    ``values`` are views of those arrays, or, for a run or strided rows, a
    :class:`~dcr.tensors.records.Span` (made on demand, so decoding costs no Python object per
    item and no index per span entry).
    The arrays are the decoder's own (never views of the received bytes).
    """

    __slots__ = (
        "_count",
        "_encoding",
        "_gap",
        "_period",
        "_run",
        "_start",
        "_tensor",
        "_value_start",
        "_verified",
        "indices",
        "tensors",
        "values",
    )

    def __init__(
        self,
        *,
        tensors: Sequence[tuple[str, tuple[int, ...], torch.dtype]],
        tensor: npt.NDArray[np.integer[Any]],
        encoding: npt.NDArray[np.integer[Any]],
        start: npt.NDArray[np.int64],
        count: npt.NDArray[np.int64],
        value_start: npt.NDArray[np.int64],
        indices: npt.NDArray[np.int64],
        values: dict[int, npt.NDArray[np.unsignedinteger[Any]]],
        run: npt.NDArray[np.int64] | None = None,
        period: npt.NDArray[np.int64] | None = None,
        gap: npt.NDArray[np.int64] | None = None,
        verified: bool = False,
    ) -> None:
        self.tensors = tuple(tensors)
        """``(name, shape, dtype)`` of each distinct tensor the items refer to."""
        self.indices = indices
        """The flat indices of every item that is not a span, concatenated in item order."""
        self.values = values
        """Word width -> every value of that width, concatenated in item order."""
        self._tensor = tensor.tolist()
        self._encoding = encoding.tolist()
        self._start = start.tolist()
        """Per item: where its listed indices start in ``indices``."""
        self._count = count.tolist()
        self._value_start = value_start.tolist()
        self._run = [-1] * len(self._tensor) if run is None else run.tolist()
        """Per item: the first index of a span item, ``-1`` for an item of listed indices."""
        self._period = None if period is None else period.tolist()
        """Per item: the period of a span item's rows (0 for a run); ``None``: all runs."""
        self._gap = None if gap is None else gap.tolist()
        """Per item: the gap between a span item's rows (0 for a run); ``None``: all runs."""
        self._verified = verified
        """The decoder checked every item's indices (strictly increasing, in bounds)."""

    @classmethod
    def of(cls, items: Sequence[Item]) -> Items:
        """Compact copies of ``items`` (used for payloads built in memory); run items stay
        runs, other spans are listed."""
        names: dict[tuple[str, tuple[int, ...], torch.dtype], int] = {}
        tensor, counts, widths = [], [], []
        runs = np.full(len(items), -1, dtype=np.int64)
        listed = []
        for i, it in enumerate(items):
            tensor.append(names.setdefault((it.name, tuple(it.shape), it.dtype), len(names)))
            counts.append(it.count)
            widths.append(it.values.dtype.itemsize)
            if it.span is not None and it.span.is_run:
                runs[i] = it.span.start
            else:
                listed.append(it.indices)
        count = np.array(counts, dtype=np.int64)
        start = np.zeros(len(items), dtype=np.int64)
        np.cumsum(np.where(runs < 0, count, 0)[:-1], out=start[1:])
        value_start = np.zeros(len(items), dtype=np.int64)
        values: dict[int, npt.NDArray[np.unsignedinteger[Any]]] = {}
        for w in sorted(set(widths)):
            members = [i for i, x in enumerate(widths) if x == w]
            sizes = count[members]
            offs = np.zeros(len(members), dtype=np.int64)
            np.cumsum(sizes[:-1], out=offs[1:])
            value_start[members] = offs
            values[w] = np.concatenate([items[i].values for i in members])
        return cls(
            tensors=list(names),
            tensor=np.array(tensor, dtype=np.int64),
            encoding=np.array([int(it.encoding) for it in items], dtype=np.int64),
            start=start,
            count=count,
            value_start=value_start,
            indices=np.concatenate(listed) if listed else np.empty(0, dtype=np.int64),
            values=values,
            run=runs,
        )

    def __len__(self) -> int:
        return len(self._tensor)

    def _item(self, i: int) -> Item:
        name, shape, dtype = self.tensors[self._tensor[i]]
        start, count = self._start[i], self._count[i]
        values = self.values[_WIDTHS[dtype]] if count else _EMPTY[_WIDTHS[dtype]]
        vs = self._value_start[i]
        run = self._run[i]
        span = None
        if run >= 0:
            gap = 0 if self._gap is None else self._gap[i]
            span = Span(run, self._period[i], gap) if gap and self._period else Span(run)
        return Item(
            name=name,
            shape=shape,
            dtype=dtype,
            encoding=_ENCODINGS[self._encoding[i]],
            indices=None if run >= 0 else self.indices[start : start + count],
            span=span,
            values=values[vs : vs + count],
            verified=self._verified,
        )

    @overload
    def __getitem__(self, i: int) -> Item: ...

    @overload
    def __getitem__(self, i: slice) -> tuple[Item, ...]: ...

    def __getitem__(self, i: int | slice) -> Item | tuple[Item, ...]:
        if isinstance(i, slice):
            return tuple(self._item(j) for j in range(*i.indices(len(self))))
        n = len(self)
        if not -n <= i < n:
            raise IndexError(i)
        return self._item(i % n)

    def __iter__(self) -> Iterator[Item]:
        for i in range(len(self)):
            yield self._item(i)

    def __repr__(self) -> str:
        return f"Items({len(self)} items, {sum(self._count)} entries)"


_WIDTHS: dict[torch.dtype, int] = {
    dt: np.dtype(numpy_bits_dtype(dt)).itemsize for dt in DTYPE_CODES
}
_EMPTY: dict[int, npt.NDArray[np.unsignedinteger[Any]]] = {
    w: np.empty(0, dtype=f"u{w}") for w in WORD_WIDTHS
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Payload:
    """A fully validated, decoded payload; items keep their encoded order.

    ``items`` is a sequence of :class:`~dcr.tensors.records.Item`; the decoder returns an
    :class:`Items` (compact arrays, item views made on demand).
    """

    header: PayloadHeader
    items: Sequence[Item]


EXPANSION_FLOOR = 4 << 20
"""The body a payload may always declare without a catalog (:attr:`DecodeLimits.max_expansion`)."""


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
    max_items_per_tensor: int = 64
    """Items naming one tensor in one payload.  With a catalog, a payload may hold at most
    ``len(catalog) * max_items_per_tensor`` items (an owner sends one item per tensor and
    encoding, so 3 would do; the rest is headroom)."""
    max_items_per_byte: int = 1
    """Items per byte of the compressed body: ``n_items <= max_items_per_byte *
    compressed_bytes``, checked before anything is decompressed, so that what decoding costs
    per item is bounded by the bytes received.  At zstd level 1 dcr's items take 1.6 bytes or
    more each, even dense refits of tiny constant tensors; only such payloads at level 19 or
    more, with short regular names, can need a higher limit."""

    max_expansion: int = 64
    """Without a catalog only: the body may be at most ``max(max_expansion *
    compressed_bytes, EXPANSION_FLOOR)`` bytes, checked before anything is decompressed, so
    that decoding any input costs memory and time proportional to it (at most 64 MiB and well
    under a second for an input of 64 KiB).  With a catalog the catalog bounds the body
    instead (a dense refit of a constant tensor compresses far better than 64:1).  Raise it to
    decode trusted, highly compressible payloads without their catalog."""

    def __post_init__(self) -> None:
        for field in (
            "max_payload_bytes",
            "max_body_bytes",
            "max_items",
            "max_name_bytes",
            "max_ndim",
            "max_numel",
            "max_items_per_tensor",
            "max_items_per_byte",
            "max_expansion",
        ):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"DecodeLimits.{field} must be a positive int, got {value!r}")


def payload_digest(
    fixed: bytes | memoryview, *compressed: bytes | memoryview, key: bytes | None = None
) -> bytes:
    """The 128-bit digest over the header bytes before the digest, then the compressed body
    (given whole or in consecutive pieces): with :data:`FLAG_KEYED` in the header's flags the
    keyed BLAKE3 MAC under ``key`` (the payload key, which must be given then and only then),
    else BLAKE3 when the flags hold :data:`FLAG_BLAKE3`, else BLAKE2b-128."""
    (flags,) = _FLAGS.unpack_from(fixed, 6)
    if bool(flags & FLAG_KEYED) != (key is not None):
        raise ConfigError(
            "a keyed seal needs the payload key"
            if key is None
            else "an unkeyed digest takes no key"
        )
    h: Any
    if key is not None:
        h = blake3.blake3(key=key, max_threads=1)
    elif flags & FLAG_BLAKE3:
        h = blake3.blake3(max_threads=1)
    else:
        h = hashlib.blake2b(digest_size=DIGEST_SIZE)
    h.update(fixed)
    for piece in compressed:
        h.update(piece)
    return bytes(h.digest()[:DIGEST_SIZE])
