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
"""

from __future__ import annotations

import re
from urllib.parse import unquote

import msgspec

from dcr.errors import ConfigError

__all__ = [
    "ENTRY_DECODER",
    "ENTRY_FORMAT",
    "MANIFEST",
    "MANIFEST_RE",
    "PAYLOADS",
    "ManifestEntry",
    "attempt_segment",
    "decode_segment",
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
