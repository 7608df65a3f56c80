"""The payload: the bytes one owner sends for one bucket of records (paper App. D).

One import for the whole payload API: the format and its types live in :mod:`dcr.wire.format`,
the encoder in :mod:`dcr.wire.encode`, the strict decoder in :mod:`dcr.wire.decode`.
``docs/wire-format.md`` specifies every byte.
"""

from __future__ import annotations

from dcr.wire.decode import decode_payload as decode_payload
from dcr.wire.decode import read_header as read_header
from dcr.wire.encode import encode_bucket as encode_bucket
from dcr.wire.encode import encode_payload as encode_payload
from dcr.wire.format import CODEC_ZSTD as CODEC_ZSTD
from dcr.wire.format import DEFAULT_LAYOUT as DEFAULT_LAYOUT
from dcr.wire.format import DEFAULT_LEVEL as DEFAULT_LEVEL
from dcr.wire.format import DIGEST_SIZE as DIGEST_SIZE
from dcr.wire.format import FLAG_FINAL as FLAG_FINAL
from dcr.wire.format import FORMAT_VERSION as FORMAT_VERSION
from dcr.wire.format import HEADER_SIZE as HEADER_SIZE
from dcr.wire.format import MAGIC as MAGIC
from dcr.wire.format import SUPPORTED_VERSIONS as SUPPORTED_VERSIONS
from dcr.wire.format import DecodeLimits as DecodeLimits
from dcr.wire.format import Items as Items
from dcr.wire.format import Payload as Payload
from dcr.wire.format import PayloadHeader as PayloadHeader
from dcr.wire.format import ValueLayout as ValueLayout

__all__ = [
    "CODEC_ZSTD",
    "DEFAULT_LAYOUT",
    "DEFAULT_LEVEL",
    "DIGEST_SIZE",
    "FLAG_FINAL",
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "MAGIC",
    "SUPPORTED_VERSIONS",
    "DecodeLimits",
    "Items",
    "Payload",
    "PayloadHeader",
    "ValueLayout",
    "decode_payload",
    "encode_bucket",
    "encode_payload",
    "read_header",
]
