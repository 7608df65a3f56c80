"""The endpoint side of the ZeroMQ control channel: a DEALER of one endpoint, connected to
the current coordinator (a fixed address, or the one the commit store names)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import anyio
import zmq
import zmq.asyncio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from dcr.adapters.control.base import EndpointLink
from dcr.adapters.control.zmq.link import (
    Bye,
    Hello,
    LinkTasks,
    Ping,
    routing_id,
    send_now,
    set_options,
)
from dcr.adapters.security import COORDINATOR as COORDINATOR_IDENTITY
from dcr.errors import CommitStoreError, ConfigError, ControlMessageRejected
from dcr.protocol import messages as msg

if TYPE_CHECKING:
    from dcr.adapters.control.zmq.channel import ZmqControl

_BYE_LINGER_MS = 100
"""How long a closing endpoint socket may hold its goodbye (ZeroMQ waits for it only when
the coordinator is unreachable)."""


class ZmqEndpointLink(EndpointLink):
    """A DEALER to the current coordinator; with keys, a CURVE client of the endpoint's
    identity that talks only to the fleet's coordinator key."""

    def __init__(self, control: ZmqControl, name: str) -> None:
        super().__init__(name)
        self._control = control
        routing_id(name)  # checks the name
        security = control.security
        self._identity = security.endpoint_identity(name) if security.keyed else None
        self._config = control.config
        self.address = ""
        """The coordinator address this link is connected to (empty: none known yet)."""
        self._sock: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task[None] | None = None
        self._store_epoch = 0
        self._closed = False
        self._send: MemoryObjectSendStream[tuple[int, msg.Call]]
        self._recv: MemoryObjectReceiveStream[tuple[int, msg.Call]]
        self._send, self._recv = anyio.create_memory_object_stream[tuple[int, msg.Call]](
            self._config.pending_calls
        )
        self._tasks = LinkTasks(self._send.close)

    async def open(self) -> None:
        """Connect to the configured address or the store's coordinator; start heartbeats."""
        control = self._control
        if control.address is not None:
            self._connect(control.address)
        elif control.store is not None:
            await self._follow(raising=True)
            self._tasks.spawn(self._watch())
        self._tasks.spawn(self._beat())

    # -- sending ------------------------------------------------------------------------------

    def _emit(self, message: object) -> None:
        if self._sock is None:
            self.drops["no-coordinator"] += 1
            return
        data = self._control.codec.encode(message, epoch=self.epoch, sender=self.name)
        if send_now(self._sock, [data]) != 0:
            self.drops["unsent"] += 1

    async def notify(self, reply: msg.Reply) -> None:
        if self._closed:
            self.drops["closed"] += 1
            return
        self._emit(reply)

    async def _beat(self) -> None:
        while True:
            await anyio.sleep(self._config.ping_s)
            if self._sock is not None:
                self._emit(Hello(status=self.status))

    # -- connecting ---------------------------------------------------------------------------

    def _connect(self, address: str) -> None:
        """Replace the connection by one to ``address`` and say hello there.

        Synchronous on purpose: no cancellation can leave a socket half-owned."""
        control = self._control
        sock = control.context().socket(zmq.DEALER)
        try:
            set_options(sock, self._config)
            if self._identity is not None:
                control.security.client(sock, self._identity, COORDINATOR_IDENTITY)
            else:
                sock.setsockopt(zmq.ROUTING_ID, routing_id(self.name))
            sock.connect(address)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise ConfigError(f"cannot connect to the coordinator at {address!r}: {exc}") from exc
        except BaseException:
            sock.close(linger=0)
            raise
        self._disconnect()
        self._sock, self.address = sock, address
        self._reader = self._tasks.spawn(self._read(sock))
        self._emit(Hello(status=self.status))

    def _disconnect(self) -> None:
        """Say goodbye to the current coordinator, stop reading and close the socket (the
        goodbye may still leave within a short linger)."""
        sock, reader = self._sock, self._reader
        self._sock = self._reader = None
        if reader is not None:
            reader.cancel()
        if sock is not None:
            send_now(sock, [self._control.codec.encode(Bye(), epoch=self.epoch, sender=self.name)])
            sock.close(linger=_BYE_LINGER_MS)

    async def _watch(self) -> None:
        while True:
            await anyio.sleep(self._config.watch_s)
            await self._follow(raising=False)

    async def _follow(self, *, raising: bool) -> None:
        """Read the commit record; connect to a coordinator that claimed a newer epoch."""
        assert self._control.store is not None
        try:
            state = await self._control.store.read()
        except CommitStoreError:
            if raising:
                raise
            self.drops["store"] += 1
            return
        if state.epoch < self._store_epoch:
            return
        self._store_epoch = state.epoch
        self.epoch = max(self.epoch, state.epoch)
        if not state.address or state.address == self.address:
            return
        try:
            self._connect(state.address)
        except ConfigError:
            if raising:
                raise
            self.drops["address"] += 1

    # -- receiving ----------------------------------------------------------------------------

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        codec = self._control.codec
        while True:
            parts = await sock.recv_multipart(copy=False)
            if len(parts) != 1:
                self.drops["parts"] += 1
                continue
            try:
                envelope = codec.decode(parts[0].buffer)
            except ControlMessageRejected as exc:
                self.drops[exc.check or "malformed"] += 1
                continue
            message = envelope.message
            if isinstance(message, msg.CALLS):
                await self._send.send((envelope.epoch, message))
            elif not isinstance(message, Ping):
                self.drops["direction"] += 1

    async def calls(self) -> AsyncIterator[msg.Call]:
        while True:
            try:
                epoch, message = await self._recv.receive()
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                self._tasks.check()
                return
            if self.admit(epoch):
                yield message

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._control._forget(self)
        try:
            await self._tasks.cancel()
        finally:
            self._disconnect()
            self._send.close()
            self._recv.close()
