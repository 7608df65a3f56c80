"""The fixed header of a received payload (paper App. D): its framing, read and checked before
anything is decompressed.

:func:`read_header` checks the magic, the version, the lengths and the digest (with a payload
key, the keyed seal: :mod:`dcr.wire.seal`), then the fields the digest vouches for (flags,
codec, layout, reserved fields) and the item count and body length against
:class:`~dcr.wire.format.DecodeLimits`; with a catalog, :func:`check_catalog` bounds the item
count and the body length by what the catalog allows.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from dataclasses import dataclass

from dcr.errors import PayloadRejected
from dcr.tensors.records import TensorSpec
from dcr.wire.format import (
    BODY_PREAMBLE,
    CODEC_ZSTD,
    DIGEST_OFFSET,
    EXPANSION_FLOOR,
    FLAG_BLAKE3,
    FLAG_FINAL,
    FLAG_KEYED,
    FLAGS_KNOWN,
    HEADER_FIELDS,
    HEADER_SIZE,
    ITEM_ENTRY,
    ITEM_RECORD,
    ITEM_RECORD_V3,
    MAGIC,
    PREAMBLE_V2,
    SUPPORTED_VERSIONS,
    TENSOR_ENTRY,
    V1,
    V3,
    DecodeLimits,
    PayloadHeader,
    ValueLayout,
    payload_digest,
)
from dcr.wire.seal import check_key

__all__ = [
    "DEFAULT_LIMITS",
    "Framing",
    "as_bytes_view",
    "catalog_body_bound",
    "check_catalog",
    "check_expansion",
    "read_framing",
    "read_header",
]

_LAYOUT_CODES = frozenset(int(v) for v in ValueLayout)
DEFAULT_LIMITS = DecodeLimits()
"""The limits a decode checks against when none are given."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Framing:
    """The checked header fields the body decoder needs."""

    version: int
    layout: ValueLayout
    n_items: int
    body_bytes: int


def as_bytes_view(data: bytes | bytearray | memoryview) -> memoryview:
    """``data`` as a flat byte view (no copy)."""
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def read_header(
    data: bytes | bytearray | memoryview,
    *,
    limits: DecodeLimits = DEFAULT_LIMITS,
    seal_key: bytes | None = None,
) -> PayloadHeader:
    """Parse and check the fixed header and the lengths, and verify the digest.

    With ``seal_key`` (the payload key of :func:`dcr.wire.seal.seal_keys`) the payload must
    carry a keyed seal that verifies under it: an unkeyed one is refused (check
    ``unsealed``), a wrong MAC too (``digest``).  Without a key a keyed payload is refused
    (``seal-key``: it cannot be verified) and an unkeyed one is verified by its digest.

    Cheap relative to :func:`~dcr.wire.decode.decode_payload`: nothing is decompressed.  Raises
    :class:`PayloadRejected` on any failure.
    """
    return read_framing(as_bytes_view(data), limits, seal_key)[0]


def _verify_digest(view: memoryview, flags: int, seal_key: bytes | None, attempt: int) -> bytes:
    """Verify the digest field (a keyed seal with ``seal_key``), before any other field the
    digest vouches for is trusted or anything of the body is parsed; the digest."""

    def reject(message: str, check: str) -> PayloadRejected:
        return PayloadRejected(message, attempt=attempt, check=check)

    if seal_key is not None:
        seal_key = check_key(seal_key, "payload key")
    keyed = bool(flags & FLAG_KEYED)
    if keyed and not flags & FLAG_BLAKE3:
        raise reject("a keyed seal is BLAKE3's: flag bit 2 without bit 1", "schema")
    if seal_key is not None and not keyed:
        raise reject(
            "the payload is not sealed with the fleet's key (an unkeyed digest), but this "
            "receiver requires a keyed seal",
            "unsealed",
        )
    if seal_key is None and keyed:
        raise reject(
            "the payload carries a keyed seal and this receiver has no fleet secret to verify "
            "it; configure the fleet secret (fleet_secret)",
            "seal-key",
        )
    digest = bytes(view[DIGEST_OFFSET:HEADER_SIZE])
    expected = payload_digest(view[:DIGEST_OFFSET], view[HEADER_SIZE:], key=seal_key)
    if not hmac.compare_digest(digest, expected):
        if keyed:
            raise reject("keyed seal mismatch: not sealed under this fleet's secret", "digest")
        name = "BLAKE3" if flags & FLAG_BLAKE3 else "BLAKE2b-128"
        raise reject(f"{name} digest mismatch", "digest")
    return digest


