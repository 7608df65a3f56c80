"""The payload: the bytes one owner sends for one bucket of records (paper App. D).

A payload is a fixed little-endian header followed by one zstd frame, the *body*.  The body holds
a per-item metadata table, one shared location buffer and one shared value buffer; the header
carries the attempt, owner and payload ids, the codec, the value layout, the lengths and a
BLAKE2b-128 digest that binds the header to the compressed body.  ``docs/wire-format.md``
specifies every byte.

Decoding is strict and all-or-nothing: every length, offset, count, code, name, shape and index
is checked against :class:`DecodeLimits` and, when given, the receiver's prewarm metadata before
anything is returned, and any failure raises :class:`~dcr.errors.PayloadRejected` naming the check.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import math
import struct
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import zstandard

from dcr.delta.bits import DTYPE_CODES, DTYPE_FROM_CODE, dtype_name, numpy_bits_dtype
from dcr.delta.records import Encoding, Item, TensorSpec
from dcr.errors import ConfigError, PayloadRejected
from dcr.wire.locations import (
    GAP_WIDTHS,
    LocationKind,
    decode_gaps,
    decode_run,
    encode_locations,
)
from dcr.wire.planes import join_planes, split_planes, word_dtype

__all__ = [
    "CODEC_ZSTD",
    "DEFAULT_LAYOUT",
    "DEFAULT_LEVEL",
    "DIGEST_SIZE",
    "FLAG_FINAL",
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "MAGIC",
    "DecodeLimits",
    "Payload",
    "PayloadHeader",
    "ValueLayout",
    "decode_payload",
    "encode_payload",
    "read_header",
]

MAGIC = b"DCRP"
FORMAT_VERSION = 1
CODEC_ZSTD = 1
FLAG_FINAL = 0x0001
DIGEST_SIZE = 16
DEFAULT_LEVEL = 1
"""zstd level of :func:`encode_payload` (ARCHITECTURE.md §10)."""

# Fixed header up to the digest: magic, version, flags, attempt, owner, payload id, codec,
# layout, reserved u16, level, item count, reserved u32, body length, compressed length.
_HEADER = struct.Struct("<4sHHQIIBBHiIIQQ")
_DIGEST_OFFSET = _HEADER.size
HEADER_SIZE = _DIGEST_OFFSET + DIGEST_SIZE
"""Bytes before the compressed body (72)."""

# Body preamble: byte lengths of the item table, the location buffer and the value buffer.
_PREAMBLE = struct.Struct("<QQQ")
# Fixed part of one item table entry: name length, dtype code, encoding, location kind, ndim,
# entry count, location field (run start or gap offset), value offset.  Shape and name follow.
_ENTRY = struct.Struct("<HBBBBQQQ")

_WIDTHS = (1, 2, 4, 8)
_NATIVE_WORDS = {dt: np.dtype(numpy_bits_dtype(dt)) for dt in DTYPE_CODES}
_ENCODING_CODES = frozenset(int(e) for e in Encoding)
_KIND_CODES = frozenset(int(k) for k in LocationKind)
_U32 = (1 << 32) - 1
_U64 = (1 << 64) - 1
_ZSTD_MIN_LEVEL = -(1 << 17)


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
_LAYOUT_CODES = frozenset(int(v) for v in ValueLayout)


@dataclass(frozen=True, slots=True, kw_only=True)
class PayloadHeader:
    """Identity of a payload, plus the fields :func:`read_header` found on the wire.

    ``payload_id`` is the payload's sequence number within its owner's attempt; receivers apply
    payloads in the declared order ``(payload_id, owner)``.  ``final`` marks the owner's last
    payload of the attempt.  The fields after ``final`` are ``None`` in a header built for
    :func:`encode_payload` (which computes them) and filled in by :func:`read_header`.
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
            ("attempt", self.attempt, _U64),
            ("owner", self.owner, _U32),
            ("payload_id", self.payload_id, _U32),
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


# --------------------------------------------------------------------------------------------
# Encoding


