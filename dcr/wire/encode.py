"""The payload encoder: one owner's records for one bucket into payload bytes (paper App. D).

Items are validated before anything is produced; locations are run- or gap-coded, location and
value words are grouped into width classes (byte planes by default), the body is compressed
with zstd and sealed with the BLAKE2b-128 digest (:mod:`dcr.wire.format`).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import zstandard

from dcr.delta.bits import DTYPE_CODES
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
    MAGIC,
    U32,
    U64,
    WORD_WIDTHS,
    PayloadHeader,
    ValueLayout,
    payload_digest,
)
from dcr.wire.locations import GAP_WIDTHS, LocationKind, encode_locations
from dcr.wire.planes import split_planes, word_dtype

__all__ = ["encode_payload"]

_ZSTD_MIN_LEVEL = -(1 << 17)


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
    if len(item.shape) > 0xFF or not all(0 <= d <= U64 for d in item.shape):
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
    for width in WORD_WIDTHS:
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
    if len(items) > U32:
        raise ConfigError(f"{len(items)} items do not fit in one payload", attempt=attempt)

    table: list[bytes] = []
    gap_classes: dict[int, list[npt.NDArray[np.unsignedinteger[Any]]]] = {
        w: [] for w in WORD_WIDTHS
    }
    value_classes: dict[int, list[npt.NDArray[np.unsignedinteger[Any]]]] = {
        w: [] for w in WORD_WIDTHS
    }
    gap_next = dict.fromkeys(WORD_WIDTHS, 0)
    value_next = dict.fromkeys(WORD_WIDTHS, 0)
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

    compressor = zstandard.ZstdCompressor(level=level, write_content_size=True)
    compressed = compressor.compress(body.data)
    fixed = HEADER_FIELDS.pack(
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
    return b"".join((fixed, payload_digest(fixed, compressed), compressed))
