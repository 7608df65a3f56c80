"""The body of a format version 2 or 3 payload (paper App. D) and its compression: a tensor
list, fixed-size item records, gaps Rice-split into byte symbols and remainders
(:mod:`dcr.wire.encode.streams`), ULP deltas zigzagged and split into nibble symbols, and XOR /
overwrite values as width classes.  Version 3's records also carry each item's last index and
send strided rows (a :class:`~dcr.tensors.records.Span` with a gap) as ROWS locations: the
rows' period and gap, no gap per entry.

The body is produced as sections (byte planes, symbol streams) fed to zstd piece by piece, so it
is never held whole; each long enough section ends a zstd block.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import zstandard

from dcr import native
from dcr.errors import ConfigError
from dcr.tensors.bits import DTYPE_CODES
from dcr.tensors.records import Encoding, Item
from dcr.wire.encode.items import Classes, empty_classes, entry_metadata
from dcr.wire.encode.streams import Job, split_streams
from dcr.wire.format import (
    ITEM_RECORD,
    ITEM_RECORD_V3,
    PREAMBLE_V2,
    TENSOR_ENTRY,
    V2,
    V3,
    WINDOW_LOG_MAX,
    WORD_WIDTHS,
    ValueLayout,
)
from dcr.wire.locations import LocationKind
from dcr.wire.planes import word_dtype
from dcr.wire.split import gap_k, value_k_of

__all__ = ["Section", "body_v2", "compress_sections"]


_FLUSH_MIN = 512
"""Sections (byte planes, symbol streams) at least this long end a zstd block, so that each
gets Huffman tables of its own instead of sharing one with a differently distributed
neighbour."""


def compress_sections(sections: list[Section], size: int, level: int) -> list[bytes]:
    """One zstd frame (content size stated, window at most ``2**WINDOW_LOG_MAX``) of the
    concatenated ``sections`` (``size`` bytes in all), with a block boundary at the end of
    each section that follows enough data; returns the frame in pieces.

    Each section is fed in pieces as it is produced (a byte plane is gathered a piece at a
    time), so the body is never held whole.  The sections are entropy-friendly symbol streams
    and near-uniform bits with few repeats worth a match, so at the fast levels (<= 1) the
    match finder is kept minimal (a tiny hash table, 7-byte minimum matches): zstd's Huffman
    stage does the work, 1.6x faster on gap symbols and no larger.  Other levels use zstd's
    own parameters.
    """
    tuned: dict[str, int] = {"hash_log": 6, "chain_log": 6, "min_match": 7} if level <= 1 else {}
    params = zstandard.ZstdCompressionParameters.from_level(level, source_size=size)
    if params.window_log > WINDOW_LOG_MAX:
        tuned["window_log"] = WINDOW_LOG_MAX
    if tuned:
        params = zstandard.ZstdCompressionParameters.from_level(level, source_size=size, **tuned)
    compressor = zstandard.ZstdCompressor(compression_params=params).compressobj(size=size)
    out: list[bytes] = []
    done = pending = 0
    for section in sections:
        n = section.size
        if not n:
            continue
        for piece in section.pieces():
            chunk = compressor.compress(piece.data)
            if chunk:
                out.append(chunk)
        pending += n
        done += n
        if pending >= _FLUSH_MIN and done < size:
            out.append(compressor.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK))
            pending = 0
    out.append(compressor.flush(zstandard.COMPRESSOBJ_FLUSH_FINISH))
    return out


_GATHER = 1 << 22
"""Words of a byte plane gathered at once (the piece handed to zstd)."""


@dataclass(frozen=True, slots=True)
class Section:
    """One section of a version 2 or 3 body, produced piece by piece: the bytes of ``raw``, or
    one width class of ``words`` (byte plane ``byte``, or every byte row-major when
    ``byte`` is ``None``)."""

    raw: npt.NDArray[np.uint8] | None = None
    words: tuple[npt.NDArray[np.unsignedinteger[Any]], ...] = ()
    width: int = 1
    byte: int | None = None

    @property
    def size(self) -> int:
        if self.raw is not None:
            return int(self.raw.shape[0])
        return (
            self.width * sum(int(a.shape[0]) for a in self.words)
            if self.byte is None
            else (sum(int(a.shape[0]) for a in self.words))
        )

    def pieces(self) -> Iterator[npt.NDArray[np.uint8]]:
        if self.raw is not None:
            yield self.raw
            return
        word = word_dtype(self.width)
        for a in self.words:
            le = a.astype(word, copy=False)
            if self.byte is None:
                yield np.ascontiguousarray(le).view(np.uint8)
                continue
            for lo in range(0, int(le.shape[0]), _GATHER):
                rows = le[lo : lo + _GATHER].view(np.uint8).reshape(-1, self.width)
                yield np.ascontiguousarray(rows[:, self.byte])


def _class_sections(classes: Classes, layout: ValueLayout) -> list[Section]:
    """The width classes of ``classes`` as body sections: one per byte plane, or one per
    class in the plain layout."""
    out: list[Section] = []
    for width in WORD_WIDTHS:
        arrays = tuple(a for a in classes[width] if a.shape[0])
        if not arrays:
            continue
        if layout is ValueLayout.BYTEPLANE:
            out.extend(Section(words=arrays, width=width, byte=b) for b in range(width))
        else:
            out.append(Section(words=arrays, width=width))
    return out


def body_v2(
    items: Sequence[Item], layout: ValueLayout, attempt: int, version: int = V2
) -> list[Section]:
    """The uncompressed version 2 (or, with ``version=3``, version 3) body of ``items`` as its
    sections, in order (each section ends a zstd block if it is long enough: byte planes and
    streams get Huffman tables of their own); the word classes are gathered only while they
    are compressed."""
    v3 = version == V3
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
    lasts = [0] * n_items
    periods = [0] * n_items
    gaps = [0] * n_items
    location_jobs: list[Job] = []
    value_jobs: list[Job] = []
    value_words = empty_classes()
    rice = int(LocationKind.RICE)
    rows = int(LocationKind.ROWS)
    ulp = Encoding.ULP
    kernels = native.kernels
    for i, item in enumerate(items):
        name, shape = entry_metadata(item, attempt, version)
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
        count = item.count
        counts[i] = count
        if count:
            first, last = item.bounds
            starts[i] = first
            lasts[i] = last
            span = item.span
            if v3 and span is not None and span.gap and count > span.period:
                kinds[i] = rows
                periods[i] = span.period
                gaps[i] = span.gap
            elif count > 1:
                if last - first != count - 1:
                    kinds[i] = rice
                    k = gap_k(count, first, last)
                    location_ks[i] = k
                    location_jobs.append((item.name, k, item))
                elif item.listed is not None and not _increasing(item.listed, kernels):
                    raise ConfigError(
                        "indices must be strictly increasing", attempt=attempt, tensor=item.name
                    )
            if encoding is ulp:
                k = value_k_of(item.values)
                value_ks[i] = k
                value_jobs.append((item.name, k, item.values))
            else:
                value_words[item.values.dtype.itemsize].append(item.values)

    columns = [
        ("tensor", tensor_ids),
        ("encoding", encodings),
        ("kind", kinds),
        ("location_k", location_ks),
        ("value_k", value_ks),
        ("count", counts),
        ("start", starts),
    ]
    if v3:
        columns += [("last", lasts), ("period", periods), ("gap", gaps)]
    records = np.zeros(n_items, dtype=ITEM_RECORD_V3 if v3 else ITEM_RECORD)
    for field, column in columns:
        records[field] = column
    loc = split_streams(location_jobs, gaps=True, attempt=attempt)
    val = split_streams(value_jobs, gaps=False, attempt=attempt)
    tensor_bytes = b"".join(tensor_list)
    head = bytearray(PREAMBLE_V2.size)
    PREAMBLE_V2.pack_into(
        head, 0, len(tensors), 0, len(tensor_bytes), loc.escape_count, val.escape_count
    )
    head += tensor_bytes
    head += records.tobytes()
    return [
        Section(raw=np.frombuffer(head, dtype=np.uint8)),
        Section(raw=loc.symbols),
        *(Section(raw=r) for r in loc.remainders),
        *_class_sections({**empty_classes(), 8: loc.escapes}, layout),
        *_class_sections(value_words, layout),
        Section(raw=val.symbols),
        *(Section(raw=r) for r in val.remainders),
        *_class_sections({**empty_classes(), 8: val.escapes}, layout),
    ]


def _increasing(idx: npt.NDArray[np.int64], kernels: Any) -> bool:
    if kernels is not None:
        return bool(kernels.increasing(idx))
    return bool((idx[1:] > idx[:-1]).all())