def read_framing(
    view: memoryview, limits: DecodeLimits, seal_key: bytes | None = None
) -> tuple[PayloadHeader, Framing]:
    """:func:`read_header`, and the checked fields the body decoder needs."""
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
    digest = _verify_digest(view, flags, seal_key, attempt)
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
    if n_items > limits.max_items_per_byte * compressed_bytes:
        raise reject(
            f"{n_items} items in {compressed_bytes} compressed bytes exceed "
            f"{limits.max_items_per_byte} per byte (DecodeLimits.max_items_per_byte; raise it "
            "only for a sender whose items compress that well)",
            "oversized",
        )
    if body_bytes > limits.max_body_bytes:
        raise reject(f"body of {body_bytes} bytes exceeds {limits.max_body_bytes}", "oversized")
    if body_bytes < BODY_PREAMBLE.size:
        raise reject(f"body of {body_bytes} bytes cannot hold its preamble", "schema")
    framing = Framing(
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


def catalog_body_bound(
    catalog: Mapping[str, TensorSpec], limits: DecodeLimits, version: int, n_items: int
) -> int:
    """Largest body the catalog allows for ``n_items`` items (each name's entries in one
    payload are at most its element count)."""
    entries = sum(spec.numel for spec in catalog.values())
    meta = 8 * limits.max_ndim + limits.max_name_bytes
    if version == V1:
        return BODY_PREAMBLE.size + n_items * (ITEM_ENTRY.size + meta) + 16 * entries
    # symbols, remainders and escapes of a gap and of a value, or a value word
    record = ITEM_RECORD_V3 if version == V3 else ITEM_RECORD
    return PREAMBLE_V2.size + n_items * (record.itemsize + TENSOR_ENTRY.size + meta) + 34 * entries


def check_expansion(
    compressed_bytes: int, framing: Framing, attempt: int, limits: DecodeLimits
) -> None:
    """Without a catalog: bound the body by the bytes received
    (:attr:`~dcr.wire.format.DecodeLimits.max_expansion`), before anything is decompressed."""
    bound = max(limits.max_expansion * compressed_bytes, EXPANSION_FLOOR)
    if framing.body_bytes > bound:
        raise PayloadRejected(
            f"a body of {framing.body_bytes} bytes from {compressed_bytes} compressed bytes "
            f"exceeds {limits.max_expansion}:1 without a catalog (decode with the receiver's "
            "catalog, or raise DecodeLimits.max_expansion for a trusted sender)",
            check="oversized",
            attempt=attempt,
        )


def check_catalog(
    framing: Framing, attempt: int, limits: DecodeLimits, catalog: Mapping[str, TensorSpec]
) -> None:
    """Bound the item count and the body length of ``framing`` by what ``catalog`` (the
    receiver's prewarm metadata) allows, before anything is decompressed; raises
    :class:`PayloadRejected`."""
    n_items = framing.n_items
    allowed = len(catalog) * limits.max_items_per_tensor
    if n_items > allowed:
        raise PayloadRejected(
            f"{n_items} items exceed {allowed} for a catalog of {len(catalog)} tensors",
            attempt=attempt,
            check="oversized",
        )
    bound = catalog_body_bound(catalog, limits, framing.version, n_items)
    if framing.body_bytes > bound:
        raise PayloadRejected(
            f"body of {framing.body_bytes} bytes exceeds the {bound} the catalog allows",
            attempt=attempt,
            check="oversized",
        )
