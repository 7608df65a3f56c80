"""The strict payload decoder (paper App. D): bytes received from the network into a
:class:`~dcr.wire.format.Payload`, or a rejection.

Decoding is strict and all-or-nothing: every length, offset, count, code, name, shape and index
is checked against :class:`~dcr.wire.format.DecodeLimits` and, when given, the receiver's
prewarm metadata before anything is returned, and any failure raises
:class:`~dcr.errors.PayloadRejected` naming the check.

Cost is bounded by the input: the header is checked first (with a catalog, the item count and
the body length against what the catalog allows), then the body is decompressed as a stream,
part by part -- the preamble, the table (bounded by the item count), and only then the buffers,
whose sizes the checked table implies.  Decoded entries are compact (one indices array, one
value array per width, :class:`~dcr.wire.format.Items`); version 2 checks its item records with
array operations, never a Python object per item.  Received bytes are never unpickled.
"""

from __future__ import annotations

import hmac
import math
import struct
from collections.abc import Container, Mapping
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import torch
import zstandard

from dcr import native
from dcr.errors import PayloadRejected
from dcr.tensors.bits import DTYPE_CODES, DTYPE_FROM_CODE, dtype_name, numpy_bits_dtype
from dcr.tensors.ordered import ULP_DTYPES
from dcr.tensors.records import Encoding, TensorSpec
from dcr.wire.format import (
    BODY_PREAMBLE,
    CODEC_ZSTD,
    DIGEST_OFFSET,
    FLAG_BLAKE3,
    FLAG_FINAL,
    FLAGS_KNOWN,
    HEADER_FIELDS,
    HEADER_SIZE,
    ITEM_ENTRY,
    ITEM_RECORD,
    MAGIC,
    PREAMBLE_V2,
    SUPPORTED_VERSIONS,
    TENSOR_ENTRY,
    V1,
    WINDOW_LOG_MAX,
    WORD_WIDTHS,
    DecodeLimits,
    Items,
    Payload,
    PayloadHeader,
    ValueLayout,
    payload_digest,
)
from dcr.wire.locations import (
    GAP_WIDTHS,
    V1_KINDS,
    V2_KINDS,
    LocationKind,
    check_run,
    decode_gaps,
)
from dcr.wire.planes import join_planes, word_dtype
from dcr.wire.split import (
    GAP_CAP,
    VALUE_CAP,
    remainder_bytes,
    unpack_bits,
    unpack_nibbles,
    unzigzag,
)

__all__ = ["decode_payload", "read_header"]

_NATIVE_WORDS = {dt: np.dtype(numpy_bits_dtype(dt)) for dt in DTYPE_CODES}
_V1_ENCODINGS = frozenset({int(Encoding.XOR), int(Encoding.OVERWRITE)})
_V2_ENCODINGS = frozenset(int(e) for e in Encoding)
_LAYOUT_CODES = frozenset(int(v) for v in ValueLayout)
_DEFAULT_LIMITS = DecodeLimits()


@dataclass(frozen=True, slots=True, kw_only=True)
class _Framing:
    """The checked header fields the body decoder needs."""

    version: int
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

    if version not in SUPPORTED_VERSIONS:
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
        name = "BLAKE3" if flags & FLAG_BLAKE3 else "BLAKE2b-128"
        raise reject(f"{name} digest mismatch", "digest")
    # The digest holds, so what follows was produced by the sender, not damaged in transit.
    if flags & ~FLAGS_KNOWN:
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
    framing = _Framing(
        version=version, layout=ValueLayout(layout), n_items=n_items, body_bytes=body_bytes
    )
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


_RLE_OR_RAW = (0, 1)


def _frame_end(compressed: memoryview) -> int | None:
    """Length of the zstd frame at the start of ``compressed`` from its block headers
    (RFC 8878 §3.1.1), or ``None`` when it is not a complete frame.  O(blocks)."""
    try:
        pos = zstandard.frame_header_size(compressed)
    except zstandard.ZstdError:
        return None
    size = len(compressed)
    if pos > size or size < 5:
        return None
    checksum = bool(compressed[4] & 0x04)
    while True:
        if pos + 3 > size:
            return None
        header = compressed[pos] | compressed[pos + 1] << 8 | compressed[pos + 2] << 16
        pos += 3
        block_type = (header >> 1) & 3
        pos += 1 if block_type == 1 else header >> 3
        if block_type == 3 or pos > size:
            return None
        if header & 1:
            break
    return pos + 4 if checksum else pos


