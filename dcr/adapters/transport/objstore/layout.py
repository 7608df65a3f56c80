"""The object-storage layout: what lives where under the backend's root (paper §7.1 "Object
storage", App. B "Transports").

Attempt ids are written as 20 decimal digits, so they sort::

    payload/<attempt>/<owner>/<writer>.<seq>       the payload bytes
    manifest/<attempt>/e/<owner>/<writer>.<seq>    its manifest entry: payload id, size, ``to``
    manifest/<attempt>/stopped                     the attempt's tombstone

``writer`` names the transport object (one per process) and ``seq`` numbers its sends of one
attempt and owner in the order ``send`` was called.  A writer posts its entries in that order
after their payloads are stored, so a listing holds a prefix of them and a node delivers each
owner's payloads in the order they were sent.  Every send is its own object: a re-send of the
same payload id (identical or not) is delivered again, and receivers deduplicate or fail the
attempt (App. B.1, reception checks).

**Sealed entries.**  With a fleet secret (``ObjectStoreConfig.fleet_secret``) a manifest entry
object is its JSON bytes ``E`` followed by a 16-byte seal ``T``::

    T = BLAKE3(key=Km, u32le(len(K)) || K || E)[:16]

where ``Km`` is the manifest key of :func:`dcr.wire.seal.seal_keys` and ``K`` the entry's own
object key (UTF-8, relative to the store's root, e.g. ``manifest/<attempt>/e/<owner>/...``):
only a holder of the secret writes an entry a node accepts, and an entry copied to another
key (another attempt, owner, writer or sequence number, hence another payload object) fails
its seal.  A node verifies the seal before it decodes anything of the entry
(:func:`decode_entry`).  Payload objects need no seal of their own: the owners seal the
payload bytes themselves (:data:`~dcr.wire.format.FLAG_KEYED`) and receivers verify them.
"""

from __future__ import annotations

import hmac
import re
import struct
from urllib.parse import unquote

import msgspec

from dcr.errors import ConfigError, TransportError
from dcr.wire.seal import MAC_SIZE, keyed_mac

__all__ = [
    "ENTRY_DECODER",
    "ENTRY_FORMAT",
    "MANIFEST",
    "MANIFEST_RE",
    "PAYLOADS",
    "ManifestEntry",
    "attempt_segment",
    "decode_entry",
    "decode_segment",
    "encode_entry",
    "encode_segment",
    "manifest_key",
    "owner_name",
    "payload_key",
    "tombstone_key",
]

MANIFEST = "manifest/"
PAYLOADS = "payload/"
ENTRY_FORMAT = 1

_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")


def encode_segment(name: str) -> str:
    """``name`` as one key segment: every character outside ``[A-Za-z0-9_-]`` is
    percent-encoded (``.`` too, so no segment is ``.`` or ``..``)."""
    if not name:
        raise ConfigError("an empty name cannot be a key segment")
    return "".join(c if c in _SAFE else "".join(f"%{b:02X}" for b in c.encode()) for c in name)


def decode_segment(segment: str) -> str:
    """The name :func:`encode_segment` encoded."""
    return unquote(segment, errors="strict")


def owner_name(segment: str) -> str | None:
    """The owner an object key's owner segment names; ``None`` when it does not decode."""
    try:
        return decode_segment(segment)
    except UnicodeDecodeError:
        return None


def attempt_segment(attempt: int) -> str:
    """``attempt`` as the 20-digit key segment that sorts."""
    if not 0 <= attempt < 10**20:
        raise ConfigError(f"attempt id {attempt} outside [0, 10**20)")
    return f"{attempt:020d}"


def payload_key(attempt: int, owner: str, writer: str, seq: int) -> str:
    """Where a payload's bytes live."""
    return f"{PAYLOADS}{attempt_segment(attempt)}/{encode_segment(owner)}/{writer}.{seq:010d}"


def manifest_key(attempt: int, owner: str, writer: str, seq: int) -> str:
    """Where the manifest entry of that payload lives."""
    return f"{MANIFEST}{attempt_segment(attempt)}/e/{encode_segment(owner)}/{writer}.{seq:010d}"


def tombstone_key(attempt: int) -> str:
    """The object whose presence says ``attempt`` is stopped."""
    return f"{MANIFEST}{attempt_segment(attempt)}/stopped"


MANIFEST_RE = re.compile(
    r"^manifest/(\d{20})/(?:stopped|e/([A-Za-z0-9_%-]+)/([0-9a-f]{16})\.(\d{10}))$"
)
"""A key under ``manifest/``: group 1 the attempt; for an entry (group 2 set, a tombstone
leaves it ``None``) 2 the owner segment, 3 the writer, 4 the sequence number."""


class ManifestEntry(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """A manifest entry (JSON).  The payload object's key follows from the entry's own key,
    so an entry cannot point a node at any other object."""

    format: int
    attempt: int
    owner: str
    payload_id: int
    size: int
    to: list[str] | None


ENTRY_DECODER = msgspec.json.Decoder(ManifestEntry, strict=True)


_KEY_LENGTH = struct.Struct("<I")


def _entry_seal(manifest_key: bytes, key: str, entry: bytes) -> bytes:
    name = key.encode()
    return keyed_mac(manifest_key, _KEY_LENGTH.pack(len(name)), name, entry)


def encode_entry(entry: ManifestEntry, key: str, manifest_key: bytes | None) -> bytes:
    """The bytes of the manifest entry object ``key``: the entry's JSON, followed by its seal
    when ``manifest_key`` (:attr:`dcr.wire.seal.SealKeys.manifest`) is given."""
    body = msgspec.json.encode(entry)
    return body if manifest_key is None else body + _entry_seal(manifest_key, key, body)


def decode_entry(raw: bytes, key: str, manifest_key: bytes | None) -> ManifestEntry:
    """The manifest entry stored as object ``key``; with ``manifest_key`` only once its seal
    verified (nothing of it is decoded before).  Raises :class:`~dcr.errors.TransportError`
    (``check="seal"``: no valid seal -- forged, unsealed, sealed under another secret or moved
    from another key; ``check="manifest"``: it does not decode)."""
    if manifest_key is not None:
        body, seal = raw[:-MAC_SIZE], raw[-MAC_SIZE:]
        if len(raw) <= MAC_SIZE or not hmac.compare_digest(
            seal, _entry_seal(manifest_key, key, body)
        ):
            raise TransportError(
                f"manifest entry {key} is not sealed with this fleet's secret (written without "
                "it, under another secret, or moved from another key); ignored",
                retryable=False,
                check="seal",
            )
        raw = body
    try:
        return ENTRY_DECODER.decode(raw)
    except msgspec.DecodeError as exc:
        hint = "" if manifest_key is not None else " (sealed? this transport has no fleet_secret)"
        raise TransportError(
            f"manifest entry {key} does not decode{hint}: {exc}", retryable=False, check="manifest"
        ) from exc
