"""The coordinator side of the ZeroMQ control channel: a ROUTER that endpoints connect to,
who each connection is (its authenticated key, or on a loopback fleet its own word), its view
of connected endpoints, the calls waiting for them and the pings that find the gone."""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio
import zmq
import zmq.asyncio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from dcr.adapters.control.base import CoordinatorLink, refusal
from dcr.adapters.control.zmq.link import (
    COORDINATOR,
    Bye,
    Hello,
    LinkTasks,
    Ping,
    routing_id,
    send_now,
    set_options,
)
from dcr.adapters.security import CONTROL, Identity, check_bind, peer_identity
from dcr.adapters.security import COORDINATOR as COORDINATOR_IDENTITY
from dcr.errors import ConfigError, ControlMessageRejected
from dcr.protocol import messages as msg

if TYPE_CHECKING:
    from dcr.adapters.control.zmq.channel import ZmqControl


@dataclass(slots=True)
class _Peer:
    """A connected endpoint as its coordinator link sees it: ``route`` is the routing id
    ZeroMQ gave its newest connection (calls go there)."""

    route: bytes
    status: msg.EndpointStatus | None
    heard: float


class ZmqCoordinatorLink(CoordinatorLink):
    """A ROUTER that endpoints connect to; the address goes into the commit record."""

    def __init__(self, control: ZmqControl) -> None:
        super().__init__()
        self._control = control
        self._config = control.config
        self._router: zmq.asyncio.Socket | None = None
        self._secured = False
        self._peers: dict[str, _Peer] = {}
        self._pending: dict[str, deque[bytes]] = {}
        self._queued: Counter[str] = Counter()
        self._epoch = 0
        self._closed = False
        self._send: MemoryObjectSendStream[tuple[str, msg.Reply]]
        self._recv: MemoryObjectReceiveStream[tuple[str, msg.Reply]]
        self._send, self._recv = anyio.create_memory_object_stream[tuple[str, msg.Reply]](
            self._config.replies_buffer
        )
        self._tasks = LinkTasks(self._send.close)
        self.stalled_s = 0.0
        """Seconds this link's ticks came late (its process did not run): not counted as any
        peer's silence."""

    async def open(self) -> None:
        control = self._control
        sock = control.context().socket(zmq.ROUTER)
        try:
            set_options(sock, self._config)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            if not control.security.keyed:
                # loopback fleets: a restarted endpoint takes its name (its routing id) over
                sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
            check_bind(self._config.bind, control.security, "the control channel")
            control.security.server(sock, COORDINATOR_IDENTITY, CONTROL)
            self._secured = True
            self.address = _bind(sock, self._config.bind)
        except BaseException:
            self._close_socket(sock)
            raise
        self._router = sock
        self._tasks.spawn(self._read(sock))
        self._tasks.spawn(self._tick())

    # -- what the coordinator sees ------------------------------------------------------------

    def endpoints(self) -> dict[str, msg.EndpointStatus | None]:
        """Connected endpoints and the last status each reported (``None``: none yet)."""
        return {name: peer.status for name, peer in self._peers.items()}

    def pending(self, endpoint: str) -> int:
        """Calls waiting for ``endpoint`` to connect."""
        return len(self._pending.get(endpoint, ()))

    # -- calls --------------------------------------------------------------------------------

    async def call(self, endpoint: str, message: msg.Call, *, epoch: int) -> None:
        routing_id(endpoint)
        data = self._control.codec.encode(message, epoch=epoch, sender=COORDINATOR)
        if self._closed:
            self.drops["closed"] += 1
            return
        self._epoch = max(self._epoch, epoch)
        if endpoint in self._peers:
            self._flush(endpoint)
            if endpoint not in self._pending and self._deliver(endpoint, data):
                return
        queue = self._pending.setdefault(endpoint, deque())
        if len(queue) >= self._config.pending_calls:
            queue.popleft()
            self.drops["pending-overflow"] += 1
        queue.append(data)

    def _deliver(self, endpoint: str, data: bytes) -> bool:
        """Send one frame to a connected endpoint; a peer that is gone is forgotten."""
        assert self._router is not None
        peer = self._peers[endpoint]
        errno = send_now(self._router, [peer.route, data])
        if errno == 0:
            return True
        if errno != zmq.EAGAIN and self._peers.get(endpoint) is peer:
            del self._peers[endpoint]
        return False

    def _flush(self, endpoint: str) -> None:
        """Send the calls waiting for ``endpoint``, oldest first, while it takes them."""
        queue = self._pending.get(endpoint)
        while queue and endpoint in self._peers and self._deliver(endpoint, queue[0]):
            queue.popleft()
        if queue is not None and not queue:
            del self._pending[endpoint]

    # -- receiving ----------------------------------------------------------------------------

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        codec = self._control.codec
        keyed = self._control.security.keyed
        while True:
            parts = await sock.recv_multipart(copy=False)
            if len(parts) != 2:
                self.drops["parts"] += 1
                continue
            try:
                envelope = codec.decode(parts[1].buffer)
            except ControlMessageRejected as exc:
                self.drops[exc.check or "malformed"] += 1
                continue
            name, route = envelope.sender, parts[0].bytes
            # who speaks: the key's owner, or on a loopback fleet the routing id it chose
            identity = peer_identity(parts[1]) if keyed else None
            claimed = identity.name if identity is not None else _decoded(route)
            if name != claimed:
                self.drops["sender"] += 1
                continue
            self._on_message(name, route, envelope.message, identity)

    def _on_message(
        self, name: str, route: bytes, message: object, identity: Identity | None
    ) -> None:
        now = time.monotonic()
        role = identity.role if identity is not None else None
        status = message.status if isinstance(message, Hello) else None
        reason = refusal(status if status is not None else message, name, role)
        if reason is not None:
            self.drops[reason] += 1
            return
        peer = self._peers.get(name)
        if isinstance(message, Hello):
            if peer is None:
                self._peers[name] = _Peer(route=route, status=status, heard=now)
                if status is not None:
                    self._push(name, status)
            else:
                peer.route, peer.heard = route, now  # the same name's newest connection
                if status is not None and status != peer.status:
                    peer.status = status
                    self._push(name, status)
            self._flush(name)
        elif isinstance(message, Bye):
            if peer is not None and peer.route == route:
                del self._peers[name]
        elif isinstance(message, msg.REPLIES):
            if peer is not None:
                peer.heard = now
                if isinstance(message, msg.EndpointStatus):
                    peer.status = message
            self._push(name, message)
        else:
            self.drops["direction"] += 1

    def _push(self, name: str, reply: msg.Reply) -> None:
        if self._queued[name] >= self._config.replies_per_endpoint:
            self.drops["peer-overflow"] += 1
            return
        try:
            self._send.send_nowait((name, reply))
        except anyio.WouldBlock:
            self.drops["overflow"] += 1
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            self.drops["closed"] += 1
        else:
            self._queued[name] += 1

    async def _tick(self) -> None:
        """Ping connected endpoints, forget silent or unreachable ones, retry waiting calls.

        A tick that comes late means this link was not listening meanwhile (its process was
        starved or paused): that time is not its peers' silence, and does not count towards
        ``peer_timeout_s`` (it adds up in :attr:`stalled_s`)."""
        codec = self._control.codec
        ping_s = self._config.ping_s
        last = time.monotonic()
        while True:
            await anyio.sleep(ping_s)
            ping = codec.encode(Ping(), epoch=self._epoch, sender=COORDINATOR)
            now = time.monotonic()
            deaf = now - last - ping_s
            last = now
            if deaf > ping_s:
                self.stalled_s += deaf
                for peer in self._peers.values():
                    peer.heard = min(now, peer.heard + deaf)
            for name, peer in list(self._peers.items()):
                if now - peer.heard > self._config.peer_timeout_s:
                    del self._peers[name]
                elif self._deliver(name, ping):
                    self._flush(name)

    async def replies(self) -> AsyncIterator[msg.Reply]:
        while True:
            try:
                name, reply = await self._recv.receive()
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                self._tasks.check()
                return
            self._queued[name] -= 1
            if self._queued[name] <= 0:
                del self._queued[name]
            yield reply

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._control._forget(self)
        try:
            await self._tasks.cancel()
        finally:
            if self._router is not None:
                self._close_socket(self._router)
                self._router = None
            self._peers.clear()
            self._send.close()
            self._recv.close()

    def _close_socket(self, sock: zmq.asyncio.Socket) -> None:
        sock.close(linger=0)
        if self._secured:
            self._secured = False
            self._control.security.release(sock)


def _decoded(route: bytes) -> str | None:
    try:
        return route.decode()
    except UnicodeDecodeError:
        return None


def _bind(sock: zmq.asyncio.Socket, address: str) -> str:
    """Bind ``address``; a port of ``0`` picks a free one.  Returns the bound address."""
    try:
        if address.startswith("tcp://") and address.endswith(":0"):
            host = address[: -len(":0")]
            return f"{host}:{sock.bind_to_random_port(host)}"
        sock.bind(address)
    except zmq.ZMQError as exc:
        raise ConfigError(f"cannot bind the control address {address!r}: {exc}") from exc
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    return endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)
