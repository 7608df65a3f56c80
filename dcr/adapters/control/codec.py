"""The control-message codec: every call and reply between processes, strictly checked.

Control messages (:mod:`dcr.protocol.messages`) cross process boundaries as one MessagePack
array, the *frame*::

    [format version, type tag, sender epoch, sender name, body]

``format version`` is :data:`FORMAT_VERSION`; ``type tag`` is the message's class name;
``sender epoch`` is the sender's coordinator epoch (a coordinator's own, an endpoint's newest
seen); ``sender name`` is the endpoint's name or the coordinator's; ``body`` is the message
dataclass as a MessagePack map of its fields in declaration order (nested dataclasses as maps,
enums by value, tuples and frozensets as arrays, frozensets sorted).  A field added to a
message after this format version (``metadata["optional"]``, e.g. ``Prepare.xor_refused``) is
left out of the map while it is ``None``, so a frame of a sender that predates the field is
the frame of the same message with the field ``None``.  The encoding is canonical: one message
has exactly one frame, and a decoder accepts a frame only if re-encoding what it decoded gives
the same bytes.  That one rule rejects unknown or missing fields (msgspec would ignore the
former and fill defaults for the latter), an optional field sent as ``nil``, duplicated or
unsorted set members and non-minimal integer encodings.  A field with ``metadata["max_bytes"]``
(a set of names) is bounded on its own as well, by
:func:`~dcr.protocol.messages.refused_size`.

Decoding never unpickles and is bounded by the input: the length is checked against
``max_bytes`` before anything is parsed, and msgspec checks every declared length against the
bytes that remain.  Every failure raises :class:`~dcr.errors.ControlMessageRejected` whose
``check`` is ``oversized``, ``truncated``, ``malformed``, ``version``, ``type`` or ``schema``.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from dcr.errors import ConfigError, ControlMessageRejected, LocalProtocolError
from dcr.protocol.messages import MESSAGES, refused_size

__all__ = ["FORMAT_VERSION", "MAX_BYTES", "ControlCodec", "Envelope", "tag_of"]

FORMAT_VERSION = 1
"""Version of the frame layout and of every message schema; bump it when either changes in a
way that frames of the previous version would no longer decode (a field added as
``optional``, left out while ``None``, does not need it)."""
MAX_BYTES = 1 << 20
"""Default limit of one encoded control message (calls carry names, never payload bytes)."""

_NonNegative = Annotated[int, msgspec.Meta(ge=0)]
_HEADER = msgspec.msgpack.Decoder(list[msgspec.Raw])
_INT = msgspec.msgpack.Decoder(_NonNegative)
_STR = msgspec.msgpack.Decoder(str)
_ANY = msgspec.msgpack.Decoder()
_ENCODER = msgspec.msgpack.Encoder(order="deterministic")


def _map_header(n: int) -> bytes:
    """The MessagePack header of a map of ``n`` pairs, as msgspec writes it (minimal)."""
    if n < 16:
        return bytes([0x80 | n])
    if n < 1 << 16:
        return b"\xde" + n.to_bytes(2, "big")
    return b"\xdf" + n.to_bytes(4, "big")


@dataclass(frozen=True, slots=True)
class _Schema:
    """How the fields of one message class travel: their names in declaration order, the
    optional ones (left out while ``None``), the bounded ones (name -> most bytes) and
    whether a field's declared type holds a message class that has such fields (``Hello``'s
    ``EndpointStatus``).  A *plain* class has none of these: msgspec writes it as it is."""

    fields: tuple[str, ...]
    optional: frozenset[str]
    bounded: tuple[tuple[str, int], ...]
    nested: bool

    @property
    def plain(self) -> bool:
        return not (self.optional or self.bounded or self.nested)

    def body(self, message: object) -> object:
        """What the frame carries for ``message``: the message itself, or its map with every
        ``None`` optional field left out, at any depth (the bytes msgspec writes otherwise)."""
        if self.plain:
            return message
        pairs = [
            (name, _wire(value))
            for name in self.fields
            if (value := getattr(message, name)) is not None or name not in self.optional
        ]
        return msgspec.Raw(
            _map_header(len(pairs))
            + b"".join(_ENCODER.encode(name) + _ENCODER.encode(value) for name, value in pairs)
        )

    def over_bound(self, message: object) -> str | None:
        """The first bounded field of ``message`` (at any depth) larger than its bound."""
        if self.plain:
            return None
        for name, most in self.bounded:
            value = getattr(message, name)
            if value is not None and refused_size(value) > most:
                return f"{type(message).__name__}.{name}"
        for name in self.fields:
            found = _over_bound(getattr(message, name))
            if found is not None:
                return found
        return None


@functools.cache
def _schema(message_type: type) -> _Schema:
    fields = dataclasses.fields(message_type)
    try:
        hints = typing.get_type_hints(message_type)
        nested = any(_holds_rules(hints[f.name]) for f in fields)
    except (NameError, TypeError, KeyError):
        nested = True  # types it cannot resolve: look at the values
    return _Schema(
        fields=tuple(f.name for f in fields),
        optional=frozenset(f.name for f in fields if f.metadata.get("optional")),
        bounded=tuple(
            (f.name, int(f.metadata["max_bytes"])) for f in fields if "max_bytes" in f.metadata
        ),
        nested=nested,
    )


def _holds_rules(tp: Any) -> bool:
    """Whether declared type ``tp`` holds a message class that is not plain."""
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return not _schema(tp).plain
    return any(_holds_rules(arg) for arg in typing.get_args(tp))


def _wire(value: Any) -> Any:
    """``value`` as the frame carries it (see :meth:`_Schema.body`)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _schema(type(value)).body(value)
    if isinstance(value, tuple):
        return tuple(_wire(v) for v in value)
    return value


