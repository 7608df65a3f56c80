"""CURVE on dcr's ZeroMQ sockets: the ZAP handler that admits only keyring members and tells
a server who is speaking from the authenticated key.

Every server socket of a keyed fleet (a coordinator's ROUTER, a relay node's ROUTER) is a CURVE
server with a ZAP domain; one ZAP handler per ZeroMQ context (pyzmq's
:class:`~zmq.auth.asyncio.AsyncioAuthenticator`) admits a client only when its public key is in
the fleet's keyring, with a role the domain accepts, and stamps every message of the connection
with the identity the key belongs to (ZeroMQ's ``User-Id`` message property, read back with
:func:`peer_identity`).  So a peer's role and name come from the key it proved it holds, never
from a routing id or a field it wrote itself.

:class:`~dcr.adapters.security.policy.Security` makes sockets CURVE servers and clients.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from typing import Any

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.utils import z85

from dcr.adapters.security.keys import Identity, KeyDir
from dcr.errors import ConfigError

__all__ = ["CONTROL", "RELAY", "auth_counts", "authenticator", "peer_identity", "release"]

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


def peer_identity(frame: zmq.Frame) -> Identity | None:
    """The authenticated identity of the connection ``frame`` came from (``None``: the socket
    has no CURVE, or the property is missing)."""
    try:
        user = frame.get("User-Id")
    except (zmq.ZMQError, AttributeError):
        return None
    return _parsed(user) if isinstance(user, str) else None


@functools.lru_cache(maxsize=4096)
def _parsed(user: str) -> Identity | None:
    """``user`` (a ZAP ``User-Id``) as an identity, parsed once per distinct value: every
    frame a server receives carries it."""
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
                "refused a %s connection: %s",
                domain,
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


def authenticator(context: zmq.Context[Any], keys: KeyDir) -> _FleetAuthenticator:
    """``context``'s ZAP handler for ``keys`` (started on first use; one per context)."""
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