def _check_level(level: int) -> None:
    if not _ZSTD_MIN_LEVEL <= level <= zstandard.MAX_COMPRESSION_LEVEL:
        raise ConfigError(
            f"zstd level {level} is outside [{_ZSTD_MIN_LEVEL}, {zstandard.MAX_COMPRESSION_LEVEL}]"
        )


def _entry_metadata(item: Item, attempt: int) -> tuple[bytes, bytes]:
    """Validated name bytes and packed shape of ``item``; raises :class:`ConfigError`."""
    item.validate()
    try:
        name = item.name.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ConfigError(
            "name is not valid UTF-8", attempt=attempt, tensor=item.name, check="name"
        ) from exc
    if not 0 < len(name) <= 0xFFFF:
        raise ConfigError(
            f"name must have 1..65535 UTF-8 bytes, has {len(name)}",
            attempt=attempt,
            tensor=item.name,
            check="name",
        )
    if len(item.shape) > 0xFF or not all(0 <= d <= _U64 for d in item.shape):
        raise ConfigError(
            f"shape {item.shape} cannot be encoded",
            attempt=attempt,
            tensor=item.name,
            check="shape",
        )
    if item.encoding not in (Encoding.XOR, Encoding.OVERWRITE):
        raise ConfigError(
            f"unknown encoding {item.encoding!r}",
            attempt=attempt,
            tensor=item.name,
            check="encoding",
        )
    return name, struct.pack(f"<{len(item.shape)}Q", *item.shape)


def _write_classes(
    body: npt.NDArray[np.uint8],
    offset: int,
    classes: dict[int, list[npt.NDArray[np.unsignedinteger[Any]]]],
    layout: ValueLayout,
) -> int:
    """Write each width class of ``classes`` at ``offset`` in ``layout``; returns the end."""
    for width in _WIDTHS:
        arrays = classes[width]
        total = sum(int(a.shape[0]) for a in arrays)
        region = body[offset : offset + total * width]
        start = 0
        if layout is ValueLayout.PLAIN:
            for a in arrays:
                n = int(a.shape[0])
                words = np.ascontiguousarray(a, dtype=word_dtype(width))
                region[start * width : (start + n) * width] = words.view(np.uint8)
                start += n
        else:
            matrix = region.reshape(width, total)
            for a in arrays:
                n = int(a.shape[0])
                split_planes(a, matrix[:, start : start + n])
                start += n
        offset += total * width
    return offset


