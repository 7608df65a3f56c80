"""A fleet's key material (``dcr keys``): who may speak on its sockets, and the secret that
seals its payloads.

A *key directory* holds, for every process identity of a fleet (:class:`Identity`, a role and
a name such as ``receiver:r0``), a CURVE key pair, plus the *keyring* that binds each public key
to exactly one identity, plus the *fleet secret* (32 random bytes) from which payload and
manifest seals are derived::

    keys/
      keyring.json                    public: identity -> Z85 public key (mode 0644)
      fleet.secret                    the fleet secret, hex (mode 0600)
      secret/receiver.r0.key_secret   one CURVE key pair per identity (mode 0600)
      ...

A process reads the keyring, the secret, and only its own key pair; the directory copied to a
host may leave out the key pairs of identities that run elsewhere.  The keyring is re-read when
its file changes, so an identity removed with ``dcr keys revoke`` is refused at its next
connection without restarting the processes that check it.

Roles: ``coordinator`` (one identity, ``coordinator:main``, shared by a fleet's coordinator and
its standbys: any of them may take over), ``owner``, ``receiver`` and ``relay`` (a relay node).
"""

from __future__ import annotations

import json
import os
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from dcr.errors import ConfigError
from dcr.files import atomic_write

__all__ = [
    "COORDINATOR",
    "ROLES",
    "Identity",
    "KeyDir",
    "Keyring",
]

ROLES = ("coordinator", "owner", "receiver", "relay")
"""The roles a key may carry."""
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
KEYRING = "keyring.json"
SECRET = "fleet.secret"
SECRET_DIR = "secret"
_FORMAT = 1


@dataclass(frozen=True, slots=True, order=True)
class Identity:
    """Who a key belongs to: a role and a name, written ``role:name``."""

    role: str
    name: str

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"unknown role {self.role!r}: a key's role is one of {ROLES}")
        if not _NAME.fullmatch(self.name):
            raise ConfigError(
                f"identity name {self.name!r} must be 1-128 characters of letters, digits, "
                "'.', '_' or '-', starting with a letter or digit"
            )

    def __str__(self) -> str:
        return f"{self.role}:{self.name}"

    @classmethod
    def parse(cls, text: str) -> Identity:
        role, sep, name = text.partition(":")
        if not sep:
            raise ConfigError(f"an identity is written role:name, got {text!r}")
        return cls(role, name)

    @property
    def filename(self) -> str:
        return f"{self.role}.{self.name}.key_secret"


COORDINATOR = Identity("coordinator", "main")
"""The identity every coordinator process of a fleet uses."""


class Keyring:
    """Public keys bound to identities; a key maps to one identity and an identity to one key."""

    def __init__(self, keys: dict[Identity, bytes]) -> None:
        self._by_identity = dict(keys)
        self._by_key: dict[bytes, Identity] = {}
        for identity, key in keys.items():
            if key in self._by_key:
                raise ConfigError(
                    f"the keyring gives {identity} and {self._by_key[key]} the same key"
                )
            self._by_key[key] = identity

    def identity(self, public: bytes) -> Identity | None:
        """The identity a Z85 public key belongs to (``None``: not in the keyring)."""
        return self._by_key.get(public)

    def public(self, identity: Identity) -> bytes:
        """The Z85 public key of ``identity``."""
        try:
            return self._by_identity[identity]
        except KeyError:
            raise ConfigError(f"the keyring holds no key for {identity}") from None

    def identities(self) -> list[Identity]:
        return sorted(self._by_identity)

    def __contains__(self, identity: object) -> bool:
        return identity in self._by_identity

    def __len__(self) -> int:
        return len(self._by_identity)