def _over_bound(value: Any) -> str | None:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _schema(type(value)).over_bound(value)
    if isinstance(value, tuple):
        for v in value:
            found = _over_bound(v)
            if found is not None:
                return found
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class Envelope:
    """A decoded frame: the message and who sent it under which coordinator epoch."""

    epoch: int
    sender: str
    message: object


def tag_of(cls: type) -> str:
    """The stable wire tag of message class ``cls``: its class name."""
    return cls.__name__


def _reject(message: str, check: str, exc: BaseException | None = None) -> ControlMessageRejected:
    if exc is not None:
        message = f"{message}: {exc}"
    return ControlMessageRejected(message, check=check)


def _decode_error(exc: BaseException, where: str) -> ControlMessageRejected:
    """Sort a msgspec failure into a check; truncation is told apart by its message."""
    if isinstance(exc, msgspec.DecodeError) and "truncated" in str(exc):
        return _reject(f"the {where} ends early", "truncated", exc)
    if isinstance(exc, msgspec.ValidationError) and where == "body":
        return _reject("the body does not match its type", "schema", exc)
    return _reject(f"the {where} is not valid MessagePack", "malformed", exc)


_DECODE_ERRORS = (msgspec.DecodeError, RecursionError, ValueError, TypeError, OverflowError)
"""What msgspec may raise on hostile input (RecursionError: nesting deeper than it allows)."""