def encode_payload(
    header: PayloadHeader,
    items: Sequence[Item],
    *,
    level: int = DEFAULT_LEVEL,
    layout: ValueLayout = DEFAULT_LAYOUT,
) -> bytes:
    """Encode ``items`` (in order) under ``header``'s identity into payload bytes.

    Each item is checked with ``Item.validate``; a bad item raises :class:`ConfigError` and
    nothing is produced.  The fields of ``header`` after ``final`` are ignored.
    """
    attempt = header.attempt
    _check_level(level)
    try:
        layout = ValueLayout(layout)
    except ValueError as exc:
        raise ConfigError(f"unknown value layout {layout!r}", attempt=attempt) from exc
    if len(items) > _U32:
        raise ConfigError(f"{len(items)} items do not fit in one payload", attempt=attempt)

    table: list[bytes] = []
    gap_classes: dict[int, list[npt.NDArray[np.unsignedinteger[Any]]]] = {w: [] for w in _WIDTHS}
    value_classes: dict[int, list[npt.NDArray[np.unsignedinteger[Any]]]] = {w: [] for w in _WIDTHS}
    gap_next = dict.fromkeys(_WIDTHS, 0)
    value_next = dict.fromkeys(_WIDTHS, 0)
    for item in items:
        name, shape = _entry_metadata(item, attempt)
        count = item.count
        locations = encode_locations(item.indices)
        if locations.kind is LocationKind.RUN:
            location_field = locations.start
        else:
            gap_width = GAP_WIDTHS[locations.kind]
            location_field = gap_next[gap_width]
            gap_next[gap_width] += count
            gap_classes[gap_width].append(locations.gaps)
        width = item.values.dtype.itemsize
        value_field = value_next[width]
        value_next[width] += count
        if count:
            value_classes[width].append(item.values)
        table.append(
            _ENTRY.pack(
                len(name),
                DTYPE_CODES[item.dtype],
                int(item.encoding),
                int(locations.kind),
                len(item.shape),
                count,
                location_field,
                value_field,
            )
        )
        table.append(shape)
        table.append(name)

    table_bytes = b"".join(table)
    location_bytes = sum(w * n for w, n in gap_next.items())
    value_bytes = sum(w * n for w, n in value_next.items())
    start = _PREAMBLE.size + len(table_bytes)
    body = np.empty(start + location_bytes + value_bytes, dtype=np.uint8)
    _PREAMBLE.pack_into(body.data, 0, len(table_bytes), location_bytes, value_bytes)
    body[_PREAMBLE.size : start] = np.frombuffer(table_bytes, dtype=np.uint8)
    end = _write_classes(body, start, gap_classes, layout)
    _write_classes(body, end, value_classes, layout)

    compressor = zstandard.ZstdCompressor(level=level, write_content_size=True)
    compressed = compressor.compress(body.data)
    fixed = _HEADER.pack(
        MAGIC,
        FORMAT_VERSION,
        FLAG_FINAL if header.final else 0,
        header.attempt,
        header.owner,
        header.payload_id,
        CODEC_ZSTD,
        int(layout),
        0,
        level,
        len(items),
        0,
        body.shape[0],
        len(compressed),
    )
    return b"".join((fixed, _digest(fixed, compressed), compressed))


def _digest(fixed: bytes | memoryview, compressed: bytes | memoryview) -> bytes:
    """BLAKE2b-128 over the header bytes before the digest, then the compressed body."""
    h = hashlib.blake2b(digest_size=DIGEST_SIZE)
    h.update(fixed)
    h.update(compressed)
    return h.digest()


# --------------------------------------------------------------------------------------------
# Decoding


@dataclass(frozen=True, slots=True, kw_only=True)
class _Framing:
    """The checked header fields the body decoder needs."""

    layout: ValueLayout
    n_items: int
    body_bytes: int


def _as_bytes_view(data: bytes | bytearray | memoryview) -> memoryview:
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def read_header(
    data: bytes | bytearray | memoryview, *, limits: DecodeLimits = DecodeLimits()
) -> PayloadHeader:
    """Parse and check the fixed header and the lengths, and verify the digest.

    Cheap relative to :func:`decode_payload`: nothing is decompressed.  Raises
    :class:`PayloadRejected` on any failure.
    """
    return _read_header(_as_bytes_view(data), limits)[0]