class KeyDir:
    """A fleet's key directory (see the module docstring); build one with :meth:`init`."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not (self.path / KEYRING).is_file():
            raise ConfigError(
                f"{str(self.path)!r} is no key directory (no {KEYRING}): make one with "
                f"`dcr keys init {self.path}`"
            )
        self._keyring: Keyring | None = None
        self._stamp: tuple[int, int, int] | None = None

    # -- making and changing ------------------------------------------------------------------

    @classmethod
    def init(cls, path: str | os.PathLike[str], identities: Iterable[Identity]) -> KeyDir:
        """Make a new key directory with a key pair per identity and a fresh fleet secret;
        an existing key directory is refused (rotate or add to it instead)."""
        root = Path(path)
        if (root / KEYRING).exists():
            raise ConfigError(
                f"{str(root)!r} already holds a key directory: use `dcr keys add` or "
                "`dcr keys rotate`, or remove it first"
            )
        wanted = sorted(set(identities))
        if not wanted:
            raise ConfigError("a key directory needs at least one identity")
        root.mkdir(parents=True, exist_ok=True)
        (root / SECRET_DIR).mkdir(mode=0o700, exist_ok=True)
        _write_private(root / SECRET, secrets.token_bytes(32).hex() + "\n")
        keys = {identity: _new_pair(root, identity) for identity in wanted}
        _write_keyring(root, keys)
        return cls(root)

    def add(self, identities: Iterable[Identity]) -> list[Identity]:
        """Give new identities key pairs; returns those added (existing ones are kept)."""
        keys = {i: self.keyring().public(i) for i in self.keyring().identities()}
        added = [i for i in sorted(set(identities)) if i not in keys]
        for identity in added:
            keys[identity] = _new_pair(self.path, identity)
        _write_keyring(self.path, keys)
        return added

    def rotate(self, identity: Identity) -> None:
        """Replace ``identity``'s key pair; its old key is refused from now on."""
        keys = {i: self.keyring().public(i) for i in self.keyring().identities()}
        if identity not in keys:
            raise ConfigError(f"the keyring holds no key for {identity}")
        keys[identity] = _new_pair(self.path, identity)
        _write_keyring(self.path, keys)

    def revoke(self, identity: Identity) -> None:
        """Remove ``identity`` from the keyring and delete its key pair."""
        keys = {i: self.keyring().public(i) for i in self.keyring().identities()}
        if keys.pop(identity, None) is None:
            raise ConfigError(f"the keyring holds no key for {identity}")
        _write_keyring(self.path, keys)
        (self.path / SECRET_DIR / identity.filename).unlink(missing_ok=True)

    def rotate_secret(self) -> None:
        """A new fleet secret: payloads sealed under the old one are refused from now on."""
        _write_private(self.path / SECRET, secrets.token_bytes(32).hex() + "\n")

    # -- reading ------------------------------------------------------------------------------

    def keyring(self) -> Keyring:
        """The keyring, read again when its file changed since the last read."""
        file = self.path / KEYRING
        try:
            st = file.stat()
        except OSError as exc:
            raise ConfigError(f"cannot read the keyring {str(file)!r}: {exc}") from exc
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        if self._keyring is None or stamp != self._stamp:
            self._keyring, self._stamp = _read_keyring(file), stamp
        return self._keyring

    def secret(self) -> bytes:
        """The 32-byte fleet secret (payload and manifest seals derive their keys from it)."""
        file = self.path / SECRET
        _check_private(file)
        try:
            secret = bytes.fromhex(file.read_text().strip())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read the fleet secret {str(file)!r}: {exc}") from exc
        if len(secret) != 32:
            raise ConfigError(f"the fleet secret {str(file)!r} is not 32 bytes")
        return secret

    def pair(self, identity: Identity) -> tuple[bytes, bytes]:
        """``identity``'s Z85 CURVE key pair ``(public, secret)``; its public key must be the
        one the keyring holds (a rotated key pair whose keyring was not copied is refused)."""
        file = self.path / SECRET_DIR / identity.filename
        if not file.is_file():
            raise ConfigError(
                f"no key pair for {identity} in {str(self.path)!r}: copy "
                f"{SECRET_DIR}/{identity.filename} to this host, or `dcr keys add "
                f"{self.path} {identity}`"
            )
        _check_private(file)
        import zmq.auth

        try:
            public, secret = zmq.auth.load_certificate(file)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read the key pair {str(file)!r}: {exc}") from exc
        if secret is None:
            raise ConfigError(f"{str(file)!r} holds no secret key")
        if self.keyring().public(identity) != public:
            raise ConfigError(
                f"the key pair of {identity} in {str(file)!r} is not the one the keyring holds "
                "(rotated elsewhere? copy the current keyring and key pair)"
            )
        return public, secret


def _new_pair(root: Path, identity: Identity) -> bytes:
    import zmq

    public, secret = zmq.curve_keypair()
    text = (
        "#   ****  dcr CURVE key pair -- keep it secret  ****\n"
        f"#   identity: {identity}\n"
        "metadata\n"
        "curve\n"
        f'    public-key = "{public.decode()}"\n'
        f'    secret-key = "{secret.decode()}"\n'
    )
    _write_private(root / SECRET_DIR / identity.filename, text)
    return public


def _write_private(file: Path, text: str) -> None:
    """Write ``text`` to ``file`` (mode 0600), atomically and durably."""
    atomic_write(file, text.encode(), mode=0o600)


def _check_private(file: Path) -> None:
    try:
        mode = file.stat().st_mode & 0o777
    except OSError as exc:
        raise ConfigError(f"cannot read {str(file)!r}: {exc}") from exc
    if mode & 0o077:
        raise ConfigError(
            f"{str(file)!r} is readable by others (mode {mode:o}): `chmod 600 {file}`"
        )


def _write_keyring(root: Path, keys: dict[Identity, bytes]) -> None:
    doc = {
        "format": _FORMAT,
        "identities": {str(i): keys[i].decode() for i in sorted(keys)},
    }
    atomic_write(root / KEYRING, (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode(),
                 mode=0o644)  # fmt: skip


def _read_keyring(file: Path) -> Keyring:
    try:
        doc = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the keyring {str(file)!r}: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
        raise ConfigError(f"{str(file)!r} is not a dcr keyring of format {_FORMAT}")
    entries = doc.get("identities")
    if not isinstance(entries, dict):
        raise ConfigError(f"{str(file)!r} has no identities table")
    from zmq.utils import z85

    keys: dict[Identity, bytes] = {}
    for text, public in entries.items():
        identity = Identity.parse(str(text))
        if not isinstance(public, str) or len(public) != 40:
            raise ConfigError(f"{str(file)!r}: the key of {identity} is not 40 Z85 characters")
        try:
            z85.decode(public.encode())
        except ValueError as exc:
            raise ConfigError(f"{str(file)!r}: the key of {identity} is not Z85") from exc
        keys[identity] = public.encode()
    return Keyring(keys)
