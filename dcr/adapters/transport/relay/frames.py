"""Frames of the relay-tree transport: a small, versioned, strictly checked binary framing.

Every relay message is one ZeroMQ multipart message: a *header* frame, plus one *body* frame
for the two kinds that carry payload bytes (``DATA`` from an owner to the root, ``PAYLOAD``
down the tree).  The payload key travels in the header, never inside the payload bytes, so a
receiver can name a payload whose bytes are damaged.  Header layout (big-endian, no padding)::

    magic "DCRR" | version u8 (=2) | kind u8 | the kind's fields, in order

with integers as ``u64`` (sequence numbers, nonces, sizes) or ``i64`` (attempt and payload
ids), booleans as ``u8`` 0/1, strings as ``u16`` length + UTF-8, name sets as ``u32`` count +
strings in sorted order, and a recipient set as ``u8`` 0 (every receiver) or 1 + a name set.
Decoding is strict: a wrong magic, version or kind, a short or long header, bad UTF-8, an
unsorted name set, a wrong number of frames, a body whose length differs from the declared
size, or a declared size above the limit raises :class:`FrameError` naming the reason.  The
relay never unpickles anything.  Version 2 added the receiver's name to ``SUBSCRIBE`` (a node
checks it against the name the connection authenticated).
"""

from __future__ import annotations

import enum
import itertools
import struct
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Protocol, TypeAlias

from dcr.errors import RemoteProtocolError
from dcr.protocol.types import PayloadKey

__all__ = [
    "HEADER_LIMIT",
    "MAGIC",
    "VERSION",
    "Ack",
    "Answer",
    "Cancel",
    "Data",
    "Delivered",
    "Done",
    "Frame",
    "FrameError",
    "Grant",
    "Join",
    "Kind",
    "Offer",
    "Payload",
    "Ping",
    "Pong",
    "Query",
    "Refused",
    "Sized",
    "Stop",
    "Subscribe",
    "Unsubscribe",
    "decode",
    "decode_header",
    "encode",
]

MAGIC = b"DCRR"
VERSION = 2
HEADER_LIMIT = 1 << 20
"""Largest header frame accepted (recipient and receiver lists included)."""

_U8 = struct.Struct("!B")
_U16 = struct.Struct("!H")
_U32 = struct.Struct("!I")
_U64 = struct.Struct("!Q")
_I64 = struct.Struct("!q")
_PREFIX = struct.Struct("!4sBB")


class FrameError(RemoteProtocolError):
    """A relay frame failed a check; ``check`` names the reason (the node's drop counter)."""