def _read_header(view: memoryview, limits: DecodeLimits) -> tuple[PayloadHeader, _Framing]:
    size = len(view)
    if size >= len(MAGIC) and bytes(view[: len(MAGIC)]) != MAGIC:
        raise PayloadRejected(f"bad magic {bytes(view[: len(MAGIC)])!r}", check="magic")
    if size < HEADER_SIZE:
        raise PayloadRejected(f"{size} bytes is shorter than the header", check="truncated")
    (
        _,
        version,
        flags,
        attempt,
        owner,
        payload_id,
        codec,
        layout,
        reserved16,
        level,
        n_items,
        reserved32,
        body_bytes,
        compressed_bytes,
    ) = _HEADER.unpack_from(view)

    def reject(message: str, check: str) -> PayloadRejected:
        return PayloadRejected(message, attempt=attempt, check=check)

    if version != FORMAT_VERSION:
        raise reject(f"format version {version} is not supported", "version")
    if size > limits.max_payload_bytes:
        raise reject(f"payload of {size} bytes exceeds {limits.max_payload_bytes}", "oversized")
    if HEADER_SIZE + compressed_bytes > size:
        raise reject(
            f"declares {compressed_bytes} compressed bytes, has {size - HEADER_SIZE}", "truncated"
        )
    if HEADER_SIZE + compressed_bytes < size:
        raise reject(f"{size - HEADER_SIZE - compressed_bytes} bytes after the body", "schema")
    digest = bytes(view[_DIGEST_OFFSET:HEADER_SIZE])
    if not hmac.compare_digest(digest, _digest(view[:_DIGEST_OFFSET], view[HEADER_SIZE:])):
        raise reject("BLAKE2b-128 digest mismatch", "digest")
    # The digest holds, so what follows was produced by the sender, not damaged in transit.
    if flags & ~FLAG_FINAL:
        raise reject(f"unknown flags {flags:#06x}", "schema")
    if codec != CODEC_ZSTD:
        raise reject(f"unknown codec {codec}", "schema")
    if layout not in _LAYOUT_CODES:
        raise reject(f"unknown value layout {layout}", "schema")
    if reserved16 or reserved32:
        raise reject("reserved header fields are not zero", "schema")
    if n_items > limits.max_items:
        raise reject(f"{n_items} items exceed the limit of {limits.max_items}", "oversized")
    if body_bytes > limits.max_body_bytes:
        raise reject(f"body of {body_bytes} bytes exceeds {limits.max_body_bytes}", "oversized")
    if body_bytes < _PREAMBLE.size:
        raise reject(f"body of {body_bytes} bytes cannot hold its preamble", "schema")
    framing = _Framing(layout=ValueLayout(layout), n_items=n_items, body_bytes=body_bytes)
    header = PayloadHeader(
        attempt=attempt,
        owner=owner,
        payload_id=payload_id,
        final=bool(flags & FLAG_FINAL),
        layout=framing.layout,
        level=level,
        n_items=n_items,
        body_bytes=body_bytes,
        compressed_bytes=compressed_bytes,
        digest=digest,
    )
    return header, framing


def _decompress(compressed: memoryview, size: int, attempt: int) -> bytes:
    """Decompress exactly ``size`` bytes from one zstd frame, never allocating more."""

    def reject(message: str) -> PayloadRejected:
        return PayloadRejected(message, attempt=attempt, check="decompress")

    try:
        frame = zstandard.get_frame_parameters(compressed)
    except zstandard.ZstdError as exc:
        raise reject(f"not a zstd frame: {exc}") from exc
    # A frame that states its content size gets an output buffer of that size, so it must
    # agree with the (already limit-checked) declared length; a frame that does not state it
    # decompresses into a buffer of the declared length and fails when it would overflow it.
    if frame.content_size != zstandard.CONTENTSIZE_UNKNOWN and frame.content_size != size:
        raise reject(f"zstd frame holds {frame.content_size} bytes, header declares {size}")
    try:
        body = zstandard.ZstdDecompressor().decompress(
            compressed, max_output_size=size, allow_extra_data=False
        )
    except zstandard.ZstdError as exc:
        raise reject(f"zstd: {exc}") from exc
    if len(body) != size:
        raise reject(f"decompressed {len(body)} bytes, header declares {size}")
    return body


