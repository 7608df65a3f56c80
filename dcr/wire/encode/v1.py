"""The body of a format version 1 payload (paper App. D): a preamble, an item table of
variable-length entries, then the location buffer (run- or gap-coded indices) and the value
buffer, each grouped into width classes (plain words or byte planes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from dcr.tensors.bits import DTYPE_CODES
from dcr.tensors.records import Item
from dcr.wire.encode.items import empty_classes, entry_metadata
from dcr.wire.format import BODY_PREAMBLE, ITEM_ENTRY, V1, WORD_WIDTHS, ValueLayout
from dcr.wire.locations import GAP_WIDTHS, LocationKind, encode_locations, encode_span
from dcr.wire.planes import split_planes, word_dtype

__all__ = ["body_v1"]


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


def body_v1(items: Sequence[Item], layout: ValueLayout, attempt: int) -> npt.NDArray[np.uint8]:
    """The uncompressed version 1 body of ``items``."""
    table: list[bytes] = []
    gap_classes = empty_classes()
    value_classes = empty_classes()
    gap_next = dict.fromkeys(WORD_WIDTHS, 0)
    value_next = dict.fromkeys(WORD_WIDTHS, 0)
    for item in items:
        name, shape = entry_metadata(item, attempt, V1)
        count = item.count
        locations = (
            encode_span(item.span, count)
            if item.span is not None
            else encode_locations(item.indices)
        )
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
