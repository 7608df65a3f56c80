"""The payload encoder: one owner's records for one bucket into payload bytes (paper App. D).

Items are validated before anything is produced.  Version 2 (the default) writes a tensor list,
fixed-size item records, gaps Rice-split into byte symbols and remainders, ULP deltas zigzagged
and split into nibble symbols, and XOR / overwrite values as width classes; version 1 run- or
gap-codes locations and groups location and value words into width classes.  Word classes are
byte planes by default; the body is compressed with zstd and sealed with a 128-bit BLAKE3 digest
(:mod:`dcr.wire.format`).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import zstandard

from dcr import native
from dcr.errors import ConfigError
from dcr.tensors.bits import DTYPE_CODES, numpy_bits_dtype
from dcr.tensors.ordered import ULP_DTYPES
from dcr.tensors.records import Encoding, Item
from dcr.wire.format import (
    BODY_PREAMBLE,
    CODEC_ZSTD,
    DEFAULT_LAYOUT,
    DEFAULT_LEVEL,
    FLAG_BLAKE3,
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
from dcr.wire.locations import GAP_WIDTHS, LocationKind, encode_locations, encode_span
from dcr.wire.planes import split_planes, word_dtype
from dcr.wire.split import (
    GAP_CAP,
    VALUE_CAP,
    gap_k,
    pack_bits,
    pack_nibbles,
    remainder_bytes,
    split,
    value_k_of,
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
    idx, values = item.listed, item.values
    if idx is not None and (
        not isinstance(idx, np.ndarray) or idx.dtype != np.int64 or idx.ndim != 1
    ):
        raise ConfigError("indices must be a 1-D int64 array", tensor=item.name)
    bits_dtype = _BITS.get(item.dtype)
    if bits_dtype is None:
        raise ConfigError(f"dtype {item.dtype} is not supported", tensor=item.name, check="dtype")
    n = item.count
    if not isinstance(values, np.ndarray) or values.dtype != bits_dtype or values.shape != (n,):
        raise ConfigError(f"values must be {bits_dtype.name}[{n}]", tensor=item.name)
    if n:
        first, last = item.bounds
        if first < 0 or last >= math.prod(item.shape):
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


def encode_payload(
    header: PayloadHeader,
    items: Sequence[Item],
    *,
    level: int = DEFAULT_LEVEL,
    layout: ValueLayout = DEFAULT_LAYOUT,
    version: int = FORMAT_VERSION,
    digest: str = "blake3",
) -> bytes:
    """Encode ``items`` (in order) under ``header``'s identity into payload bytes.

    Each item is checked with ``Item.validate``; a bad item raises :class:`ConfigError` and
    nothing is produced.  The fields of ``header`` after ``final`` are ignored.  ``version``
    selects the format (:data:`~dcr.wire.format.FORMAT_VERSION` by default; version 1 cannot
    carry ULP items).  ``digest`` is ``"blake3"`` (the default, :data:`FLAG_BLAKE3`) or
    ``"blake2b"`` (what decoders of earlier releases verify).
    """
    attempt = header.attempt
    _check_level(level)
    try:
        layout = ValueLayout(layout)
    except ValueError as exc:
        raise ConfigError(f"unknown value layout {layout!r}", attempt=attempt) from exc
    if version not in SUPPORTED_VERSIONS:
        raise ConfigError(f"unknown format version {version!r}", attempt=attempt)
    if digest not in ("blake3", "blake2b"):
        raise ConfigError(f"unknown digest {digest!r} (blake3 or blake2b)", attempt=attempt)
    if len(items) > U32:
        raise ConfigError(f"{len(items)} items do not fit in one payload", attempt=attempt)
    if version == V1:
        body = _body_v1(items, layout, attempt)
        compressor = zstandard.ZstdCompressor(level=level, write_content_size=True)
        compressed = [compressor.compress(body.data)]
        body_size = int(body.shape[0])
        del body
    else:
        sections = _body_v2(items, layout, attempt)
        body_size = sum(sec.size for sec in sections)
        compressed = _compress_sections(sections, body_size, level)
        del sections
    fixed = HEADER_FIELDS.pack(
        MAGIC,
        version,
        (FLAG_FINAL if header.final else 0) | (FLAG_BLAKE3 if digest == "blake3" else 0),
        header.attempt,
        header.owner,
        header.payload_id,
        CODEC_ZSTD,
        int(layout),
        0,
        level,
        len(items),
        0,
        body_size,
        sum(len(c) for c in compressed),
    )
    # One join of the header and the compressed pieces: the payload is the only copy made.
    return b"".join((fixed, payload_digest(fixed, *compressed), *compressed))


_FLUSH_MIN = 512
"""Sections (byte planes, symbol streams) at least this long end a zstd block, so that each
gets Huffman tables of its own instead of sharing one with a differently distributed
neighbour."""


def _compress_sections(sections: list[_Section], size: int, level: int) -> list[bytes]:
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
class _Section:
    """One section of a version 2 body, produced piece by piece: the bytes of ``raw``, or
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


