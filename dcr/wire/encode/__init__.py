"""The payload encoder: one owner's records for one bucket into payload bytes (paper App. D).

Items are validated before anything is produced.  Version 2 writes a tensor list, fixed-size
item records, gaps Rice-split into byte symbols and remainders, ULP deltas zigzagged and split
into nibble symbols, and XOR / overwrite values as width classes; version 3 (the default) is
version 2 whose records also carry each item's last index and whose strided row spans travel as
ROWS locations (period and gap, no gap per entry); version 1 run- or gap-codes locations and
groups location and value words into width classes.  Word classes are
byte planes by default; the body is compressed with zstd and sealed with a 128-bit BLAKE3 digest
(:mod:`dcr.wire.format`), or, given the payload key of a fleet secret, a keyed BLAKE3 MAC
(:mod:`dcr.wire.seal`).

The item checks and width classes both versions use are :mod:`~dcr.wire.encode.items`, the
version 1 body :mod:`~dcr.wire.encode.v1`, the version 2 and 3 body and its compression
:mod:`~dcr.wire.encode.v2` (its Rice-split streams in :mod:`~dcr.wire.encode.streams`).
"""

from __future__ import annotations

from collections.abc import Sequence

import zstandard

from dcr.errors import ConfigError
from dcr.tensors.records import Item
from dcr.wire.encode.v1 import body_v1
from dcr.wire.encode.v2 import body_v2, compress_sections
from dcr.wire.format import (
    CODEC_ZSTD,
    DEFAULT_LAYOUT,
    DEFAULT_LEVEL,
    FLAG_BLAKE3,
    FLAG_FINAL,
    FLAG_KEYED,
    FORMAT_VERSION,
    HEADER_FIELDS,
    MAGIC,
    SUPPORTED_VERSIONS,
    U32,
    V1,
    PayloadHeader,
    ValueLayout,
    payload_digest,
)
from dcr.wire.seal import check_key

__all__ = ["encode_bucket", "encode_payload"]

_ZSTD_MIN_LEVEL = -(1 << 17)


def _check_level(level: int) -> None:
    if not _ZSTD_MIN_LEVEL <= level <= zstandard.MAX_COMPRESSION_LEVEL:
        raise ConfigError(
            f"zstd level {level} is outside [{_ZSTD_MIN_LEVEL}, {zstandard.MAX_COMPRESSION_LEVEL}]"
        )


def encode_payload(
    header: PayloadHeader,
    items: Sequence[Item],
    *,
    level: int = DEFAULT_LEVEL,
    layout: ValueLayout = DEFAULT_LAYOUT,
    version: int = FORMAT_VERSION,
    digest: str = "blake3",
    seal_key: bytes | None = None,
) -> bytes:
    """Encode ``items`` (in order) under ``header``'s identity into payload bytes.

    Each item is checked with ``Item.validate``; a bad item raises :class:`ConfigError` and
    nothing is produced.  The fields of ``header`` after ``final`` are ignored.  ``version``
    selects the format (:data:`~dcr.wire.format.FORMAT_VERSION` by default; version 1 cannot
    carry ULP items; versions 1 and 2 send strided row spans as gaps, one per entry).
    ``digest`` is ``"blake3"`` (the default, :data:`FLAG_BLAKE3`) or ``"blake2b"`` (what
    decoders of earlier releases verify).  ``seal_key`` (the payload key
    of :func:`dcr.wire.seal.seal_keys`) seals the payload with a keyed BLAKE3 MAC instead
    (:data:`FLAG_KEYED`; ``digest`` must be ``"blake3"``).
    """
    attempt = header.attempt
    if seal_key is not None:
        seal_key = check_key(seal_key, "payload key")
        if digest != "blake3":
            raise ConfigError("a keyed seal is BLAKE3's: digest must be 'blake3'", attempt=attempt)
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
        body = body_v1(items, layout, attempt)
        compressor = zstandard.ZstdCompressor(level=level, write_content_size=True)
        compressed = [compressor.compress(body.data)]
        body_size = int(body.shape[0])
        del body
    else:
        sections = body_v2(items, layout, attempt, version)
        body_size = sum(sec.size for sec in sections)
        compressed = compress_sections(sections, body_size, level)
        del sections
    fixed = HEADER_FIELDS.pack(
        MAGIC,
        version,
        (FLAG_FINAL if header.final else 0)
        | (FLAG_BLAKE3 if digest == "blake3" else 0)
        | (FLAG_KEYED if seal_key is not None else 0),
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
    seal = payload_digest(fixed, *compressed, key=seal_key)
    return b"".join((fixed, seal, *compressed))


def encode_bucket(
    *,
    items: Sequence[Item],
    attempt: int,
    owner: int,
    payload_id: int,
    final: bool,
    level: int = DEFAULT_LEVEL,
    layout: ValueLayout = DEFAULT_LAYOUT,
    seal_key: bytes | None = None,
) -> bytes:
    """Encode one bucket of ``items`` as the payload ``payload_id`` of ``owner`` in
    ``attempt``: the :class:`~dcr.wire.format.PayloadHeader` built from these fields
    (``final``: the owner's last payload of the attempt), then :func:`encode_payload` with
    ``level``, ``layout`` and ``seal_key`` in the default format version and digest.
    """
    header = PayloadHeader(attempt=attempt, owner=owner, payload_id=payload_id, final=final)
    return encode_payload(header, items, level=level, layout=layout, seal_key=seal_key)
