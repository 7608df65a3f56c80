"""Payload bytes: format, location coding, zstd, BLAKE2b-128 digest, strict decoding."""

from dcr.wire.locations import LocationKind as LocationKind
from dcr.wire.payload import DEFAULT_LAYOUT as DEFAULT_LAYOUT
from dcr.wire.payload import DEFAULT_LEVEL as DEFAULT_LEVEL
from dcr.wire.payload import FORMAT_VERSION as FORMAT_VERSION
from dcr.wire.payload import DecodeLimits as DecodeLimits
from dcr.wire.payload import Payload as Payload
from dcr.wire.payload import PayloadHeader as PayloadHeader
from dcr.wire.payload import ValueLayout as ValueLayout
from dcr.wire.payload import decode_payload as decode_payload
from dcr.wire.payload import encode_payload as encode_payload
from dcr.wire.payload import read_header as read_header
