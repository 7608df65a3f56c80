"""A process's security policy (:class:`Security`): the fleet's key material, how its sockets
use it, and the rule for binding without keys (:func:`check_bind`).  Importing it loads no
vendor library; ZeroMQ is loaded when a socket is secured."""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass
from typing import Any

from dcr.adapters.security.keys import Identity, KeyDir
from dcr.errors import ConfigError

__all__ = ["Security", "check_bind", "is_loopback"]

log = logging.getLogger("dcr.adapters.security")


@dataclass(frozen=True, slots=True)
class Security:
    """The key material a process's sockets use: ``keys`` (``None``: no CURVE, loopback only
    unless ``insecure``)."""

    keys: KeyDir | None = None
    insecure: bool = False

    @property
    def keyed(self) -> bool:
        return self.keys is not None

    def server(self, sock: Any, identity: Identity, domain: str) -> None:
        """Make ``sock`` a CURVE server of ``identity`` whose clients this context's ZAP
        handler checks against the keyring (no-op without keys).  Call in the event loop
        that serves the socket; :func:`release` the context's handler when the socket closes."""
        if self.keys is None:
            return
        import zmq

        from dcr.adapters.security.curve import authenticator

        public, secret = self.keys.pair(identity)
        authenticator(sock.context, self.keys)
        sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)

    def client(self, sock: Any, identity: Identity, server: Identity) -> None:
        """Make ``sock`` a CURVE client of ``identity`` that talks only to ``server``'s key
        (no-op without keys)."""
        if self.keys is None:
            return
        import zmq

        public, secret = self.keys.pair(identity)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.keys.keyring().public(server))

    def endpoint_identity(self, name: str) -> Identity:
        """The identity of control endpoint ``name``: the owner or receiver of that name."""
        assert self.keys is not None
        ring = self.keys.keyring()
        found = [i for i in (Identity("owner", name), Identity("receiver", name)) if i in ring]
        if len(found) != 1:
            raise ConfigError(
                f"the keyring must hold exactly one of owner:{name} and receiver:{name} "
                f"(it holds {[str(i) for i in found] or 'neither'}): `dcr keys add`"
            )
        return found[0]

    def release(self, sock: Any) -> None:
        """The server socket ``sock`` is closing: drop its hold on the ZAP handler."""
        if self.keys is not None:
            from dcr.adapters.security.curve import release

            release(sock.context)


def is_loopback(address: str) -> bool:
    """Whether a ZeroMQ address stays on this host (``inproc``, ``ipc``, a loopback IP)."""
    scheme, _, rest = address.partition("://")
    if scheme in ("inproc", "ipc"):
        return True
    host = rest.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(address: str, security: Security, what: str) -> None:
    """Refuse to bind ``address`` off this host without keys, unless ``insecure``; warn then."""
    if security.keyed or is_loopback(address):
        return
    if not security.insecure:
        raise ConfigError(
            f"{what} would listen on {address} without authentication or encryption: give the "
            "fleet a key directory (`dcr keys init`, [fleet] keys = ...), bind 127.0.0.1, or "
            "say insecure = true in [fleet] to accept that anyone who reaches the port can "
            "send and read weights"
        )
    log.warning(
        "INSECURE: %s listens on %s without authentication or encryption (insecure = true)",
        what,
        address,
    )