class _Body:
    """The decompressed body, read part by part; never more than asked for is allocated.

    A frame that states its content size (it must equal the declared body length) is
    decompressed as a stream; a version 1 frame that does not is decompressed at once into a
    buffer of the declared length, as it always was.
    """

    def __init__(self, compressed: memoryview, size: int, attempt: int, version: int) -> None:
        self.attempt = attempt
        self.remaining = size
        self._stream: Any = None
        self._flat: bytes | None = None
        self._pos = 0
        try:
            frame = zstandard.get_frame_parameters(compressed)
        except zstandard.ZstdError as exc:
            raise self.reject(f"not a zstd frame: {exc}") from exc
        end = _frame_end(compressed)
        if end is None:
            raise self.reject("not one complete zstd frame")
        if end != len(compressed):
            raise self.reject(f"{len(compressed) - end} bytes after the zstd frame")
        known = frame.content_size != zstandard.CONTENTSIZE_UNKNOWN
        if known and frame.content_size != size:
            raise self.reject(
                f"zstd frame holds {frame.content_size} bytes, header declares {size}"
            )
        if version != V1:
            if not known:
                raise self.reject("the zstd frame does not state its content size")
            if frame.window_size > 1 << WINDOW_LOG_MAX:
                raise self.reject(f"zstd window of {frame.window_size} bytes")
        if known:
            self._stream = zstandard.ZstdDecompressor().stream_reader(
                compressed, read_across_frames=False
            )
        else:
            try:
                self._flat = zstandard.ZstdDecompressor().decompress(
                    compressed, max_output_size=size, allow_extra_data=False
                )
            except zstandard.ZstdError as exc:
                raise self.reject(f"zstd: {exc}") from exc
            if len(self._flat) != size:
                raise self.reject(f"decompressed {len(self._flat)} bytes, header declares {size}")

    def reject(self, message: str) -> PayloadRejected:
        return PayloadRejected(message, attempt=self.attempt, check="decompress")

    def read(self, n: int) -> npt.NDArray[np.uint8]:
        """The next ``n`` body bytes (the caller has checked ``n`` against ``remaining``)."""
        assert 0 <= n <= self.remaining
        if self._flat is not None:
            self.remaining -= n
            out = np.frombuffer(self._flat, dtype=np.uint8, count=n, offset=self._pos)
            self._pos += n
            return out
        buf = np.empty(n, dtype=np.uint8)
        self.read_into(buf)
        return buf

    def read_into(self, buf: npt.NDArray[np.uint8]) -> None:
        """The next ``len(buf)`` body bytes into ``buf`` (C-contiguous; length checked by the
        caller against ``remaining``)."""
        n = int(buf.shape[0])
        assert 0 <= n <= self.remaining
        if self._flat is not None:
            buf[...] = self.read(n)
            return
        self.remaining -= n
        view = memoryview(buf.data)
        got = 0
        try:
            while got < n:
                k = self._stream.readinto(view[got:])
                if not k:
                    raise self.reject("the zstd frame ends before the declared body length")
                got += k
        except zstandard.ZstdError as exc:
            raise self.reject(f"zstd: {exc}") from exc

    def finish(self) -> None:
        """Check that the whole body was consumed and the frame ends there."""
        assert self.remaining == 0
        if self._stream is not None:
            try:
                extra = self._stream.read(1)
            except zstandard.ZstdError as exc:
                raise self.reject(f"zstd: {exc}") from exc
            if extra:
                raise self.reject("the zstd frame holds more than the declared body length")