@dataclass(slots=True)
class _Streams:
    """Rice-split streams of one kind (locations or ULP values) of a payload: the symbol
    stream, one remainder stream per parameter (ascending) and the escapes in item order."""

    symbols: npt.NDArray[np.uint8]
    remainders: list[npt.NDArray[np.uint8]]
    escapes: list[npt.NDArray[np.uint64]]

    @property
    def escape_count(self) -> int:
        return sum(int(a.shape[0]) for a in self.escapes)


_Job = tuple[str, int, Item | npt.NDArray[Any]]
"""One item's words to split: tensor name (for errors), Rice parameter, and the item (whose
sorted indices give the gaps) or its ULP deltas."""

_PIECE = 1 << 20
"""Gaps of a span item split at once: its indices are generated piece by piece, never
listed whole."""


def _pieces(source: Item | npt.NDArray[Any]) -> Iterator[npt.NDArray[Any]]:
    """The arrays a job splits, in order: an item's indices (listed, or a span's in pieces
    that overlap by one index, so that every gap lies in one piece), or the ULP deltas."""
    if not isinstance(source, Item):
        yield source
    elif source.listed is not None:
        yield source.listed
    else:
        gaps = source.count - 1
        for lo in range(0, gaps, _PIECE):
            yield source.locate(lo, min(lo + _PIECE, gaps) + 1)


def _split_numpy(jobs: list[_Job], gaps: bool, attempt: int) -> _Streams:
    cap = GAP_CAP if gaps else VALUE_CAP
    symbols: list[npt.NDArray[np.uint8]] = []
    remainders: dict[int, list[npt.NDArray[np.unsignedinteger[Any]]]] = {}
    escapes: list[npt.NDArray[np.uint64]] = []
    for name, k, source in jobs:
        for array in _pieces(source):
            if gaps:
                words = np.subtract(array[1:], array[:-1])
                if int(words.min()) < 1:
                    raise ConfigError(
                        "indices must be strictly increasing", attempt=attempt, tensor=name
                    )
                words = words.view(np.uint64)
                words -= np.uint64(1)
            else:
                words = zigzag(array)
            sym, esc, rem = split(words, k, cap)
            symbols.append(sym)
            if esc.shape[0]:
                escapes.append(esc)
            if k:
                remainders.setdefault(k, []).append(rem)
    packed = _concat(symbols)
    return _Streams(
        symbols=packed if gaps else pack_nibbles(packed),
        remainders=[pack_bits(_concat(remainders[k]), k) for k in sorted(remainders)],
        escapes=escapes,
    )


def _job_size(source: Item | npt.NDArray[Any]) -> int:
    """Words a job splits: an item's gaps, or its ULP deltas."""
    return source.count - 1 if isinstance(source, Item) else int(source.shape[0])


