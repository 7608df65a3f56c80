"""An in-memory transport: payloads fan out to per-receiver queues in one process."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from dcr.adapters.transport.base import Delivery, Transport
from dcr.errors import TransportError
from dcr.protocol.types import PayloadKey

__all__ = ["MemoryTransport"]


class MemoryTransport(Transport):
    """Each subscribed receiver gets every payload sent after it subscribed.

    Like object storage, the transport never blocks a sender: payloads wait in the receivers'
    queues until they read them (the receiver engine bounds what it decodes).  ``bytes_sent``
    counts payload bytes accepted, once per payload.
    """

    arrival_grace_s = 0.0
    """Delivery completes within ``send``: whatever has not arrived at flush never will."""

    def __init__(self) -> None:
        self._queues: dict[
            str, tuple[MemoryObjectSendStream[Delivery], MemoryObjectReceiveStream[Delivery]]
        ] = {}
        self._stopped: set[int] = set()
        self.bytes_sent = 0
        self.payloads_sent = 0

    async def send(self, key: PayloadKey, data: bytes) -> None:
        if key.attempt in self._stopped:
            raise TransportError(
                "the attempt was stopped; payload refused",
                retryable=False,
                attempt=key.attempt,
                check="stopped",
            )
        self.bytes_sent += len(data)
        self.payloads_sent += 1
        for send, _ in list(self._queues.values()):
            try:
                send.send_nowait(Delivery(key=key, data=data))
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                continue

    async def stop_and_wait(self, attempt: int) -> None:
        # Delivery is synchronous with send: once stopped, nothing of it is in flight.
        self._stopped.add(attempt)

    async def cleanup(self, attempt: int) -> None:
        self._stopped.add(attempt)

    def subscribe(self, receiver: str) -> AsyncIterator[Delivery]:
        if receiver in self._queues:
            raise TransportError(
                f"{receiver!r} is already subscribed", retryable=False, check="subscribe"
            )
        send, recv = anyio.create_memory_object_stream[Delivery](math.inf)
        self._queues[receiver] = (send, recv)
        return recv.__aiter__()

    def unsubscribe(self, receiver: str) -> None:
        pair = self._queues.pop(receiver, None)
        if pair is not None:
            pair[0].close()
            pair[1].close()
