"""ZeroMQ sockets of the relay tree (paper App. B "Transports"): who a peer is, the options
every relay socket shares, sends that never wait, and received messages checked before they are
decoded.  Relay nodes and the transport's client side both use them.

Who a peer is: with the fleet's keys every relay socket is CURVE -- a node's ROUTER is the
server ``relay:<node>``, every DEALER that connects to it (a child node, an owner, the
coordinator, a receiver) a client that checks that server key and sets no routing id (ZeroMQ
assigns one per connection) -- and a peer's role and name come from its authenticated key
(:func:`peer_of`).  Without keys (a loopback fleet) a DEALER's routing id carries its role
(``c:``, ``n:``, ``r:``) and name, as the peer chose them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import zmq
import zmq.asyncio

from dcr.adapters.security import Identity, Security, peer_identity
from dcr.adapters.transport.relay.config import RelayConfig
from dcr.adapters.transport.relay.frames import HEADER_LIMIT, Frame, FrameError, Sized, decode
from dcr.errors import ConfigError, TransportError

__all__ = [
    "CLIENT",
    "NODE",
    "RECEIVER",
    "Peer",
    "bind",
    "connect",
    "decode_frames",
    "identify",
    "node_identity",
    "peer_of",
    "receive",
    "routing_id",
    "send_now",
    "set_common_options",
]

CLIENT, NODE, RECEIVER = b"c:", b"n:", b"r:"
"""Roles of a node's peers; without keys also the prefixes of their routing ids."""
_ROLE_OF_KEY = {"owner": CLIENT, "coordinator": CLIENT, "relay": NODE, "receiver": RECEIVER}
"""With keys: the relay role of each key role (owners and the coordinator are clients)."""


def node_identity(name: str) -> Identity:
    """The identity of relay node ``name`` (its ROUTER's server key, its parent link's key)."""
    return Identity("relay", name)


@dataclass(frozen=True, slots=True)
class Peer:
    """Who sent a message to a node's ROUTER: its ``role`` (:data:`CLIENT`, :data:`NODE`,
    :data:`RECEIVER`, or ``None`` when unknown), its ``name``, and the ``key`` its per-peer
    bounds are kept under (the authenticated identity with keys, the routing id without)."""

    role: bytes | None
    name: str | None
    key: str


def peer_of(ident: bytes, frame: zmq.Frame, keyed: bool) -> Peer:
    """The peer behind a message with routing id ``ident`` whose first part is ``frame``:
    with keys from the authenticated ``User-Id`` only, without from the routing id."""
    if keyed:
        identity = peer_identity(frame)
        if identity is None:
            return Peer(None, None, "unauthenticated")
        return Peer(_ROLE_OF_KEY.get(identity.role), identity.name, str(identity))
    key = "id:" + ident.hex()
    role = ident[:2]
    if role not in (CLIENT, NODE, RECEIVER):
        return Peer(None, None, key)
    try:
        name = ident[2:].decode()
    except UnicodeDecodeError:
        return Peer(role, None, key)
    return Peer(role, name or None, key)


def identify(
    sock: zmq.asyncio.Socket,
    security: Security,
    identity: Identity | None,
    prefix: bytes,
    name: str,
    server: str | None,
) -> None:
    """Say who the DEALER ``sock`` is before it connects to relay node ``server``: with keys
    a CURVE client of ``identity`` that talks only to that node's key (and sets no routing
    id); without keys the routing id ``prefix + name``."""
    if not security.keyed:
        sock.setsockopt(zmq.ROUTING_ID, routing_id(prefix, name))
        return
    if identity is None or server is None:
        raise ConfigError(
            "a relay connection with keys needs this process's identity and the name of the "
            "relay node it connects to (a fleet gives both; by hand: RelayTransport(identity="
            "..., root_name=..., node_name=...), RelayNode(parent_name=...))"
        )
    security.client(sock, identity, node_identity(server))


def routing_id(prefix: bytes, name: str) -> bytes:
    """A peer's ZeroMQ routing id (at most 255 bytes)."""
    ident = prefix + name.encode()
    if not name or len(ident) > 255:
        raise ConfigError(f"relay peer name {name!r} must be 1 to 253 UTF-8 bytes")
    return ident


def set_common_options(sock: zmq.asyncio.Socket, config: RelayConfig) -> None:
    """Options every relay socket shares: no linger, high-water marks, the frame-size limit."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, config.hwm)
    sock.setsockopt(zmq.RCVHWM, config.hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes)
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)


def send_now(sock: zmq.asyncio.Socket, parts: Sequence[bytes | Sized]) -> bool:
    """Send without waiting; ``False`` if the peer is gone or its queue is full.

    Relay nodes and subscriptions never wait on a send, so pyzmq completes a ``NOBLOCK`` send
    at once (with ``EHOSTUNREACH`` under ``ROUTER_MANDATORY`` when the peer vanished).
    """
    future = cast(
        "asyncio.Future[object]", sock.send_multipart(parts, flags=zmq.NOBLOCK, copy=False)
    )
    if not future.done():
        future.cancel()
        raise TransportError("a relay send did not complete at once", retryable=True)
    exc = future.exception()
    if exc is None:
        return True
    if isinstance(exc, zmq.ZMQError) and exc.errno in (zmq.EHOSTUNREACH, zmq.EAGAIN):
        return False
    raise TransportError(f"relay send failed: {exc}", retryable=True) from exc


def decode_frames(parts: Sequence[zmq.Frame], *, max_size: int) -> tuple[Frame, Sized | None]:
    """Check a received message (routing id removed); the header's length is checked
    before its bytes are copied out of the ZeroMQ frame."""
    if not parts:
        raise FrameError("an empty message", check="parts")
    if len(parts[0]) > HEADER_LIMIT:
        raise FrameError("header larger than HEADER_LIMIT", check="oversized")
    return decode(parts[0].bytes, parts[1:], max_size=max_size)


def connect(sock: zmq.asyncio.Socket, address: str) -> None:
    """Connect, closing the socket if the address is refused."""
    try:
        sock.connect(address)
    except zmq.ZMQError:
        sock.close(linger=0)
        raise


async def receive(sock: zmq.asyncio.Socket, name: str) -> list[zmq.Frame]:
    try:
        return await sock.recv_multipart(copy=False)
    except zmq.ZMQError as exc:
        raise TransportError(f"relay node {name}: {exc}", retryable=True, check="socket") from exc


def bind(sock: zmq.asyncio.Socket, address: str) -> str:
    """Bind ``address``; a port of ``0`` picks a free one.  Returns the bound address."""
    try:
        if address.startswith("tcp://") and address.endswith(":0"):
            host = address[: -len(":0")]
            port = sock.bind_to_random_port(host)
            return f"{host}:{port}"
        sock.bind(address)
    except zmq.ZMQError as exc:
        raise TransportError(f"cannot bind {address}: {exc}", retryable=True, check="bind") from exc
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    return endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)