@dataclass(frozen=True, slots=True, kw_only=True)
class _Entry:
    """One parsed, checked item table entry."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    encoding: Encoding
    kind: LocationKind
    count: int
    numel: int
    location: int
    value: int


def _parse_table(
    body: bytes,
    n_items: int,
    end: int,
    *,
    attempt: int,
    limits: DecodeLimits,
    catalog: Mapping[str, TensorSpec] | None,
    xor_allowed: Container[str] | None,
) -> tuple[list[_Entry], dict[int, int], dict[int, int]]:
    """Parse ``n_items`` table entries from ``body[_PREAMBLE.size:end]``, checking each one.

    Offsets must equal the running word count of their width class (canonical packing), so the
    buffers are tiled exactly, without holes or overlaps.  Returns the entries and the word
    totals of the gap and value width classes.
    """
    entries: list[_Entry] = []
    gap_next = dict.fromkeys(_WIDTHS, 0)
    value_next = dict.fromkeys(_WIDTHS, 0)
    pos = _PREAMBLE.size
    for i in range(n_items):
        if pos + _ENTRY.size > end:
            raise PayloadRejected(
                f"item table ends inside entry {i}", attempt=attempt, check="schema"
            )
        name_len, code, enc, kind_code, ndim, count, location, value = _ENTRY.unpack_from(body, pos)
        pos += _ENTRY.size
        if name_len > limits.max_name_bytes or name_len == 0:
            raise PayloadRejected(
                f"entry {i}: name of {name_len} bytes (limit {limits.max_name_bytes})",
                attempt=attempt,
                check="name",
            )
        if ndim > limits.max_ndim:
            raise PayloadRejected(
                f"entry {i}: {ndim} dimensions exceed the limit of {limits.max_ndim}",
                attempt=attempt,
                check="shape",
            )
        if pos + 8 * ndim + name_len > end:
            raise PayloadRejected(
                f"item table ends inside entry {i}", attempt=attempt, check="schema"
            )
        shape: tuple[int, ...] = struct.unpack_from(f"<{ndim}Q", body, pos)
        pos += 8 * ndim
        try:
            name = body[pos : pos + name_len].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise PayloadRejected(
                f"entry {i}: name is not valid UTF-8", attempt=attempt, check="name"
            ) from exc
        pos += name_len

        def reject(message: str, check: str, name: str = name) -> PayloadRejected:
            return PayloadRejected(message, attempt=attempt, tensor=name, check=check)

        dtype = DTYPE_FROM_CODE.get(code)
        if dtype is None:
            raise reject(f"unknown dtype code {code}", "dtype")
        if enc not in _ENCODING_CODES:
            raise reject(f"unknown encoding {enc}", "encoding")
        if kind_code not in _KIND_CODES:
            raise reject(f"unknown location kind {kind_code}", "encoding")
        encoding = Encoding(enc)
        kind = LocationKind(kind_code)
        numel = math.prod(shape)
        if numel > limits.max_numel:
            raise reject(f"shape {list(shape)} exceeds {limits.max_numel} elements", "shape")
        if catalog is not None:
            spec = catalog.get(name)
            if spec is None:
                raise reject("tensor is not in the receiver's catalog", "name")
            if spec.dtype != dtype:
                raise reject(
                    f"dtype {dtype_name(dtype)} does not match {dtype_name(spec.dtype)}", "dtype"
                )
            if tuple(spec.shape) != shape:
                raise reject(f"shape {list(shape)} does not match {list(spec.shape)}", "shape")
        if xor_allowed is not None and encoding is Encoding.XOR and name not in xor_allowed:
            raise reject(
                "XOR entry for a tensor whose loader path does not allow XOR", "classification"
            )
        if count > numel:
            raise reject(f"{count} entries exceed {numel} elements", "bounds")
        if kind is not LocationKind.RUN:
            gap_width = GAP_WIDTHS[kind]
            if location != gap_next[gap_width]:
                raise reject(f"gap offset {location}, expected {gap_next[gap_width]}", "bounds")
            gap_next[gap_width] += count
        width = _NATIVE_WORDS[dtype].itemsize
        if value != value_next[width]:
            raise reject(f"value offset {value}, expected {value_next[width]}", "bounds")
        value_next[width] += count
        entries.append(
            _Entry(
                name=name,
                shape=shape,
                dtype=dtype,
                encoding=encoding,
                kind=kind,
                count=count,
                numel=numel,
                location=location,
                value=value,
            )
        )
    if pos != end:
        raise PayloadRejected(
            f"{end - pos} bytes after the last item table entry", attempt=attempt, check="schema"
        )
    return entries, gap_next, value_next


def _class_matrices(
    body: bytes, offset: int, totals: dict[int, int], layout: ValueLayout
) -> dict[int, npt.NDArray[np.uint8]]:
    """Read-only ``(n, width)`` (plain) or ``(width, n)`` (byte planes) views of each class."""
    matrices: dict[int, npt.NDArray[np.uint8]] = {}
    for width in _WIDTHS:
        n = totals[width]
        flat = np.frombuffer(body, dtype=np.uint8, count=n * width, offset=offset)
        matrices[width] = (
            flat.reshape(n, width) if layout is ValueLayout.PLAIN else flat.reshape(width, n)
        )
        offset += n * width
    return matrices


def _words(
    matrix: npt.NDArray[np.uint8],
    start: int,
    count: int,
    dtype: np.dtype[np.unsignedinteger[Any]],
    layout: ValueLayout,
) -> npt.NDArray[np.unsignedinteger[Any]]:
    """``count`` words from ``start`` of a class matrix, copied out as native ``dtype``."""
    if layout is ValueLayout.PLAIN:
        rows = matrix[start : start + count]
        return rows.view(word_dtype(dtype.itemsize)).reshape(count).astype(dtype, copy=True)
    return join_planes(matrix[:, start : start + count], dtype)


def decode_payload(
    data: bytes | bytearray | memoryview,
    *,
    catalog: Mapping[str, TensorSpec] | None = None,
    limits: DecodeLimits = DecodeLimits(),
    xor_allowed: Container[str] | None = None,
) -> Payload:
    """Fully decode and validate a payload, or raise :class:`PayloadRejected`.

    ``catalog`` (the receiver's prewarm metadata) requires every item's name to be known and its
    shape and dtype to match exactly; ``xor_allowed`` names the tensors whose loader path allows
    XOR entries.  Returned arrays own their memory.
    """
    view = _as_bytes_view(data)
    header, framing = _read_header(view, limits)
    attempt = header.attempt
    body = _decompress(view[HEADER_SIZE:], framing.body_bytes, attempt)

    table_bytes, location_bytes, value_bytes = _PREAMBLE.unpack_from(body)
    if _PREAMBLE.size + table_bytes + location_bytes + value_bytes != len(body):
        raise PayloadRejected(
            "preamble lengths do not add up to the body length", attempt=attempt, check="schema"
        )
    table_end = _PREAMBLE.size + table_bytes
    entries, gap_totals, value_totals = _parse_table(
        body,
        framing.n_items,
        table_end,
        attempt=attempt,
        limits=limits,
        catalog=catalog,
        xor_allowed=xor_allowed,
    )
    for buffer, declared, totals in (
        ("location", location_bytes, gap_totals),
        ("value", value_bytes, value_totals),
    ):
        needed = sum(w * n for w, n in totals.items())
        if needed != declared:
            raise PayloadRejected(
                f"items need {needed} {buffer} bytes, buffer has {declared}",
                attempt=attempt,
                check="bounds",
            )

    layout = framing.layout
    gaps = _class_matrices(body, table_end, gap_totals, layout)
    values = _class_matrices(body, table_end + location_bytes, value_totals, layout)
    items: list[Item] = []
    for e in entries:
        if e.kind is LocationKind.RUN:
            indices = decode_run(e.location, e.count, e.numel, attempt=attempt, tensor=e.name)
        else:
            width = GAP_WIDTHS[e.kind]
            words = _words(gaps[width], e.location, e.count, word_dtype(width), layout)
            indices = decode_gaps(words, e.numel, attempt=attempt, tensor=e.name)
        native = _NATIVE_WORDS[e.dtype]
        vals = _words(values[native.itemsize], e.value, e.count, native, layout)
        if e.dtype == torch.bool and e.count and int(vals.max()) > 1:
            raise PayloadRejected(
                "bool value other than 0 or 1", attempt=attempt, tensor=e.name, check="bounds"
            )
        items.append(
            Item(
                name=e.name,
                shape=e.shape,
                dtype=e.dtype,
                encoding=e.encoding,
                indices=indices,
                values=vals,
            )
        )
    return Payload(header=header, items=tuple(items))
