"""The strict payload decoder (paper App. D): bytes received from the network into a
:class:`~dcr.wire.format.Payload`, or a rejection.

Decoding is strict and all-or-nothing: every length, offset, count, code, name, shape and index
is checked against :class:`~dcr.wire.format.DecodeLimits` and, when given, the receiver's
prewarm metadata before anything is returned, and any failure raises
:class:`~dcr.errors.PayloadRejected` naming the check.

Cost is bounded by the input: the header is checked first (its digest -- with a payload key,
its keyed seal -- before anything else it says is trusted; the item count against the
compressed bytes received, at most one item per byte by default, so that per-item work is
bounded by the input; with a catalog, the item count and the body length against what the
catalog allows), then the body is decompressed as a stream,
part by part -- the preamble, the table (bounded by the item count), and only then the buffers,
whose sizes the checked table implies.  Decoded entries are compact (one indices array, one
value array per width, :class:`~dcr.wire.format.Items`); versions 2 and 3 check their item
records with array operations, never a Python object per item, and version 3's strided rows
decode to a :class:`~dcr.tensors.records.Span`, no index per entry.  Items of one tensor never
share a position (:mod:`~dcr.wire.decode.overlap`).  Received bytes are never unpickled.

The header is :mod:`~dcr.wire.decode.header`, the decompressed body and what both versions read
from it :mod:`~dcr.wire.decode.body`, the version 1 body :mod:`~dcr.wire.decode.v1` (its
per-item checks as arrays in :mod:`~dcr.wire.decode.gaps`), the
version 2 and 3 body :mod:`~dcr.wire.decode.v2` (its tables in :mod:`~dcr.wire.decode.records`, its
positions in :mod:`~dcr.wire.decode.positions`, its Rice-split streams joined in
:mod:`~dcr.wire.decode.rice`).
"""

from __future__ import annotations

from collections.abc import Container, Mapping

from dcr.tensors.records import TensorSpec
from dcr.wire.decode.body import Body
from dcr.wire.decode.header import (
    DEFAULT_LIMITS,
    as_bytes_view,
    check_catalog,
    check_expansion,
    read_framing,
    read_header,
)
from dcr.wire.decode.v1 import decode_v1
from dcr.wire.decode.v2 import decode_v2
from dcr.wire.format import HEADER_SIZE, V1, DecodeLimits, Payload

__all__ = ["decode_payload", "read_header"]


def decode_payload(
    data: bytes | bytearray | memoryview,
    *,
    catalog: Mapping[str, TensorSpec] | None = None,
    limits: DecodeLimits = DEFAULT_LIMITS,
    xor_allowed: Container[str] | None = None,
    seal_key: bytes | None = None,
) -> Payload:
    """Fully decode and validate a payload, or raise :class:`PayloadRejected`.

    ``catalog`` (the receiver's prewarm metadata) requires every item's name to be known and its
    shape and dtype to match exactly, and bounds the item count and the body length before
    anything is decompressed; ``xor_allowed`` names the tensors whose loader path allows
    relative (XOR and ULP) entries.  The items are an :class:`~dcr.wire.format.Items`: compact
    arrays owned by the payload, :class:`~dcr.tensors.records.Item` views made on demand.
    ``seal_key`` (the payload key of :func:`dcr.wire.seal.seal_keys`) requires a keyed seal
    that verifies, before anything of the body is read (:func:`read_header` says what is
    refused with and without one).
    """
    view = as_bytes_view(data)
    header, framing = read_framing(view, limits, seal_key)
    attempt = header.attempt
    if catalog is not None:
        check_catalog(framing, attempt, limits, catalog)
    else:
        check_expansion(len(view) - HEADER_SIZE, framing, attempt, limits)
    body = Body(view[HEADER_SIZE:], framing.body_bytes, attempt, framing.version)
    args = (body, framing, attempt, limits, catalog, xor_allowed)
    items = decode_v1(*args) if framing.version == V1 else decode_v2(*args)
    body.finish()
    return Payload(header=header, items=items)