@dataclass(frozen=True, slots=True, kw_only=True)
class _Entry:
    """One parsed, checked version 1 item table entry."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    encoding: Encoding
    kind: LocationKind
    count: int
    numel: int
    location: int
    value: int


def _reject(attempt: int, message: str, check: str, tensor: str | None = None) -> PayloadRejected:
    return PayloadRejected(message, attempt=attempt, tensor=tensor, check=check)


def _check_tensor(
    name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    *,
    attempt: int,
    limits: DecodeLimits,
    catalog: Mapping[str, TensorSpec] | None,
) -> int:
    """``numel`` of a tensor after the checks every version makes; raises on failure."""
    numel = math.prod(shape)
    if numel > limits.max_numel:
        raise _reject(
            attempt, f"shape {list(shape)} exceeds {limits.max_numel} elements", "shape", name
        )
    if catalog is not None:
        spec = catalog.get(name)
        if spec is None:
            raise _reject(attempt, "tensor is not in the receiver's catalog", "name", name)
        if spec.dtype != dtype:
            raise _reject(
                attempt,
                f"dtype {dtype_name(dtype)} does not match {dtype_name(spec.dtype)}",
                "dtype",
                name,
            )
        if tuple(spec.shape) != shape:
            raise _reject(
                attempt, f"shape {list(shape)} does not match {list(spec.shape)}", "shape", name
            )
    return numel


class _Chunks:
    """A length-limited region of the body, read in chunks of at most 64 KiB beyond what is
    asked for, so that a long table is never held whole."""

    _CHUNK = 64 << 10

    def __init__(self, body: _Body, size: int) -> None:
        self.body = body
        self.left = size
        self.buf = b""
        self.pos = 0

    def take(self, k: int) -> bytes | None:
        """The next ``k`` bytes, or ``None`` if the region ends first."""
        have = len(self.buf) - self.pos
        if k > have + self.left:
            return None
        if k > have:
            more = min(self.left, max(k - have, self._CHUNK))
            self.buf = self.buf[self.pos :] + self.body.read(more).tobytes()
            self.left -= more
            self.pos = 0
        out = self.buf[self.pos : self.pos + k]
        self.pos += k
        return out

    @property
    def rest(self) -> int:
        return len(self.buf) - self.pos + self.left


def _parse_table(
    table: _Chunks,
    n_items: int,
    *,
    attempt: int,
    limits: DecodeLimits,
    catalog: Mapping[str, TensorSpec] | None,
    xor_allowed: Container[str] | None,
) -> tuple[list[_Entry], dict[int, int], dict[int, int]]:
    """Parse ``n_items`` version 1 table entries from ``table``, checking each one.

    Offsets must equal the running word count of their width class (canonical packing), so the
    buffers are tiled exactly, without holes or overlaps.  Returns the entries and the word
    totals of the gap and value width classes.
    """
    entries: list[_Entry] = []
    gap_next = dict.fromkeys(WORD_WIDTHS, 0)
    value_next = dict.fromkeys(WORD_WIDTHS, 0)
    per_name: dict[str, list[int]] = {}
    for i in range(n_items):
        fixed = table.take(ITEM_ENTRY.size)
        if fixed is None:
            raise _reject(attempt, f"item table ends inside entry {i}", "schema")
        name_len, code, enc, kind_code, ndim, count, location, value = ITEM_ENTRY.unpack(fixed)
        if name_len > limits.max_name_bytes or name_len == 0:
            raise _reject(
                attempt,
                f"entry {i}: name of {name_len} bytes (limit {limits.max_name_bytes})",
                "name",
            )
        if ndim > limits.max_ndim:
            raise _reject(
                attempt,
                f"entry {i}: {ndim} dimensions exceed the limit of {limits.max_ndim}",
                "shape",
            )
        rest = table.take(8 * ndim + name_len)
        if rest is None:
            raise _reject(attempt, f"item table ends inside entry {i}", "schema")
        shape: tuple[int, ...] = struct.unpack_from(f"<{ndim}Q", rest)
        try:
            name = rest[8 * ndim :].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _reject(attempt, f"entry {i}: name is not valid UTF-8", "name") from exc

        dtype = DTYPE_FROM_CODE.get(code)
        if dtype is None:
            raise _reject(attempt, f"unknown dtype code {code}", "dtype", name)
        if enc not in _V1_ENCODINGS:
            raise _reject(attempt, f"unknown encoding {enc}", "encoding", name)
        if kind_code not in V1_KINDS:
            raise _reject(attempt, f"unknown location kind {kind_code}", "encoding", name)
        encoding = Encoding(enc)
        kind = LocationKind(kind_code)
        numel = _check_tensor(name, shape, dtype, attempt=attempt, limits=limits, catalog=catalog)
        if xor_allowed is not None and encoding is Encoding.XOR and name not in xor_allowed:
            raise _reject(
                attempt,
                "XOR entry for a tensor whose loader path does not allow XOR",
                "classification",
                name,
            )
        if count > numel:
            raise _reject(attempt, f"{count} entries exceed {numel} elements", "bounds", name)
        seen = per_name.setdefault(name, [0, 0])
        seen[0] += 1
        seen[1] += count
        if seen[0] > limits.max_items_per_tensor:
            raise _reject(
                attempt,
                f"more than {limits.max_items_per_tensor} items for one tensor",
                "oversized",
                name,
            )
        if seen[1] > numel:
            raise _reject(
                attempt, f"{seen[1]} entries in one payload exceed {numel} elements", "bounds", name
            )
        if kind is not LocationKind.RUN:
            gap_width = GAP_WIDTHS[kind]
            if location != gap_next[gap_width]:
                raise _reject(
                    attempt,
                    f"gap offset {location}, expected {gap_next[gap_width]}",
                    "bounds",
                    name,
                )
            gap_next[gap_width] += count
        width = _NATIVE_WORDS[dtype].itemsize
        if value != value_next[width]:
            raise _reject(
                attempt, f"value offset {value}, expected {value_next[width]}", "bounds", name
            )
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
    if table.rest:
        raise _reject(attempt, f"{table.rest} bytes after the last item table entry", "schema")
    return entries, gap_next, value_next


def _class_matrices(
    data: npt.NDArray[np.uint8], totals: dict[int, int], layout: ValueLayout
) -> dict[int, npt.NDArray[np.uint8]]:
    """``(n, width)`` (plain) or ``(width, n)`` (byte planes) views of each class in ``data``."""
    matrices: dict[int, npt.NDArray[np.uint8]] = {}
    offset = 0
    for width in WORD_WIDTHS:
        n = totals[width]
        flat = data[offset : offset + n * width]
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


def _class_words(
    data: npt.NDArray[np.uint8], totals: dict[int, int], layout: ValueLayout
) -> dict[int, npt.NDArray[np.unsignedinteger[Any]]]:
    """Every width class of ``data`` as one native word array per width."""
    return {
        w: _words(m, 0, totals[w], np.dtype(f"u{w}"), layout)
        for w, m in _class_matrices(data, totals, layout).items()
    }


_JOIN = 1 << 22
"""Bytes of one byte plane read at once while words are joined from their planes."""


def _read_words(
    body: _Body, totals: dict[int, int], layout: ValueLayout
) -> dict[int, npt.NDArray[np.unsignedinteger[Any]]]:
    """Every width class of the next ``sum(w * totals[w])`` body bytes as one native word
    array per width, read straight into the words (a byte plane a piece at a time): the
    classes are never held twice."""
    out: dict[int, npt.NDArray[np.unsignedinteger[Any]]] = {}
    for w in WORD_WIDTHS:
        n = totals[w]
        words = np.empty(n, dtype=word_dtype(w))
        raw = words.view(np.uint8)
        if layout is ValueLayout.PLAIN or w == 1:
            body.read_into(raw)
        else:
            matrix = raw.reshape(n, w)
            for b in range(w):
                for lo in range(0, n, _JOIN):
                    matrix[lo : lo + _JOIN, b] = body.read(min(_JOIN, n - lo))
        out[w] = words.astype(np.dtype(f"u{w}"), copy=False)
    return out


def _catalog_body_bound(
    catalog: Mapping[str, TensorSpec], limits: DecodeLimits, version: int, n_items: int
) -> int:
    """Largest body the catalog allows for ``n_items`` items (each name's entries in one
    payload are at most its element count)."""
    entries = sum(spec.numel for spec in catalog.values())
    meta = 8 * limits.max_ndim + limits.max_name_bytes
    if version == V1:
        return BODY_PREAMBLE.size + n_items * (ITEM_ENTRY.size + meta) + 16 * entries
    # symbols, remainders and escapes of a gap and of a value, or a value word
    return (
        PREAMBLE_V2.size
        + n_items * (ITEM_RECORD.itemsize + TENSOR_ENTRY.size + meta)
        + 34 * entries
    )


def decode_payload(
    data: bytes | bytearray | memoryview,
    *,
    catalog: Mapping[str, TensorSpec] | None = None,
    limits: DecodeLimits = _DEFAULT_LIMITS,
    xor_allowed: Container[str] | None = None,
) -> Payload:
    """Fully decode and validate a payload, or raise :class:`PayloadRejected`.

    ``catalog`` (the receiver's prewarm metadata) requires every item's name to be known and its
    shape and dtype to match exactly, and bounds the item count and the body length before
    anything is decompressed; ``xor_allowed`` names the tensors whose loader path allows
    relative (XOR and ULP) entries.  The items are an :class:`~dcr.wire.format.Items`: compact
    arrays owned by the payload, :class:`~dcr.tensors.records.Item` views made on demand.
    """
    view = _as_bytes_view(data)
    header, framing = _read_header(view, limits)
    attempt = header.attempt
    n_items = framing.n_items
    if catalog is not None:
        allowed = len(catalog) * limits.max_items_per_tensor
        if n_items > allowed:
            raise _reject(
                attempt,
                f"{n_items} items exceed {allowed} for a catalog of {len(catalog)} tensors",
                "oversized",
            )
        bound = _catalog_body_bound(catalog, limits, framing.version, n_items)
        if framing.body_bytes > bound:
            raise _reject(
                attempt,
                f"body of {framing.body_bytes} bytes exceeds the {bound} the catalog allows",
                "oversized",
            )
    body = _Body(view[HEADER_SIZE:], framing.body_bytes, attempt, framing.version)
    args = (body, framing, attempt, limits, catalog, xor_allowed)
    items = _decode_v1(*args) if framing.version == V1 else _decode_v2(*args)
    body.finish()
    return Payload(header=header, items=items)


def _decode_v1(
    body: _Body,
    framing: _Framing,
    attempt: int,
    limits: DecodeLimits,
    catalog: Mapping[str, TensorSpec] | None,
    xor_allowed: Container[str] | None,
) -> Items:
    if body.remaining < BODY_PREAMBLE.size:
        raise _reject(attempt, f"body of {body.remaining} bytes cannot hold its preamble", "schema")
    table_bytes, location_bytes, value_bytes = BODY_PREAMBLE.unpack(
        body.read(BODY_PREAMBLE.size).tobytes()
    )
    if table_bytes + location_bytes + value_bytes != body.remaining:
        raise _reject(attempt, "preamble lengths do not add up to the body length", "schema")
    most = framing.n_items * (ITEM_ENTRY.size + 8 * limits.max_ndim + limits.max_name_bytes)
    if table_bytes > most:
        raise _reject(attempt, f"item table of {table_bytes} bytes exceeds {most}", "schema")
    entries, gap_totals, value_totals = _parse_table(
        _Chunks(body, table_bytes),
        framing.n_items,
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
            raise _reject(
                attempt, f"items need {needed} {buffer} bytes, buffer has {declared}", "bounds"
            )

    layout = framing.layout
    gaps = _class_matrices(body.read(location_bytes), gap_totals, layout)
    values = _read_words(body, value_totals, layout)
    tensors: dict[tuple[str, tuple[int, ...], torch.dtype], int] = {}
    n = len(entries)
    tensor = np.empty(n, dtype=np.int64)
    count = np.array([e.count for e in entries], dtype=np.int64)
    is_run = np.array([e.kind is LocationKind.RUN for e in entries], dtype=bool)
    run = np.full(n, -1, dtype=np.int64)
    start = np.zeros(n, dtype=np.int64)
    np.cumsum(np.where(is_run, 0, count)[:-1], out=start[1:])
    indices = np.empty(int(count[~is_run].sum()), dtype=np.int64)
    for i, e in enumerate(entries):
        tensor[i] = tensors.setdefault((e.name, e.shape, e.dtype), len(tensors))
        if e.kind is LocationKind.RUN:
            check_run(e.location, e.count, e.numel, attempt=attempt, tensor=e.name)
            run[i] = e.location
        else:
            s = int(start[i])
            width = GAP_WIDTHS[e.kind]
            words = _words(gaps[width], e.location, e.count, word_dtype(width), layout)
            indices[s : s + e.count] = decode_gaps(words, e.numel, attempt=attempt, tensor=e.name)
        if e.dtype == torch.bool and e.count:
            vals = values[1][e.value : e.value + e.count]
            if int(vals.max()) > 1:
                raise _reject(attempt, "bool value other than 0 or 1", "bounds", e.name)
    return Items(
        verified=True,
        tensors=list(tensors),
        tensor=tensor,
        encoding=np.array([int(e.encoding) for e in entries], dtype=np.int64),
        start=start,
        count=count,
        value_start=np.array([e.value for e in entries], dtype=np.int64),
        indices=indices,
        values={w: v for w, v in values.items() if v.shape[0]},
        run=run,
    )


_U64 = np.uint64
_TOP = float(1 << 62)


def _decode_v2(
    body: _Body,
    framing: _Framing,
    attempt: int,
    limits: DecodeLimits,
    catalog: Mapping[str, TensorSpec] | None,
    xor_allowed: Container[str] | None,
) -> Items:
    n_items = framing.n_items
    layout = framing.layout

    def reject(message: str, check: str, item: int | None = None) -> PayloadRejected:
        tensor = None if item is None else tensors[int(records["tensor"][item])][0]
        return _reject(attempt, message, check, tensor)

    if body.remaining < PREAMBLE_V2.size:
        raise _reject(attempt, f"body of {body.remaining} bytes cannot hold its preamble", "schema")
    n_tensors, reserved, tensor_bytes, n_loc_esc, n_val_esc = PREAMBLE_V2.unpack(
        body.read(PREAMBLE_V2.size).tobytes()
    )
    if reserved:
        raise _reject(attempt, "reserved preamble field is not zero", "schema")
    if n_tensors > n_items or (n_items and not n_tensors):
        raise _reject(attempt, f"{n_tensors} tensors for {n_items} items", "schema")
    if n_items > n_tensors * limits.max_items_per_tensor:
        raise _reject(
            attempt,
            f"{n_items} items for {n_tensors} tensors exceed {limits.max_items_per_tensor} each",
            "oversized",
        )
    most = n_tensors * (TENSOR_ENTRY.size + 8 * limits.max_ndim + limits.max_name_bytes)
    if tensor_bytes > most:
        raise _reject(attempt, f"tensor list of {tensor_bytes} bytes exceeds {most}", "schema")
    record_bytes = n_items * ITEM_RECORD.itemsize
    if tensor_bytes + record_bytes > body.remaining:
        raise _reject(attempt, "the body ends inside the item records", "schema")

    # -- the tensor list: one Python step per distinct tensor ------------------------------
    raw = body.read(tensor_bytes).tobytes()
    tensors: list[tuple[str, tuple[int, ...], torch.dtype]] = []
    numels = np.empty(n_tensors, dtype=np.int64)
    widths = np.empty(n_tensors, dtype=np.int64)
    float_ok = np.empty(n_tensors, dtype=bool)
    relative_ok = np.empty(n_tensors, dtype=bool)
    is_bool = np.empty(n_tensors, dtype=bool)
    names: set[str] = set()
    pos = 0
    for t in range(n_tensors):
        if pos + TENSOR_ENTRY.size > tensor_bytes:
            raise _reject(attempt, f"tensor list ends inside tensor {t}", "schema")
        name_len, code, ndim = TENSOR_ENTRY.unpack_from(raw, pos)
        pos += TENSOR_ENTRY.size
        if name_len > limits.max_name_bytes or name_len == 0:
            raise _reject(
                attempt,
                f"tensor {t}: name of {name_len} bytes (limit {limits.max_name_bytes})",
                "name",
            )
        if ndim > limits.max_ndim:
            raise _reject(
                attempt,
                f"tensor {t}: {ndim} dimensions exceed the limit of {limits.max_ndim}",
                "shape",
            )
        if pos + 8 * ndim + name_len > tensor_bytes:
            raise _reject(attempt, f"tensor list ends inside tensor {t}", "schema")
        shape: tuple[int, ...] = struct.unpack_from(f"<{ndim}Q", raw, pos)
        pos += 8 * ndim
        try:
            name = raw[pos : pos + name_len].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _reject(attempt, f"tensor {t}: name is not valid UTF-8", "name") from exc
        pos += name_len
        if name in names:
            raise _reject(attempt, "tensor listed twice", "name", name)
        names.add(name)
        dtype = DTYPE_FROM_CODE.get(code)
        if dtype is None:
            raise _reject(attempt, f"unknown dtype code {code}", "dtype", name)
        elements = _check_tensor(
            name, shape, dtype, attempt=attempt, limits=limits, catalog=catalog
        )
        if elements >= 1 << 63:
            raise _reject(attempt, f"shape {list(shape)} has 2**63 elements or more", "shape", name)
        numels[t] = elements
        widths[t] = _NATIVE_WORDS[dtype].itemsize
        float_ok[t] = dtype in ULP_DTYPES
        relative_ok[t] = xor_allowed is None or name in xor_allowed
        is_bool[t] = dtype == torch.bool
        tensors.append((name, shape, dtype))
    if pos != tensor_bytes:
        raise _reject(attempt, f"{tensor_bytes - pos} bytes after the last tensor", "schema")

    # -- item records, checked as arrays ---------------------------------------------------
    records = np.frombuffer(body.read(record_bytes), dtype=ITEM_RECORD)
    tid = records["tensor"].astype(np.int64)
    if n_items and int(tid.max()) >= n_tensors:
        raise _reject(attempt, "item names a tensor outside the list", "schema")
    per_tensor = np.bincount(tid, minlength=n_tensors)
    if n_tensors and int(per_tensor.min()) == 0:
        raise _reject(attempt, "a listed tensor has no item", "schema")
    if n_tensors and int(per_tensor.max()) > limits.max_items_per_tensor:
        raise reject(
            f"more than {limits.max_items_per_tensor} items for one tensor",
            "oversized",
            int(np.flatnonzero(per_tensor[tid] > limits.max_items_per_tensor)[0]),
        )
    enc = records["encoding"]
    kind = records["kind"]
    lk = records["location_k"].astype(np.int64)
    vk = records["value_k"].astype(np.int64)

    def first(mask: npt.NDArray[np.bool_]) -> int | None:
        hits = np.flatnonzero(mask)
        return int(hits[0]) if hits.shape[0] else None

    def require(mask: npt.NDArray[np.bool_], message: str, check: str) -> None:
        bad = first(~mask)
        if bad is not None:
            raise reject(f"item {bad}: {message}", check, bad)

    require(np.isin(enc, list(_V2_ENCODINGS)), "unknown encoding", "encoding")
    require(np.isin(kind, list(V2_KINDS)), "unknown location kind", "encoding")
    ulp = enc == int(Encoding.ULP)
    require(~ulp | float_ok[tid], "ULP entries for a tensor that is not a float", "encoding")
    relative = enc != int(Encoding.OVERWRITE)
    require(
        ~relative | relative_ok[tid],
        "relative entry for a tensor whose loader path does not allow XOR or ULP",
        "classification",
    )
    count_u = records["count"]
    numel = numels[tid]
    require(count_u <= numel.astype(_U64), "more entries than elements", "bounds")
    count = count_u.astype(np.int64)
    sums = np.bincount(tid, weights=count.astype(np.float64), minlength=n_tensors)
    if n_tensors and float(sums.max()) > _TOP:
        raise _reject(attempt, "entries in one payload exceed the tensor's elements", "bounds")
    exact = np.zeros(n_tensors, dtype=np.int64)
    np.add.at(exact, tid, count)
    over = np.flatnonzero(exact > numels)
    if over.shape[0]:
        raise _reject(
            attempt,
            "entries in one payload exceed the tensor's elements",
            "bounds",
            tensors[int(over[0])][0],
        )
    rice = kind == int(LocationKind.RICE)
    start_u = records["start"]
    require(rice | (lk == 0), "a run has a Rice parameter", "schema")
    require(~rice | (count >= 2), "Rice locations of fewer than two entries", "schema")
    require(lk <= 63, "Rice parameter above 63", "schema")
    require((ulp & (count > 0)) | (vk == 0), "a value parameter without ULP values", "schema")
    require(vk < 8 * widths[tid], "value parameter exceeds the word", "schema")
    # A run lies in the tensor; an empty run starts at 0; Rice locations start inside it.
    run_end_ok = start_u <= (numel - count).astype(_U64)
    require(rice | run_end_ok, "run exceeds the tensor", "bounds")
    require((count > 0) | (start_u == 0), "an empty run must start at 0", "bounds")
    require(~rice | (start_u < numel.astype(_U64)), "first index outside the tensor", "bounds")

    # -- the sizes the records imply, checked before reading any buffer --------------------
    gaps_n = np.where(rice, count - 1, 0)
    n_gaps = int(gaps_n.sum())
    item_width = widths[tid]
    word_items = ~ulp
    val_words = {w: int(count[word_items & (item_width == w)].sum()) for w in WORD_WIDTHS}
    ulp_n = np.where(ulp, count, 0)
    n_ulp = int(ulp_n.sum())
    loc_ks = _per_k(lk, gaps_n)
    val_ks = _per_k(vk, ulp_n)
    if n_loc_esc > n_gaps or n_val_esc > n_ulp:
        raise _reject(attempt, "more escapes than symbols", "bounds")
    esc_loc = {**dict.fromkeys(WORD_WIDTHS, 0), 8: n_loc_esc}
    esc_val = {**dict.fromkeys(WORD_WIDTHS, 0), 8: n_val_esc}
    sizes = [
        n_gaps,
        sum(remainder_bytes(m, k) for k, m in loc_ks.items()),
        8 * n_loc_esc,
        sum(w * n for w, n in val_words.items()),
        (n_ulp + 1) // 2,
        sum(remainder_bytes(m, k) for k, m in val_ks.items()),
        8 * n_val_esc,
    ]
    if sum(sizes) != body.remaining:
        raise _reject(
            attempt,
            f"items need {sum(sizes)} buffer bytes, the body has {body.remaining}",
            "bounds",
        )

    # -- locations: only Rice items list their indices; a run stays its start ------------
    listed = np.flatnonzero(rice)
    listed_count = np.where(rice, count, 0)
    n = int(listed_count.sum())
    offs = np.zeros(n_items, dtype=np.int64)
    np.cumsum(listed_count[:-1], out=offs[1:])
    run = np.where(rice, -1, start_u.astype(np.int64))

    def reject_listed(message: str, check: str, item: int | None = None) -> PayloadRejected:
        return reject(message, check, None if item is None else int(listed[item]))

    loc_sym = body.read(sizes[0])
    kernels = native.kernels
    per_listed = (count[listed], lk[listed], start_u[listed], numel[listed])
    if kernels is not None:
        indices = _locations_native(
            kernels, body, loc_sym, loc_ks, esc_loc, layout, sizes, *per_listed, n, attempt,
            reject_listed,
        )  # fmt: skip
    else:
        indices = _locations_numpy(
            body, loc_sym, loc_ks, esc_loc, layout, sizes, *per_listed, n, n_gaps,
            gaps_n[listed], attempt, reject_listed,
        )  # fmt: skip

    # -- values ----------------------------------------------------------------------------
    words = _read_words(body, val_words, layout)
    packed = body.read(sizes[4])
    if n_ulp % 2 and int(packed[-1]) >> 4:
        raise _reject(attempt, "the padding nibble of the value symbols is not zero", "schema")
    value_max = np.where(item_width == 8, -1, (1 << (8 * np.minimum(item_width, 4))) - 1)
    if kernels is not None:
        streams = _streams(body, val_ks, attempt)
        val_escs = _class_words(body.read(sizes[6]), esc_val, layout)[8]
        caps = int(np.count_nonzero((packed & 15) == VALUE_CAP))
        caps += int(np.count_nonzero((packed >> 4) == VALUE_CAP))
        _check_escapes(caps, val_escs, VALUE_CAP, reject)
        # One width for every ULP item (the usual case): the kernel writes the values
        # unzigzagged at that width, no u64 words in between.
        widths = np.unique(item_width[ulp])
        narrow = widths.shape[0] == 1
        zz = np.empty(n_ulp, dtype=np.dtype(f"u{int(widths[0])}") if narrow else _U64)
        unzigzagged = zz if narrow else None
        status, _ = kernels.join_values(
            packed, streams, np.ascontiguousarray(val_escs, dtype=_U64), count[ulp],
            vk[ulp], np.ascontiguousarray(value_max[ulp]).view(_U64), zz, narrow,
        )  # fmt: skip
        if status:
            raise _join_failure(status, None, reject)
    else:
        val_sym = unpack_nibbles(packed, n_ulp)
        assert val_sym is not None
        val_rems = _remainders(body, val_ks, attempt)
        val_escs = _class_words(body.read(sizes[6]), esc_val, layout)[8]
        zz = _join(val_sym, VALUE_CAP, val_escs, val_rems, ulp_n, vk, value_max, reject)
        unzigzagged = None
    value_start = np.zeros(n_items, dtype=np.int64)
    values: dict[int, npt.NDArray[np.unsignedinteger[Any]]] = {}
    for w in WORD_WIDTHS:
        of_width = item_width == w
        total = int(count[of_width].sum())
        if not total:
            continue
        sizes_w = count[of_width]
        starts_w = np.zeros(sizes_w.shape[0], dtype=np.int64)
        np.cumsum(sizes_w[:-1], out=starts_w[1:])
        value_start[of_width] = starts_w
        ulp_w = ulp & of_width
        if not ulp_w.any():
            out = words[w]
        else:
            if unzigzagged is not None:
                decoded = unzigzagged
            else:
                ulp_vals = (
                    zz
                    if bool(ulp_w.sum() == ulp.sum())
                    else zz[np.repeat(item_width[ulp], count[ulp]) == w]
                )
                decoded = unzigzag(ulp_vals.astype(np.dtype(f"u{w}")))
            if not (word_items & of_width).any():
                out = decoded
            else:
                out = np.empty(total, dtype=np.dtype(f"u{w}"))
                mask = np.repeat(ulp[of_width], sizes_w)
                out[mask] = decoded
                out[~mask] = words[w]
        values[w] = out
    bools = is_bool[tid] & (count > 0)
    if (
        bools.any()
        and int(values[1][np.repeat(bools[item_width == 1], count[item_width == 1])].max()) > 1
    ):
        raise _reject(attempt, "bool value other than 0 or 1", "bounds")
    return Items(
        verified=True,
        tensors=tensors,
        tensor=tid,
        encoding=enc,
        start=offs,
        count=count,
        value_start=value_start,
        indices=indices,
        values=values,
        run=run,
    )


def _remainders(
    body: _Body, ks: dict[int, int], attempt: int
) -> dict[int, npt.NDArray[np.unsignedinteger[Any]]]:
    """The remainder streams of ``ks`` (parameter -> words), read in order and unpacked."""
    out = {}
    for k, m in ks.items():
        words = unpack_bits(body.read(remainder_bytes(m, k)), k, m)
        if words is None:
            raise _reject(attempt, "a padding bit of a remainder stream is set", "schema")
        out[k] = words
    return out


def _padding_ok(stream: npt.NDArray[np.uint8], m: int, k: int) -> bool:
    """Whether the bits after the last of ``m`` ``k``-bit remainders are zero."""
    used = m * (k % 8)
    return not used % 8 or not int(stream[-1]) >> (used % 8)


def _streams(body: _Body, ks: dict[int, int], attempt: int) -> list[Any]:
    """The remainder streams of ``ks`` (parameter -> words), read in order, as the C join
    takes them: a list indexed by parameter, ``None`` where absent."""
    out: list[Any] = [None] * 64
    for k, m in ks.items():
        stream = body.read(remainder_bytes(m, k))
        if not _padding_ok(stream, m, k):
            raise _reject(attempt, "a padding bit of a remainder stream is set", "schema")
        out[k] = stream
    return out


def _check_escapes(
    caps: int, escapes: npt.NDArray[np.unsignedinteger[Any]], cap: int, reject: Any
) -> None:
    """One escape word per cap symbol, each at least the cap."""
    if caps != escapes.shape[0]:
        raise reject(f"{caps} escape symbols, {escapes.shape[0]} escape words", "bounds")
    if escapes.shape[0] and int(escapes.min()) < cap:
        raise reject("an escape word below the symbol cap", "bounds")


def _join_failure(status: int, item: int | None, reject: Any) -> PayloadRejected:
    """The rejection of a failed C join (status codes of ``dcr._kernels``)."""
    if status == 1:
        return cast(PayloadRejected, reject("a Rice-coded word exceeds its bound", "bounds"))
    if status == 2:
        return cast(PayloadRejected, reject("a position is outside the tensor", "bounds", item))
    return cast(PayloadRejected, reject("the symbol streams do not match the items", "bounds"))


def _locations_native(
    kernels: Any,
    body: _Body,
    symbols: npt.NDArray[np.uint8],
    ks: dict[int, int],
    esc_loc: dict[int, int],
    layout: ValueLayout,
    sizes: list[int],
    count: npt.NDArray[np.int64],
    lk: npt.NDArray[np.int64],
    start_u: npt.NDArray[np.uint64],
    numel: npt.NDArray[np.int64],
    n: int,
    attempt: int,
    reject: Any,
) -> npt.NDArray[np.int64]:
    """The positions of every Rice item (per-item arrays of those items) in one C pass
    (:func:`_locations_numpy` without temporaries)."""
    streams = _streams(body, ks, attempt)
    escapes = _class_words(body.read(sizes[2]), esc_loc, layout)[8]
    _check_escapes(int(np.count_nonzero(symbols == GAP_CAP)), escapes, GAP_CAP, reject)
    indices = np.empty(n, dtype=np.int64)
    status, bad = kernels.join_locations(
        symbols, streams, np.ascontiguousarray(escapes, dtype=_U64), count,
        np.ones(count.shape[0], dtype=np.int64), lk, np.ascontiguousarray(start_u, dtype=_U64),
        np.ascontiguousarray(numel, dtype=np.int64), indices,
    )  # fmt: skip
    if status:
        raise _join_failure(status, int(bad), reject)
    return indices


def _locations_numpy(
    body: _Body,
    loc_sym: npt.NDArray[np.uint8],
    loc_ks: dict[int, int],
    esc_loc: dict[int, int],
    layout: ValueLayout,
    sizes: list[int],
    count: npt.NDArray[np.int64],
    lk: npt.NDArray[np.int64],
    start_u: npt.NDArray[np.uint64],
    numel: npt.NDArray[np.int64],
    n: int,
    n_gaps: int,
    gaps_n: npt.NDArray[np.int64],
    attempt: int,
    reject: Any,
) -> npt.NDArray[np.int64]:
    """The positions of every Rice item (per-item arrays of those items): the gaps joined,
    then cumulative sums, vectorized."""
    loc_rems = _remainders(body, loc_ks, attempt)
    loc_escs = _class_words(body.read(sizes[2]), esc_loc, layout)[8]
    gaps = _join(loc_sym, GAP_CAP, loc_escs, loc_rems, gaps_n, lk, numel - 1, reject)
    offs = np.zeros(count.shape[0], dtype=np.int64)
    np.cumsum(count[:-1], out=offs[1:])
    steps = np.ones(n, dtype=_U64)
    if n_gaps:
        in_gaps = np.ones(n, dtype=bool)
        in_gaps[offs] = False
        gaps += _U64(1)
        steps[in_gaps] = gaps
        del in_gaps
    steps[offs] = start_u
    np.cumsum(steps, out=steps)
    if n:
        base = steps[offs] - start_u
        steps -= np.repeat(base, count)
    if n_gaps and float(gaps.max()) * n_gaps >= _TOP:
        # Positions could wrap around 2**64 inside an item: they must still increase.
        up = np.ones(n, dtype=bool)
        up[1:] = steps[1:] > steps[:-1]
        up[offs] = True
        if not bool(up.all()):
            bad = int(np.searchsorted(offs, int(np.flatnonzero(~up)[0]), side="right")) - 1
            raise reject("positions wrap around", "bounds", bad)
    if n:
        last = steps[offs + count - 1]
        bad_last = last >= numel.astype(_U64)
        if bool(bad_last.any()):
            raise reject(
                "a position is outside the tensor", "bounds", int(np.flatnonzero(bad_last)[0])
            )
    indices = steps.view(np.int64)
    return indices


def _per_k(ks: npt.NDArray[np.int64], sizes: npt.NDArray[np.int64]) -> dict[int, int]:
    """Rice parameter (above 0, below 64) -> words split with it, ascending."""
    totals = np.zeros(64, dtype=np.int64)
    np.add.at(totals, ks, sizes)
    return {int(k): int(totals[k]) for k in np.flatnonzero(totals) if k > 0}


def _join(
    symbols: npt.NDArray[np.uint8],
    cap: int,
    escapes: npt.NDArray[np.unsignedinteger[Any]],
    remainders: dict[int, npt.NDArray[np.unsignedinteger[Any]]],
    sizes: npt.NDArray[np.int64],
    ks: npt.NDArray[np.int64],
    limits: npt.NDArray[np.int64],
    reject: Any,
) -> npt.NDArray[np.uint64]:
    """Words from Rice-split streams: item ``i`` owns ``sizes[i]`` of them, split with
    ``ks[i]`` and each at most ``limits[i]`` (``-1``: any u64).  Raises via ``reject``."""
    q = symbols.astype(_U64)
    escaped = np.flatnonzero(symbols == cap)
    if escaped.shape[0] != escapes.shape[0]:
        raise reject(
            f"{escaped.shape[0]} escape symbols, {escapes.shape[0]} escape words", "bounds"
        )
    if escapes.shape[0]:
        if int(escapes.min()) < cap:
            raise reject("an escape word below the symbol cap", "bounds")
        q[escaped] = escapes
    members = sizes > 0
    if not members.any():
        return q
    ks_m, sizes_m = ks[members], sizes[members]
    top = limits[members].view(_U64)
    uniform = bool((ks_m == ks_m[0]).all()) and bool((top == top[0]).all())
    if uniform:
        k_e: Any = _U64(int(ks_m[0]))
        top_e: Any = top[0]
    else:
        k_e = np.repeat(ks_m.astype(_U64), sizes_m)
        top_e = np.repeat(top, sizes_m)
    if bool((q > (top_e >> k_e)).any()):
        raise reject("a Rice-coded word exceeds its bound", "bounds")
    q <<= k_e
    for k, rem in remainders.items():
        if len(remainders) == 1 and uniform:
            q |= rem
        else:
            q[np.repeat(ks_m == k, sizes_m)] |= rem
    if bool((q > top_e).any()):
        raise reject("a Rice-coded word exceeds its bound", "bounds")
    return q
