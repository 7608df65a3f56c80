"""An in-memory control channel: every link is an anyio memory stream in one process."""

from __future__ import annotations

import contextlib
import math
from collections import deque
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any, Self

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from dcr.adapters.control.base import (
    PENDING_CALLS,
    ControlChannel,
    CoordinatorLink,
    EndpointLink,
    refusal,
)
from dcr.errors import ConfigError
from dcr.protocol import messages as msg

if TYPE_CHECKING:
    from dcr.adapters.context import AdapterContext

__all__ = ["MemoryControl"]


class _Endpoint(EndpointLink):
    def __init__(self, hub: MemoryControl, name: str) -> None:
        super().__init__(name)
        self._hub = hub
        self._send, self._recv = anyio.create_memory_object_stream[tuple[int, msg.Call]](math.inf)

    def deliver(self, epoch: int, message: msg.Call) -> None:
        with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._send.send_nowait((epoch, message))

    async def calls(self) -> AsyncIterator[msg.Call]:
        while True:
            try:
                epoch, message = await self._recv.receive()
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                return
            if self.admit(epoch):
                yield message

    async def notify(self, reply: msg.Reply) -> None:
        reason = refusal(reply, self.name)
        if reason is not None:
            self.drops[reason] += 1
            return
        self._hub.notify_all(reply)

    async def aclose(self) -> None:
        # Only this link's own registration: closing it again after a new link of the same
        # name opened must not unregister the new one.
        if self._hub._endpoints.get(self.name) is self:
            del self._hub._endpoints[self.name]
        self._send.close()
        self._recv.close()


class _Coordinator(CoordinatorLink):
    def __init__(self, hub: MemoryControl) -> None:
        super().__init__()
        self._hub = hub
        self._send: MemoryObjectSendStream[msg.Reply]
        self._recv: MemoryObjectReceiveStream[msg.Reply]
        self._send, self._recv = anyio.create_memory_object_stream[msg.Reply](math.inf)
        self.address = f"memory:{id(self)}"

    async def call(self, endpoint: str, message: msg.Call, *, epoch: int) -> None:
        self._hub.call(endpoint, message, epoch=epoch)

    def deliver(self, reply: msg.Reply) -> None:
        with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._send.send_nowait(reply)

    async def replies(self) -> AsyncIterator[msg.Reply]:
        while True:
            try:
                yield await self._recv.receive()
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                return

    async def aclose(self) -> None:
        self._hub._coordinators.discard(self)
        self._send.close()
        self._recv.close()


class MemoryControl(ControlChannel):
    """Every message is delivered at once; calls to an endpoint that is not open wait for it."""

    def __init__(self) -> None:
        self._endpoints: dict[str, _Endpoint] = {}
        self._coordinators: set[_Coordinator] = set()
        self._pending: dict[str, deque[tuple[int, msg.Call]]] = {}
        self.dropped_pending = 0
        """Calls dropped because too many waited for an endpoint that was not open."""

    @classmethod
    def from_config(cls, options: Mapping[str, Any], context: AdapterContext) -> Self:
        """Refused: the links live in one process, and a fleet's roles run in several."""
        raise ConfigError(
            f"[{context.section}]: the memory control channel links the roles of one process "
            "only and does not reach other processes; use 'zmq'"
        )

    async def endpoint(self, name: str) -> EndpointLink:
        if name in self._endpoints:
            raise ConfigError(f"an endpoint named {name!r} is already open")
        link = _Endpoint(self, name)
        self._endpoints[name] = link
        for epoch, message in self._pending.pop(name, ()):
            link.deliver(epoch, message)
        return link

    async def coordinator(self) -> CoordinatorLink:
        link = _Coordinator(self)
        self._coordinators.add(link)
        return link

    def call(self, endpoint: str, message: msg.Call, *, epoch: int) -> None:
        link = self._endpoints.get(endpoint)
        if link is not None:
            link.deliver(epoch, message)
            return
        pending = self._pending.setdefault(endpoint, deque())
        if len(pending) >= PENDING_CALLS:
            pending.popleft()
            self.dropped_pending += 1
        pending.append((epoch, message))

    def notify_all(self, reply: msg.Reply) -> None:
        """Deliver ``reply`` to every open coordinator link (endpoints and supervisors)."""
        for link in list(self._coordinators):
            link.deliver(reply)
