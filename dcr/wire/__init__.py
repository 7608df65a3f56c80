"""Payload bytes: format, location coding, zstd, BLAKE3 (or BLAKE2b) digest, strict decoding."""

from dcr.wire.decode import decode_payload as decode_payload
from dcr.wire.decode import read_header as read_header
from dcr.wire.encode import encode_bucket as encode_bucket
from dcr.wire.encode import encode_payload as encode_payload
from dcr.wire.format import DEFAULT_LAYOUT as DEFAULT_LAYOUT
from dcr.wire.format import DEFAULT_LEVEL as DEFAULT_LEVEL
from dcr.wire.format import FORMAT_VERSION as FORMAT_VERSION
from dcr.wire.format import SUPPORTED_VERSIONS as SUPPORTED_VERSIONS
from dcr.wire.format import DecodeLimits as DecodeLimits
from dcr.wire.format import Items as Items
from dcr.wire.format import Payload as Payload
from dcr.wire.format import PayloadHeader as PayloadHeader
from dcr.wire.format import ValueLayout as ValueLayout
from dcr.wire.locations import LocationKind as LocationKind