def _split_native(jobs: list[_Job], gaps: bool, attempt: int, kernels: Any) -> _Streams:
    """:func:`_split_numpy` in C: every item's words go straight into the shared streams."""
    cap = GAP_CAP if gaps else VALUE_CAP
    per_k: dict[int, int] = {}
    for _, k, source in jobs:
        if k:
            per_k[k] = per_k.get(k, 0) + _job_size(source)
    total = sum(_job_size(source) for _, _, source in jobs)
    symbols = np.empty(total, np.uint8) if gaps else np.zeros((total + 1) // 2, np.uint8)
    streams = {k: np.zeros(remainder_bytes(n, k), np.uint8) for k, n in sorted(per_k.items())}
    empty = np.empty(0, np.uint8)
    split_fn = kernels.split_gaps if gaps else kernels.split_ulp
    escapes: list[npt.NDArray[np.uint64]] = []
    at_sym = 0
    at_rem = dict.fromkeys(per_k, 0)
    for name, k, source in jobs:
        for array in _pieces(source):
            n = int(array.shape[0]) - 1 if gaps else int(array.shape[0])
            esc = np.empty(n, np.uint64)
            n_esc = split_fn(
                array, k, cap, symbols, at_sym, streams.get(k, empty), per_k.get(k, 0),
                at_rem.get(k, 0), esc,
            )  # fmt: skip
            if n_esc < 0:
                raise ConfigError(
                    "indices must be strictly increasing", attempt=attempt, tensor=name
                )
            if n_esc:
                escapes.append(esc[:n_esc].copy())
            at_sym += n
            if k:
                at_rem[k] += n
    return _Streams(symbols=symbols, remainders=list(streams.values()), escapes=escapes)


def _split_streams(jobs: list[_Job], *, gaps: bool, attempt: int) -> _Streams:
    """The streams of ``jobs`` (gaps of sorted indices, or ULP deltas), in C when built."""
    kernels = native.kernels
    if kernels is None:
        return _split_numpy(jobs, gaps, attempt)
    return _split_native(jobs, gaps, attempt, kernels)


def _class_sections(classes: Classes, layout: ValueLayout) -> list[_Section]:
    """The width classes of ``classes`` as body sections: one per byte plane, or one per
    class in the plain layout."""
    out: list[_Section] = []
    for width in WORD_WIDTHS:
        arrays = tuple(a for a in classes[width] if a.shape[0])
        if not arrays:
            continue
        if layout is ValueLayout.BYTEPLANE:
            out.extend(_Section(words=arrays, width=width, byte=b) for b in range(width))
        else:
            out.append(_Section(words=arrays, width=width))
    return out


def _body_v2(items: Sequence[Item], layout: ValueLayout, attempt: int) -> list[_Section]:
    """The uncompressed version 2 body of ``items`` as its sections, in order (each section
    ends a zstd block if it is long enough: byte planes and streams get Huffman tables of
    their own); the word classes are gathered only while they are compressed."""
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
    location_jobs: list[_Job] = []
    value_jobs: list[_Job] = []
    value_words = _classes()
    rice = int(LocationKind.RICE)
    ulp = Encoding.ULP
    kernels = native.kernels
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
        count = item.count
        counts[i] = count
        if count:
            first, last = item.bounds
            starts[i] = first
            if count > 1:
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
    loc = _split_streams(location_jobs, gaps=True, attempt=attempt)
    val = _split_streams(value_jobs, gaps=False, attempt=attempt)
    tensor_bytes = b"".join(tensor_list)
    head = bytearray(PREAMBLE_V2.size)
    PREAMBLE_V2.pack_into(
        head, 0, len(tensors), 0, len(tensor_bytes), loc.escape_count, val.escape_count
    )
    head += tensor_bytes
    head += records.tobytes()
    return [
        _Section(raw=np.frombuffer(head, dtype=np.uint8)),
        _Section(raw=loc.symbols),
        *(_Section(raw=r) for r in loc.remainders),
        *_class_sections({**_classes(), 8: loc.escapes}, layout),
        *_class_sections(value_words, layout),
        _Section(raw=val.symbols),
        *(_Section(raw=r) for r in val.remainders),
        *_class_sections({**_classes(), 8: val.escapes}, layout),
    ]


def _increasing(idx: npt.NDArray[np.int64], kernels: Any) -> bool:
    if kernels is not None:
        return bool(kernels.increasing(idx))
    return bool((idx[1:] > idx[:-1]).all())


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