class ControlCodec:
    """Encodes and strictly decodes the control messages of ``types`` (default: every one).

    ``max_bytes`` bounds one frame on both sides.  Tags are the class names, so each class in
    ``types`` must be a dataclass with a unique name.
    """

    def __init__(self, types: Iterable[type] = MESSAGES, *, max_bytes: int = MAX_BYTES) -> None:
        if max_bytes < 64:
            raise ConfigError("a control codec needs max_bytes of at least 64")
        self.max_bytes = max_bytes
        self._decoders: dict[str, msgspec.msgpack.Decoder[Any]] = {}
        self._tags: dict[type, str] = {}
        for cls in types:
            if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
                raise ConfigError(f"control message type {cls!r} is not a dataclass")
            tag = tag_of(cls)
            if tag in self._decoders:
                raise ConfigError(f"two control message types are tagged {tag!r}")
            try:
                self._decoders[tag] = msgspec.msgpack.Decoder(cls)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"control message type {tag} cannot be decoded: {exc}") from exc
            self._tags[cls] = tag

    @property
    def types(self) -> tuple[type, ...]:
        """The message classes this codec knows, in registration order."""
        return tuple(self._tags)

    def encode(self, message: object, *, epoch: int, sender: str) -> bytes:
        """The frame of ``message``; :class:`~dcr.errors.LocalProtocolError` (``check``
        ``type``, ``encode`` or ``oversized``) if it cannot be sent.

        The frame is decoded again before it is returned, so a field holding a value of the
        wrong type fails here, at the sender, instead of being dropped by the receiver."""
        tag = self._tags.get(type(message))
        if tag is None:
            raise LocalProtocolError(
                f"{type(message).__name__} is not a control message of this codec", check="type"
            )
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise LocalProtocolError(f"epoch {epoch!r} is not a non-negative int", check="encode")
        if not isinstance(sender, str):
            raise LocalProtocolError(f"sender {sender!r} is not a string", check="encode")
        try:
            body = _wire(message)
            data = _ENCODER.encode((FORMAT_VERSION, tag, epoch, sender, body))
        except (TypeError, ValueError, OverflowError) as exc:
            raise LocalProtocolError(f"cannot encode {tag}: {exc}", check="encode") from exc
        if len(data) > self.max_bytes:
            raise LocalProtocolError(
                f"{tag} needs {len(data)} bytes, limit {self.max_bytes}", check="oversized"
            )
        try:
            self.decode(data)
        except ControlMessageRejected as exc:
            raise LocalProtocolError(
                f"{tag} does not match its declared types: {exc.message}", check="encode"
            ) from exc
        return data

    def decode(self, data: bytes | bytearray | memoryview) -> Envelope:
        """Parse one frame; raises :class:`~dcr.errors.ControlMessageRejected` and nothing
        else on any input."""
        if len(data) > self.max_bytes:
            raise _reject(f"a frame of {len(data)} bytes, limit {self.max_bytes}", "oversized")
        try:
            parts = _HEADER.decode(data)
        except _DECODE_ERRORS as exc:
            raise _decode_error(exc, "frame") from None
        if not parts:
            raise _reject("an empty frame", "malformed")
        version = self._field(_ANY, parts[0], "version")
        if type(version) is not int or version != FORMAT_VERSION:
            raise _reject(f"format version {version!r:.32}, expected {FORMAT_VERSION}", "version")
        if len(parts) != 5:
            raise _reject(f"a frame of {len(parts)} fields, expected 5", "malformed")
        tag: str = self._field(_STR, parts[1], "type tag")
        decoder = self._decoders.get(tag)
        if decoder is None:
            raise _reject(f"unknown message type {tag[:64]!r}", "type")
        epoch: int = self._field(_INT, parts[2], "epoch")
        sender: str = self._field(_STR, parts[3], "sender")
        try:
            message = decoder.decode(parts[4])
        except _DECODE_ERRORS as exc:
            raise _decode_error(exc, "body") from None
        try:
            canonical = _ENCODER.encode((FORMAT_VERSION, tag, epoch, sender, _wire(message)))
        except (TypeError, ValueError, OverflowError) as exc:
            raise _reject(f"{tag} cannot be re-encoded", "schema", exc) from None
        if canonical != data:
            # Same fields, different bytes: unknown or missing fields, an optional field sent
            # as nil, unsorted or repeated set members, or non-minimal encodings (a body
            # checked alone would miss a non-minimal header, hence the whole frame).
            body = _ENCODER.encode(_wire(message))
            check = "schema" if body != bytes(parts[4]) else "malformed"
            raise _reject(f"{tag} is not in canonical form", check)
        too_large = _over_bound(message)
        if too_large is not None:
            raise _reject(f"{too_large} is larger than its bound", "schema")
        return Envelope(epoch=epoch, sender=sender, message=message)

    @staticmethod
    def _field(decoder: msgspec.msgpack.Decoder[Any], raw: msgspec.Raw, what: str) -> Any:
        try:
            return decoder.decode(raw)
        except _DECODE_ERRORS as exc:
            raise _reject(f"the {what} is invalid", "malformed", exc) from None