class Kind(enum.IntEnum):
    """What a relay frame is; the numbers are part of the wire format."""

    OFFER = 1
    """Owner -> root: may I send this payload (key, recipients, size)?"""
    DATA = 2
    """Owner -> root: the bytes of a granted offer (body frame)."""
    GRANT = 3
    """Root -> owner: the root has room; send the bytes."""
    DELIVERED = 4
    """Root -> owner: every addressed, subscribed receiver took the payload."""
    REFUSED = 5
    """Root -> client: the request failed (``check``, ``retryable``)."""
    CANCEL = 6
    """Owner -> root: forget an offer nobody waits for any more."""
    PAYLOAD = 7
    """Node -> child node or receiver: one transfer (body frame)."""
    ACK = 8
    """Child node or receiver -> node: the transfer was taken below (queueing ACK)."""
    STOP = 9
    """Client -> root, node -> child node or receiver: stop (or clean up) an attempt."""
    DONE = 10
    """The stop or cleanup finished below the sender of the ``STOP``."""
    SUBSCRIBE = 11
    """Receiver -> its node, repeated as the receiver's heartbeat (names the receiver)."""
    UNSUBSCRIBE = 12
    """Receiver -> its node: the subscription ends."""
    JOIN = 13
    """Child node -> parent, repeated as its heartbeat: capacity and subtree receivers."""
    PING = 14
    """Liveness probe; carries the sender's incarnation nonce."""
    PONG = 15
    """Root -> client: answer to a client's ``PING`` (the root's incarnation nonce)."""
    QUERY = 16
    """Client -> node: which receivers are below you, and your boundary counters?"""
    ANSWER = 17
    """Node -> client: answer to ``QUERY``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Offer:
    seq: int
    key: PayloadKey
    size: int
    to: frozenset[str] | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Data:
    seq: int
    size: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Grant:
    seq: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Delivered:
    seq: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Refused:
    seq: int
    retryable: bool
    check: str
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Cancel:
    seq: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Payload:
    origin: int
    """The root's incarnation nonce: ``(origin, seq)`` increases along every link."""
    seq: int
    """Transfer id, assigned by the root."""
    key: PayloadKey
    size: int
    to: frozenset[str] | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Ack:
    seq: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Stop:
    origin: int
    """The root's incarnation nonce (0 from a client)."""
    seq: int
    """The client's request number, or the root's wave id below the root."""
    attempt: int
    cleanup: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class Done:
    seq: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Subscribe:
    nonce: int
    """The subscription's incarnation: a new nonce replaces the node's old link."""
    window: int
    window_bytes: int
    receiver: str
    """The receiver's name: the key's name with keys, the routing id's without."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Unsubscribe:
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class Join:
    nonce: int
    capacity: int
    capacity_bytes: int
    receivers: frozenset[str]


@dataclass(frozen=True, slots=True, kw_only=True)
class Ping:
    nonce: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Pong:
    nonce: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Query:
    seq: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Answer:
    seq: int
    receivers: frozenset[str]
    payloads: int
    payload_bytes: int
    cross_bytes: int


Frame: TypeAlias = (
    Offer
    | Data
    | Grant
    | Delivered
    | Refused
    | Cancel
    | Payload
    | Ack
    | Stop
    | Done
    | Subscribe
    | Unsubscribe
    | Join
    | Ping
    | Pong
    | Query
    | Answer
)


class _Reader:
    """Bounds-checked cursor over a header; every shortfall is ``truncated``."""

    __slots__ = ("data", "pos")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if end > len(self.data):
            raise FrameError("the header ends early", check="truncated")
        out = self.data[self.pos : end]
        self.pos = end
        return out

    def unpack(self, s: struct.Struct) -> int:
        value: int = s.unpack(self.take(s.size))[0]
        return value


class _Codec(Protocol):
    def put(self, out: bytearray, value: object) -> None: ...
    def get(self, r: _Reader) -> object: ...


def _int_value(value: object, lo: int, hi: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise FrameError(f"integer {value!r} out of range", check="encode")
    return value


class _Int:
    def __init__(self, s: struct.Struct, lo: int, hi: int) -> None:
        self.s, self.lo, self.hi = s, lo, hi

    def put(self, out: bytearray, value: object) -> None:
        out += self.s.pack(_int_value(value, self.lo, self.hi))

    def get(self, r: _Reader) -> object:
        return r.unpack(self.s)


class _Bool:
    def put(self, out: bytearray, value: object) -> None:
        out += _U8.pack(1 if value else 0)

    def get(self, r: _Reader) -> object:
        v = r.unpack(_U8)
        if v > 1:
            raise FrameError(f"boolean byte {v}", check="malformed")
        return v == 1


def _put_str(out: bytearray, value: object) -> None:
    if not isinstance(value, str):
        raise FrameError(f"{value!r} is not a string", check="encode")
    raw = value.encode()
    if len(raw) > 0xFFFF:
        raise FrameError("string longer than 65535 bytes", check="encode")
    out += _U16.pack(len(raw))
    out += raw


def _get_str(r: _Reader) -> str:
    raw = r.take(r.unpack(_U16))
    try:
        return raw.decode()
    except UnicodeDecodeError as exc:
        raise FrameError("a string is not UTF-8", check="malformed") from exc


class _Str:
    def put(self, out: bytearray, value: object) -> None:
        _put_str(out, value)

    def get(self, r: _Reader) -> object:
        return _get_str(r)


class _Names:
    def put(self, out: bytearray, value: object) -> None:
        if not isinstance(value, frozenset):
            raise FrameError("a name set must be a frozenset", check="encode")
        out += _U32.pack(len(value))
        for name in sorted(value):
            _put_str(out, name)

    def get(self, r: _Reader) -> object:
        count = r.unpack(_U32)
        if count * _U16.size > len(r.data) - r.pos:
            raise FrameError("the name set ends early", check="truncated")
        names = [_get_str(r) for _ in range(count)]
        if any(a >= b for a, b in itertools.pairwise(names)):
            raise FrameError("a name set is not sorted and unique", check="malformed")
        return frozenset(names)


class _To:
    def put(self, out: bytearray, value: object) -> None:
        if value is None:
            out += _U8.pack(0)
        else:
            out += _U8.pack(1)
            _NAMES.put(out, value)

    def get(self, r: _Reader) -> object:
        flag = r.unpack(_U8)
        if flag == 0:
            return None
        if flag != 1:
            raise FrameError(f"recipient flag {flag}", check="malformed")
        return _NAMES.get(r)


_I64_RANGE = (-(1 << 63), (1 << 63) - 1)


class _Key:
    def put(self, out: bytearray, value: object) -> None:
        if not isinstance(value, PayloadKey):
            raise FrameError("not a PayloadKey", check="encode")
        out += _I64.pack(_int_value(value.attempt, *_I64_RANGE))
        out += _I64.pack(_int_value(value.payload_id, *_I64_RANGE))
        _put_str(out, value.owner)

    def get(self, r: _Reader) -> object:
        attempt = r.unpack(_I64)
        payload_id = r.unpack(_I64)
        return PayloadKey(attempt=attempt, owner=_get_str(r), payload_id=payload_id)


_U64C = _Int(_U64, 0, (1 << 64) - 1)
_I64C = _Int(_I64, *_I64_RANGE)
_BOOL = _Bool()
_STR = _Str()
_NAMES = _Names()
_TO = _To()
_KEY = _Key()

_SCHEMA: dict[Kind, tuple[type, tuple[_Codec, ...]]] = {
    Kind.OFFER: (Offer, (_U64C, _KEY, _U64C, _TO)),
    Kind.DATA: (Data, (_U64C, _U64C)),
    Kind.GRANT: (Grant, (_U64C,)),
    Kind.DELIVERED: (Delivered, (_U64C,)),
    Kind.REFUSED: (Refused, (_U64C, _BOOL, _STR, _STR)),
    Kind.CANCEL: (Cancel, (_U64C,)),
    Kind.PAYLOAD: (Payload, (_U64C, _U64C, _KEY, _U64C, _TO)),
    Kind.ACK: (Ack, (_U64C,)),
    Kind.STOP: (Stop, (_U64C, _U64C, _I64C, _BOOL)),
    Kind.DONE: (Done, (_U64C,)),
    Kind.SUBSCRIBE: (Subscribe, (_U64C, _U64C, _U64C, _STR)),
    Kind.UNSUBSCRIBE: (Unsubscribe, ()),
    Kind.JOIN: (Join, (_U64C, _U64C, _U64C, _NAMES)),
    Kind.PING: (Ping, (_U64C,)),
    Kind.PONG: (Pong, (_U64C,)),
    Kind.QUERY: (Query, (_U64C,)),
    Kind.ANSWER: (Answer, (_U64C, _NAMES, _U64C, _U64C, _U64C)),
}
_KIND_OF: dict[type, Kind] = {cls: kind for kind, (cls, _) in _SCHEMA.items()}
_WITH_BODY = frozenset({Kind.DATA, Kind.PAYLOAD})


class Sized(Protocol):
    """A body part: ``bytes`` or a ``zmq.Frame`` (only its length is looked at)."""

    def __len__(self) -> int: ...


def encode(frame: Frame) -> bytes:
    """The header frame of ``frame``; raises :class:`FrameError` (``encode``) on bad values."""
    kind = _KIND_OF[type(frame)]
    out = bytearray(_PREFIX.pack(MAGIC, VERSION, kind))
    codecs = _SCHEMA[kind][1]
    for f, codec in zip(fields(frame), codecs, strict=True):
        codec.put(out, getattr(frame, f.name))
    if len(out) > HEADER_LIMIT:
        raise FrameError("header larger than HEADER_LIMIT", check="encode")
    return bytes(out)


def decode_header(data: bytes) -> Frame:
    """Parse one header frame strictly."""
    if len(data) > HEADER_LIMIT:
        raise FrameError("header larger than HEADER_LIMIT", check="oversized")
    if len(data) < _PREFIX.size:
        raise FrameError("the header ends early", check="truncated")
    magic, version, kind_no = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise FrameError("not a relay frame", check="magic")
    if version != VERSION:
        raise FrameError(f"relay frame version {version}, expected {VERSION}", check="version")
    try:
        kind = Kind(kind_no)
    except ValueError as exc:
        raise FrameError(f"unknown frame kind {kind_no}", check="kind") from exc
    cls, codecs = _SCHEMA[kind]
    r = _Reader(data)
    r.pos = _PREFIX.size
    values = [codec.get(r) for codec in codecs]
    if r.pos != len(data):
        raise FrameError("bytes after the last field", check="malformed")
    frame: Frame = cls(**{f.name: v for f, v in zip(fields(cls), values, strict=True)})
    return frame


def decode(header: bytes, rest: Sequence[Sized], *, max_size: int) -> tuple[Frame, Sized | None]:
    """Check one message (routing id removed): its header and the parts after it.

    The declared size of a body-carrying frame is checked against ``max_size`` before the
    body is looked at; ZeroMQ's ``MAXMSGSIZE`` keeps a larger body from being received at all.
    """
    frame = decode_header(header)
    kind = _KIND_OF[type(frame)]
    want = 1 if kind in _WITH_BODY else 0
    if len(rest) != want:
        raise FrameError(f"{kind.name} with {len(rest) + 1} frames", check="parts")
    if not isinstance(frame, Data | Payload):
        return frame, None
    if frame.size > max_size:
        raise FrameError(f"payload of {frame.size} bytes, limit {max_size}", check="oversized")
    body = rest[0]
    if len(body) < frame.size:
        raise FrameError("the payload ends early", check="truncated")
    if len(body) > frame.size:
        raise FrameError("payload longer than declared", check="malformed")
    return frame, body
