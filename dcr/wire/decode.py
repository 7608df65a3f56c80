"""The strict payload decoder (paper App. D): bytes received from the network into a
:class:`~dcr.wire.format.Payload`, or a rejection.

Decoding is strict and all-or-nothing: every length, offset, count, code, name, shape and index
is checked against :class:`~dcr.wire.format.DecodeLimits` and, when given, the receiver's
prewarm metadata before anything is returned, and any failure raises
:class:`~dcr.errors.PayloadRejected` naming the check.  The declared body length is checked
before decompressing and bounds the output buffer (no decompression bombs); received bytes are
never unpickled.
"""

from __future__ import annotations

import hmac
import math
import struct
from collections.abc import Container, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import zstandard

from dcr.delta.bits import DTYPE_CODES, DTYPE_FROM_CODE, dtype_name, numpy_bits_dtype
from dcr.delta.records import Encoding, Item, TensorSpec
from dcr.errors import PayloadRejected
from dcr.wire.format import (
    BODY_PREAMBLE,
    CODEC_ZSTD,
    DIGEST_OFFSET,
    FLAG_FINAL,
    FORMAT_VERSION,
    HEADER_FIELDS,
    HEADER_SIZE,
    ITEM_ENTRY,
    MAGIC,
    WORD_WIDTHS,
    DecodeLimits,
    Payload,
    PayloadHeader,
    ValueLayout,
    payload_digest,
)
from dcr.wire.locations import GAP_WIDTHS, LocationKind, decode_gaps, decode_run
from dcr.wire.planes import join_planes, word_dtype

__all__ = ["decode_payload", "read_header"]

_NATIVE_WORDS = {dt: np.dtype(numpy_bits_dtype(dt)) for dt in DTYPE_CODES}
_ENCODING_CODES = frozenset(int(e) for e in Encoding)
_KIND_CODES = frozenset(int(k) for k in LocationKind)
_LAYOUT_CODES = frozenset(int(v) for v in ValueLayout)
_DEFAULT_LIMITS = DecodeLimits()


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
    data: bytes | bytearray | memoryview, *, limits: DecodeLimits = _DEFAULT_LIMITS
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
    ) = HEADER_FIELDS.unpack_from(view)

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
    digest = bytes(view[DIGEST_OFFSET:HEADER_SIZE])
    if not hmac.compare_digest(digest, payload_digest(view[:DIGEST_OFFSET], view[HEADER_SIZE:])):
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
    if body_bytes < BODY_PREAMBLE.size:
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
    """Parse ``n_items`` table entries from ``body[BODY_PREAMBLE.size:end]``, checking each one.

    Offsets must equal the running word count of their width class (canonical packing), so the
    buffers are tiled exactly, without holes or overlaps.  Returns the entries and the word
    totals of the gap and value width classes.
    """
    entries: list[_Entry] = []
    gap_next = dict.fromkeys(WORD_WIDTHS, 0)
    value_next = dict.fromkeys(WORD_WIDTHS, 0)
    pos = BODY_PREAMBLE.size
    for i in range(n_items):
        if pos + ITEM_ENTRY.size > end:
            raise PayloadRejected(
                f"item table ends inside entry {i}", attempt=attempt, check="schema"
            )
        name_len, code, enc, kind_code, ndim, count, location, value = ITEM_ENTRY.unpack_from(
            body, pos
        )
        pos += ITEM_ENTRY.size
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
    for width in WORD_WIDTHS:
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
    limits: DecodeLimits = _DEFAULT_LIMITS,
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

    table_bytes, location_bytes, value_bytes = BODY_PREAMBLE.unpack_from(body)
    if BODY_PREAMBLE.size + table_bytes + location_bytes + value_bytes != len(body):
        raise PayloadRejected(
            "preamble lengths do not add up to the body length", attempt=attempt, check="schema"
        )
    table_end = BODY_PREAMBLE.size + table_bytes
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
