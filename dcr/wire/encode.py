"""The payload encoder: one owner's records for one bucket into payload bytes (paper App. D).

Items are validated before anything is produced.  Version 2 (the default) writes a tensor list,
fixed-size item records, gaps Rice-split into byte symbols and remainders, ULP deltas zigzagged
and split into nibble symbols, and XOR / overwrite values as width classes; version 1 run- or
gap-codes locations and groups location and value words into width classes.  Word classes are
byte planes by default; the body is compressed with zstd and sealed with the BLAKE2b-128 digest
(:mod:`dcr.wire.format`).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import zstandard

from dcr.delta.bits import DTYPE_CODES, numpy_bits_dtype
from dcr.delta.ordered import ULP_DTYPES
from dcr.delta.records import Encoding, Item
from dcr.errors import ConfigError
from dcr.wire.format import (
    BODY_PREAMBLE,
    CODEC_ZSTD,
    DEFAULT_LAYOUT,
    DEFAULT_LEVEL,
    FLAG_FINAL,
    FORMAT_VERSION,
    HEADER_FIELDS,
    ITEM_ENTRY,
    ITEM_RECORD,
    MAGIC,
    PREAMBLE_V2,
    SUPPORTED_VERSIONS,
    TENSOR_ENTRY,
    U32,
    U64,
    V1,
    WINDOW_LOG_MAX,
    WORD_WIDTHS,
    PayloadHeader,
    ValueLayout,
    payload_digest,
)
from dcr.wire.locations import GAP_WIDTHS, LocationKind, encode_locations
from dcr.wire.planes import split_planes, word_dtype
from dcr.wire.split import (
    GAP_CAP,
    VALUE_CAP,
    gap_k,
    pack_bits,
    pack_nibbles,
    split,
    value_k,
    zigzag,
)

__all__ = ["encode_payload"]

_ZSTD_MIN_LEVEL = -(1 << 17)


def _check_level(level: int) -> None:
    if not _ZSTD_MIN_LEVEL <= level <= zstandard.MAX_COMPRESSION_LEVEL:
        raise ConfigError(
            f"zstd level {level} is outside [{_ZSTD_MIN_LEVEL}, {zstandard.MAX_COMPRESSION_LEVEL}]"
        )


_V1_ENCODINGS = (Encoding.XOR, Encoding.OVERWRITE)
_V2_ENCODINGS = tuple(Encoding)
_BITS = {dt: np.dtype(numpy_bits_dtype(dt)) for dt in DTYPE_CODES}


def _check_arrays(item: Item) -> None:
    """``Item.validate`` without its monotonicity pass, which :func:`_body_v2` does on the
    differences it computes anyway; raises :class:`ConfigError`."""
    idx, values = item.indices, item.values
    if not isinstance(idx, np.ndarray) or idx.dtype != np.int64 or idx.ndim != 1:
        raise ConfigError("indices must be a 1-D int64 array", tensor=item.name)
    bits_dtype = _BITS.get(item.dtype)
    if bits_dtype is None:
        raise ConfigError(f"dtype {item.dtype} is not supported", tensor=item.name, check="dtype")
    n = idx.shape[0]
    if not isinstance(values, np.ndarray) or values.dtype != bits_dtype or values.shape != (n,):
        raise ConfigError(f"values must be {bits_dtype.name}[{n}]", tensor=item.name)
    if n and (int(idx[0]) < 0 or int(idx[-1]) >= math.prod(item.shape)):
        raise ConfigError("index out of range", tensor=item.name, check="bounds")


def _entry_metadata(item: Item, attempt: int, version: int) -> tuple[bytes, bytes]:
    """Validated name bytes and packed shape of ``item``; raises :class:`ConfigError`.
    Version 2 leaves the check that indices increase to its caller."""
    if version == V1:
        item.validate()
    else:
        _check_arrays(item)
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
    if len(item.shape) > 0xFF or not all(0 <= d <= U64 for d in item.shape):
        raise ConfigError(
            f"shape {item.shape} cannot be encoded",
            attempt=attempt,
            tensor=item.name,
            check="shape",
        )
    allowed = _V1_ENCODINGS if version == V1 else _V2_ENCODINGS
    if item.encoding not in allowed:
        raise ConfigError(
            f"encoding {item.encoding!r} cannot be written in format version {version}",
            attempt=attempt,
            tensor=item.name,
            check="encoding",
        )
    if item.encoding is Encoding.ULP and item.dtype not in ULP_DTYPES:
        raise ConfigError(
            f"ULP encoding of a {item.dtype} tensor (floats only)",
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
    cuts: list[int] | None = None,
) -> int:
    """Write each width class of ``classes`` at ``offset`` in ``layout``; returns the end.
    ``cuts`` gets the end of every byte plane (of every class in the plain layout)."""
    for width in WORD_WIDTHS:
        arrays = classes[width]
        total = sum(int(a.shape[0]) for a in arrays)
        if cuts is not None and total:
            step = total if layout is ValueLayout.BYTEPLANE else total * width
            cuts.extend(range(offset + step, offset + total * width + 1, step))
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


Classes = dict[int, list[npt.NDArray[np.unsignedinteger[Any]]]]


def _classes() -> Classes:
    return {w: [] for w in WORD_WIDTHS}


def _class_bytes(classes: Classes) -> int:
    return sum(w * sum(int(a.shape[0]) for a in arrays) for w, arrays in classes.items())


def encode_payload(
    header: PayloadHeader,
    items: Sequence[Item],
    *,
    level: int = DEFAULT_LEVEL,
    layout: ValueLayout = DEFAULT_LAYOUT,
    version: int = FORMAT_VERSION,
) -> bytes:
    """Encode ``items`` (in order) under ``header``'s identity into payload bytes.

    Each item is checked with ``Item.validate``; a bad item raises :class:`ConfigError` and
    nothing is produced.  The fields of ``header`` after ``final`` are ignored.  ``version``
    selects the format (:data:`~dcr.wire.format.FORMAT_VERSION` by default; version 1 cannot
    carry ULP items).
    """
    attempt = header.attempt
    _check_level(level)
    try:
        layout = ValueLayout(layout)
    except ValueError as exc:
        raise ConfigError(f"unknown value layout {layout!r}", attempt=attempt) from exc
    if version not in SUPPORTED_VERSIONS:
        raise ConfigError(f"unknown format version {version!r}", attempt=attempt)
    if len(items) > U32:
        raise ConfigError(f"{len(items)} items do not fit in one payload", attempt=attempt)
    if version == V1:
        body = _body_v1(items, layout, attempt)
        compressor = zstandard.ZstdCompressor(level=level, write_content_size=True)
        compressed = compressor.compress(body.data)
    else:
        body, cuts = _body_v2(items, layout, attempt)
        compressed = _compress_sections(body, cuts, level)
    fixed = HEADER_FIELDS.pack(
        MAGIC,
        version,
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
    return b"".join((fixed, payload_digest(fixed, compressed), compressed))


_FLUSH_MIN = 512
"""Sections (byte planes, symbol streams) at least this long end a zstd block, so that each
gets Huffman tables of its own instead of sharing one with a differently distributed
neighbour."""


def _compress_sections(body: npt.NDArray[np.uint8], cuts: list[int], level: int) -> bytes:
    """One zstd frame (content size stated, window at most ``2**WINDOW_LOG_MAX``) of ``body``,
    with a block boundary at each of the section ends ``cuts`` that follows enough data."""
    size = int(body.shape[0])
    params = zstandard.ZstdCompressionParameters.from_level(level, source_size=size)
    if params.window_log > WINDOW_LOG_MAX:
        params = zstandard.ZstdCompressionParameters.from_level(
            level, source_size=size, window_log=WINDOW_LOG_MAX
        )
    compressor = zstandard.ZstdCompressor(compression_params=params).compressobj(size=size)
    out: list[bytes] = []
    view = body.data
    done = pending = 0
    for cut in [*cuts, size]:
        if cut <= done:
            continue
        out.append(compressor.compress(view[done:cut]))
        pending += cut - done
        done = cut
        if pending >= _FLUSH_MIN and cut < size:
            out.append(compressor.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK))
            pending = 0
    out.append(compressor.flush(zstandard.COMPRESSOBJ_FLUSH_FINISH))
    return b"".join(out)


def _body_v2(
    items: Sequence[Item], layout: ValueLayout, attempt: int
) -> tuple[npt.NDArray[np.uint8], list[int]]:
    """The uncompressed version 2 body of ``items`` and its section ends (byte planes
    included)."""
    tensors: dict[str, tuple[int, tuple[int, ...], Any]] = {}
    tensor_list: list[bytes] = []
    n_items = len(items)
    tensor_ids = [0] * n_items
    encodings = [0] * n_items
    kinds = [0] * n_items
    location_ks = [0] * n_items
    value_ks = [0] * n_items
    counts = [0] * n_items
    starts = [0] * n_items
    location_symbols: list[npt.NDArray[np.uint8]] = []
    location_remainders: dict[int, list[npt.NDArray[np.unsignedinteger[Any]]]] = {}
    location_escapes: list[npt.NDArray[np.unsignedinteger[Any]]] = []
    value_words = _classes()
    value_symbols: list[npt.NDArray[np.uint8]] = []
    value_remainders: dict[int, list[npt.NDArray[np.unsignedinteger[Any]]]] = {}
    value_escapes: list[npt.NDArray[np.unsignedinteger[Any]]] = []
    rice = int(LocationKind.RICE)
    ulp = Encoding.ULP
    for i, item in enumerate(items):
        name, shape = _entry_metadata(item, attempt, 2)
        known = tensors.get(item.name)
        if known is None:
            known = (len(tensors), tuple(item.shape), item.dtype)
            tensors[item.name] = known
            tensor_list.append(
                TENSOR_ENTRY.pack(len(name), DTYPE_CODES[item.dtype], len(item.shape))
                + shape
                + name
            )
        elif known[1] != tuple(item.shape) or known[2] != item.dtype:
            raise ConfigError(
                "one name with two shapes or dtypes in one payload",
                attempt=attempt,
                tensor=item.name,
                check="name",
            )
        tensor_ids[i] = known[0]
        encoding = item.encoding
        encodings[i] = int(encoding)
        idx = item.indices
        count = int(idx.shape[0])
        counts[i] = count
        if count:
            first, last = int(idx[0]), int(idx[-1])
            starts[i] = first
            if count > 1:
                gaps = np.subtract(idx[1:], idx[:-1])
                if int(gaps.min()) < 1:
                    raise ConfigError("indices must be strictly increasing", tensor=item.name)
                if last - first != count - 1:
                    kinds[i] = rice
                    k = gap_k(count, first, last)
                    location_ks[i] = k
                    words = gaps.view(np.uint64)
                    words -= np.uint64(1)
                    sym, esc, rem = split(words, k, GAP_CAP)
                    location_symbols.append(sym)
                    if esc.shape[0]:
                        location_escapes.append(esc)
                    if k:
                        location_remainders.setdefault(k, []).append(rem)
            if encoding is ulp:
                zz = zigzag(item.values)
                k = value_k(zz)
                value_ks[i] = k
                sym, esc, rem = split(zz, k, VALUE_CAP)
                value_symbols.append(sym)
                if esc.shape[0]:
                    value_escapes.append(esc)
                if k:
                    value_remainders.setdefault(k, []).append(rem)
            else:
                value_words[item.values.dtype.itemsize].append(item.values)

    records = np.zeros(n_items, dtype=ITEM_RECORD)
    for field, column in (
        ("tensor", tensor_ids),
        ("encoding", encodings),
        ("kind", kinds),
        ("location_k", location_ks),
        ("value_k", value_ks),
        ("count", counts),
        ("start", starts),
    ):
        records[field] = column
    tensor_bytes = b"".join(tensor_list)
    loc_rem = _remainder_streams(location_remainders)
    val_rem = _remainder_streams(value_remainders)
    loc_sym = _concat(location_symbols)
    val_sym = pack_nibbles(_concat(value_symbols))
    loc_esc: Classes = {**_classes(), 8: location_escapes}
    val_esc: Classes = {**_classes(), 8: value_escapes}
    n_loc_esc = sum(int(a.shape[0]) for a in location_escapes)
    n_val_esc = sum(int(a.shape[0]) for a in value_escapes)
    head = PREAMBLE_V2.size + len(tensor_bytes) + records.nbytes
    size = (
        head
        + loc_sym.shape[0]
        + sum(int(a.shape[0]) for a in loc_rem)
        + 8 * n_loc_esc
        + _class_bytes(value_words)
        + val_sym.shape[0]
        + sum(int(a.shape[0]) for a in val_rem)
        + 8 * n_val_esc
    )
    body = np.empty(size, dtype=np.uint8)
    PREAMBLE_V2.pack_into(body.data, 0, len(tensors), 0, len(tensor_bytes), n_loc_esc, n_val_esc)
    offset = PREAMBLE_V2.size
    body[offset : offset + len(tensor_bytes)] = np.frombuffer(tensor_bytes, dtype=np.uint8)
    offset += len(tensor_bytes)
    body[offset : offset + records.nbytes] = records.view(np.uint8)
    offset += records.nbytes
    cuts = [offset]
    body[offset : offset + loc_sym.shape[0]] = loc_sym
    offset += loc_sym.shape[0]
    cuts.append(offset)
    offset = _write_streams(body, offset, loc_rem, cuts)
    offset = _write_classes(body, offset, loc_esc, layout, cuts)
    offset = _write_classes(body, offset, value_words, layout, cuts)
    body[offset : offset + val_sym.shape[0]] = val_sym
    offset += val_sym.shape[0]
    cuts.append(offset)
    offset = _write_streams(body, offset, val_rem, cuts)
    offset = _write_classes(body, offset, val_esc, layout, cuts)
    assert offset == size
    return body, cuts


def _remainder_streams(
    remainders: dict[int, list[npt.NDArray[np.unsignedinteger[Any]]]],
) -> list[npt.NDArray[np.uint8]]:
    """One bit stream per Rice parameter, ascending, of every remainder with that parameter."""
    return [pack_bits(_concat(remainders[k]), k) for k in sorted(remainders)]


def _write_streams(
    body: npt.NDArray[np.uint8], offset: int, streams: list[npt.NDArray[np.uint8]], cuts: list[int]
) -> int:
    for stream in streams:
        body[offset : offset + stream.shape[0]] = stream
        offset += stream.shape[0]
        cuts.append(offset)
    return offset


def _concat(parts: list[npt.NDArray[Any]]) -> npt.NDArray[Any]:
    if not parts:
        return np.empty(0, dtype=np.uint8)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _body_v1(items: Sequence[Item], layout: ValueLayout, attempt: int) -> npt.NDArray[np.uint8]:
    """The uncompressed version 1 body of ``items``."""
    table: list[bytes] = []
    gap_classes = _classes()
    value_classes = _classes()
    gap_next = dict.fromkeys(WORD_WIDTHS, 0)
    value_next = dict.fromkeys(WORD_WIDTHS, 0)
    for item in items:
        name, shape = _entry_metadata(item, attempt, V1)
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
            ITEM_ENTRY.pack(
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
    start = BODY_PREAMBLE.size + len(table_bytes)
    body = np.empty(start + location_bytes + value_bytes, dtype=np.uint8)
    BODY_PREAMBLE.pack_into(body.data, 0, len(table_bytes), location_bytes, value_bytes)
    body[BODY_PREAMBLE.size : start] = np.frombuffer(table_bytes, dtype=np.uint8)
    end = _write_classes(body, start, gap_classes, layout)
    _write_classes(body, end, value_classes, layout)
    return body
