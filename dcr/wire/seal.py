"""Keyed seals: the keys a fleet secret gives payload and manifest seals, and the MAC both use.

A fleet that shares a 32-byte *fleet secret* seals what crosses its transports so that only a
holder of the secret can produce it (``docs/wire-format.md``, "Keyed seal"):

* a payload's digest field holds a keyed BLAKE3 MAC under the *payload key*
  (:data:`~dcr.wire.format.FLAG_KEYED`), written by :func:`~dcr.wire.encode.encode_payload`
  and verified by :func:`~dcr.wire.decode.read_header` before anything of the body is parsed;
* an object-storage manifest entry carries a keyed BLAKE3 MAC under the *manifest key*
  (:mod:`dcr.adapters.transport.objstore.layout`).

Both keys come from the secret through BLAKE3's key derivation with a context string of their
own, so a MAC of one kind is never valid as the other.  Engines take the fleet secret
(``fleet_secret``) and derive the keys here; the wire functions take the derived key.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import blake3

from dcr.errors import ConfigError

__all__ = [
    "KEY_SIZE",
    "MAC_SIZE",
    "MANIFEST_CONTEXT",
    "PAYLOAD_CONTEXT",
    "SECRET_SIZE",
    "SealKeys",
    "check_key",
    "keyed_mac",
    "payload_key",
    "seal_keys",
]

SECRET_SIZE = 32
"""Bytes of a fleet secret."""
KEY_SIZE = 32
"""Bytes of a derived seal key (BLAKE3's key size)."""
MAC_SIZE = 16
"""Bytes of a seal: the first 16 bytes of the keyed BLAKE3 output."""
PAYLOAD_CONTEXT = "dcr 2026 payload seal"
"""BLAKE3 ``derive_key`` context of the payload key."""
MANIFEST_CONTEXT = "dcr 2026 manifest seal"
"""BLAKE3 ``derive_key`` context of the manifest key."""


@dataclass(frozen=True, slots=True)
class SealKeys:
    """The keys one fleet secret gives (never shown in a repr)."""

    payload: bytes = field(repr=False)
    """Keys the MAC in a payload's digest field (:data:`~dcr.wire.format.FLAG_KEYED`)."""
    manifest: bytes = field(repr=False)
    """Keys the MAC of an object-storage manifest entry."""


def _check_secret(secret: object) -> bytes:
    if not isinstance(secret, bytes | bytearray) or len(secret) != SECRET_SIZE:
        what = f"{len(secret)} bytes" if isinstance(secret, bytes | bytearray) else type(secret)
        raise ConfigError(
            f"a fleet secret is {SECRET_SIZE} bytes, got {what}; read it from the fleet's key "
            "directory (KeyDir(path).secret(); 'dcr keys' makes one)"
        )
    return bytes(secret)


def _derive(context: str, secret: bytes) -> bytes:
    return bytes(blake3.blake3(secret, derive_key_context=context, max_threads=1).digest())


def seal_keys(secret: bytes) -> SealKeys:
    """The payload and manifest keys of the 32-byte fleet ``secret``:
    ``blake3(secret, derive_key_context=<context>).digest()`` with :data:`PAYLOAD_CONTEXT` and
    :data:`MANIFEST_CONTEXT`.  Raises :class:`~dcr.errors.ConfigError` for anything but 32
    bytes."""
    secret = _check_secret(secret)
    return SealKeys(
        payload=_derive(PAYLOAD_CONTEXT, secret), manifest=_derive(MANIFEST_CONTEXT, secret)
    )


def payload_key(secret: bytes | None) -> bytes | None:
    """The payload key of ``secret``, or ``None`` without one (payloads go unkeyed)."""
    return None if secret is None else seal_keys(secret).payload


def check_key(key: object, what: str) -> bytes:
    """``key`` as a derived seal key, or :class:`~dcr.errors.ConfigError`."""
    if not isinstance(key, bytes | bytearray) or len(key) != KEY_SIZE:
        raise ConfigError(
            f"the {what} is {KEY_SIZE} bytes derived from the fleet secret (seal_keys), got "
            + (f"{len(key)} bytes" if isinstance(key, bytes | bytearray) else repr(type(key)))
        )
    return bytes(key)


def keyed_mac(key: bytes, *parts: bytes | memoryview) -> bytes:
    """The first :data:`MAC_SIZE` bytes of BLAKE3 keyed with ``key`` (32 bytes) over the
    concatenation of ``parts``, on one thread."""
    h = blake3.blake3(key=key, max_threads=1)
    for part in parts:
        h.update(part)
    return bytes(h.digest()[:MAC_SIZE])
