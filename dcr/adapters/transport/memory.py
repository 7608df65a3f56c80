"""An in-memory transport: payloads fan out to per-receiver queues in one process."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any, Self

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from dcr.adapters.transport.base import Delivery, Transport, TransportStats
from dcr.errors import ConfigError, TransportError
from dcr.protocol.types import PayloadKey

if TYPE_CHECKING:
    from dcr.adapters.context import AdapterContext

__all__ = ["MemoryTransport"]


class MemoryTransport(Transport):
    """Each subscribed receiver gets every payload sent after it subscribed.

    Like object storage, the transport never blocks a sender: payloads wait in the receivers'
    queues until they read them (the receiver engine bounds what it decodes).
    """

    arrival_grace_s = 0.5
    """Delivery into the receivers' queues completes within ``send``, but a receiver engine
    reads its queue concurrently with its control calls, so a flush may overtake the last
    payloads by a few event-loop turns.  Only an arrival check that finds a payload missing
    waits this long."""

    def __init__(self) -> None:
        self._queues: dict[
            str, tuple[MemoryObjectSendStream[Delivery], MemoryObjectReceiveStream[Delivery]]
        ] = {}
        self._stopped: set[int] = set()
        self._seen: set[PayloadKey] = set()
        self._stats = TransportStats()

    @classmethod
    def from_config(cls, options: Mapping[str, Any], context: AdapterContext) -> Self:
        """Refused: the queues live in one process, and a fleet's roles run in several."""
        raise ConfigError(
            f"[{context.section}]: the memory transport keeps payloads inside one process and "
            "does not reach other processes; use 'relay', 'directory' or 's3'"
        )

    async def send(self, key: PayloadKey, data: bytes, *, to: frozenset[str] | None = None) -> None:
        if key.attempt in self._stopped:
            raise TransportError(
                "the attempt was stopped; payload refused",
                retryable=False,
                attempt=key.attempt,
                check="stopped",
            )
        s = self._stats
        new = key not in self._seen
        self._seen.add(key)
        self._stats = TransportStats(
            payloads=s.payloads + new,
            payload_bytes=s.payload_bytes + (len(data) if new else 0),
            cross_bytes=s.cross_bytes + len(data),
        )
        for name, (send, _) in list(self._queues.items()):
            if to is not None and name not in to:
                continue
            try:
                send.send_nowait(Delivery(key=key, data=data, addressed=to is not None))
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                continue

    async def stop_and_wait(self, attempt: int) -> None:
        # Delivery is synchronous with send: once stopped, nothing of it is in flight.
        self._stopped.add(attempt)

    async def cleanup(self, attempt: int) -> None:
        self._stopped.add(attempt)
        self._seen = {k for k in self._seen if k.attempt != attempt}

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

    def stats(self) -> TransportStats:
        return self._stats
