"""CURVE on dcr's ZeroMQ sockets: servers that admit only keyring members and learn who is
speaking from the authenticated key, clients that check the server's key, and the rule for
binding without keys.

Every server socket of a keyed fleet (a coordinator's ROUTER, a relay node's ROUTER) is a CURVE
server with a ZAP domain; one ZAP handler per ZeroMQ context (pyzmq's
:class:`~zmq.auth.asyncio.AsyncioAuthenticator`) admits a client only when its public key is in
the fleet's keyring, with a role the domain accepts, and stamps every message of the connection
with the identity the key belongs to (ZeroMQ's ``User-Id`` message property, read back with
:func:`peer_identity`).  So a peer's role and name come from the key it proved it holds, never
from a routing id or a field it wrote itself.

Without keys a fleet runs on loopback only: :func:`check_bind` refuses to bind any other address
unless the fleet says ``insecure = true``, and then warns at every start.
"""

from __future__ import annotations

import ipaddress
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.utils import z85

from dcr.adapters.security.keys import Identity, KeyDir
from dcr.errors import ConfigError

__all__ = [
    "CONTROL",
    "RELAY",
    "Security",
    "auth_counts",
    "check_bind",
    "is_loopback",
    "peer_identity",
    "release",
]

log = logging.getLogger(__name__)

CONTROL = "dcr-control"
"""ZAP domain of the control channel: owners and receivers connect to a coordinator."""
RELAY = "dcr-relay"
"""ZAP domain of the relay tree: owners and coordinators (payloads, stops), child relay nodes
and receivers connect to a relay node."""
_CLIENT_ROLES = {
    CONTROL: frozenset({"owner", "receiver"}),
    RELAY: frozenset({"owner", "coordinator", "relay", "receiver"}),
}


@dataclass(frozen=True, slots=True)
class Security:
    """The key material a process's sockets use: ``keys`` (``None``: no CURVE, loopback only
    unless ``insecure``)."""

    keys: KeyDir | None = None
    insecure: bool = False

    @property
    def keyed(self) -> bool:
        return self.keys is not None

    def server(self, sock: zmq.Socket[Any], identity: Identity, domain: str) -> None:
        """Make ``sock`` a CURVE server of ``identity`` whose clients this context's ZAP
        handler checks against the keyring (no-op without keys).  Call in the event loop
        that serves the socket; :func:`release` the context's handler when the socket closes."""
        if self.keys is None:
            return
        public, secret = self.keys.pair(identity)
        _authenticator(sock.context, self.keys)
        sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)

    def client(self, sock: zmq.Socket[Any], identity: Identity, server: Identity) -> None:
        """Make ``sock`` a CURVE client of ``identity`` that talks only to ``server``'s key
        (no-op without keys)."""
        if self.keys is None:
            return
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

    def release(self, sock: zmq.Socket[Any]) -> None:
        """The server socket ``sock`` is closing: drop its hold on the ZAP handler."""
        if self.keys is not None:
            release(sock.context)


def peer_identity(frame: zmq.Frame) -> Identity | None:
    """The authenticated identity of the connection ``frame`` came from (``None``: the socket
    has no CURVE, or the property is missing)."""
    try:
        user = frame.get("User-Id")
    except (zmq.ZMQError, AttributeError):
        return None
    if not isinstance(user, str) or ":" not in user:
        return None
    try:
        return Identity.parse(user)
    except ConfigError:
        return None


# -- the ZAP handler of a context ------------------------------------------------------------


class _Provider:
    def __init__(self, keys: KeyDir, counts: Counter[str]) -> None:
        self.keys, self.counts = keys, counts

    def callback(self, domain: str, key: bytes) -> bool:
        identity = self.keys.keyring().identity(key)
        ok = identity is not None and identity.role in _CLIENT_ROLES.get(domain, frozenset())
        self.counts["allowed" if ok else "denied"] += 1
        if not ok:
            log.warning(
                "refused a %s connection: %s", domain,
                "key not in the keyring" if identity is None else f"{identity} may not connect",
            )
        return ok


class _FleetAuthenticator(AsyncioAuthenticator):
    """pyzmq's authenticator with the keyring's identity as each connection's ``User-Id``."""

    def __init__(self, context: zmq.asyncio.Context, keys: KeyDir) -> None:
        super().__init__(context, log=logging.getLogger("dcr.zap"))
        self.keys = keys
        self.counts: Counter[str] = Counter()
        self.users = 0

    def curve_user_id(self, client_public_key: bytes) -> str:
        identity = self.keys.keyring().identity(z85.encode(client_public_key))
        return str(identity) if identity is not None else ""


_HANDLERS: dict[int, tuple[zmq.Context[Any], _FleetAuthenticator]] = {}


def _authenticator(context: zmq.Context[Any], keys: KeyDir) -> _FleetAuthenticator:
    held = _HANDLERS.get(id(context))
    if held is not None and held[0] is context:
        auth = held[1]
        if auth.keys.path.resolve() != keys.path.resolve():
            raise ConfigError(
                "one ZeroMQ context serves one key directory: "
                f"{str(auth.keys.path)!r} already, not {str(keys.path)!r}"
            )
    else:
        if not isinstance(context, zmq.asyncio.Context):
            raise ConfigError("CURVE servers need an asyncio ZeroMQ context")
        auth = _FleetAuthenticator(context, keys)
        try:
            auth.start()
        except zmq.ZMQError as exc:
            raise ConfigError(f"this ZeroMQ context already has a ZAP handler: {exc}") from exc
        provider = _Provider(keys, auth.counts)
        for domain in _CLIENT_ROLES:
            auth.configure_curve_callback(domain, credentials_provider=provider)
        _HANDLERS[id(context)] = (context, auth)
    auth.users += 1
    return auth


def release(context: zmq.Context[Any]) -> None:
    """One server socket of ``context`` closed; the last one stops the ZAP handler."""
    held = _HANDLERS.get(id(context))
    if held is None or held[0] is not context:
        return
    auth = held[1]
    auth.users -= 1
    if auth.users <= 0:
        del _HANDLERS[id(context)]
        auth.stop()


def auth_counts(context: zmq.Context[Any]) -> Counter[str]:
    """ZAP decisions in ``context`` so far: ``allowed`` and ``denied`` connections."""
    held = _HANDLERS.get(id(context))
    return Counter(held[1].counts) if held is not None and held[0] is context else Counter()


# -- binding ---------------------------------------------------------------------------------


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
        what, address,
    )
