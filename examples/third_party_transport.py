"""A third-party transport for dcr: payloads in a dict of per-receiver queues, one process.

``QueueTransport`` keeps a queue for every subscribed receiver in a dict; ``send`` appends the
payload to the queue of every receiver it is meant for (all, or those named in ``to``), and
each receiver's ``subscribe`` iterator drains its own queue in order.  A send never waits for
receivers (no credit), so delivery is complete when ``send`` returns.  Stopped attempts are
refused, and the transport counts V_cross (every copy) and V_payload (each key once).
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator

import anyio

from dcr.adapters.transport import Delivery, Transport, TransportStats
from dcr.errors import TransportError
from dcr.protocol.types import PayloadKey


class _Queue:
    """One receiver's deliveries, and the event that wakes its iterator."""

    def __init__(self) -> None:
        self.items: deque[Delivery] = deque()
        self.wake = anyio.Event()
        self.closed = False

    def put(self, delivery: Delivery) -> None:
        self.items.append(delivery)
        self.wake.set()

    def close(self) -> None:
        self.closed = True
        self.wake.set()


class QueueTransport(Transport):
    """Each subscribed receiver gets every payload sent to it after it subscribed, in order."""

    arrival_grace_s = 0.5  # a payload is in its receivers' queues when send returns

    def __init__(self) -> None:
        self.queues: dict[str, _Queue] = {}
        self.stopped: set[int] = set()
        self.seen: set[PayloadKey] = set()  # keys of attempts not cleaned up yet
        self.counted = TransportStats()

    async def send(self, key: PayloadKey, data: bytes, *, to: frozenset[str] | None = None) -> None:
        if key.attempt in self.stopped:
            raise TransportError(
                "the attempt was stopped; payload refused",
                retryable=False,
                attempt=key.attempt,
                check="stopped",
            )
        new = key not in self.seen
        self.seen.add(key)
        c = self.counted
        self.counted = TransportStats(
            payloads=c.payloads + new,
            payload_bytes=c.payload_bytes + (len(data) if new else 0),
            cross_bytes=c.cross_bytes + len(data),
        )
        for name, queue in list(self.queues.items()):
            if to is None or name in to:
                queue.put(Delivery(key=key, data=data))

    async def stop_and_wait(self, attempt: int) -> None:
        self.stopped.add(attempt)  # delivery completes within send: nothing is in flight

    async def cleanup(self, attempt: int) -> None:
        self.stopped.add(attempt)
        self.seen = {k for k in self.seen if k.attempt != attempt}

    def subscribe(self, receiver: str) -> AsyncIterator[Delivery]:
        if receiver in self.queues:
            raise TransportError(f"{receiver!r} is subscribed already", retryable=False)
        queue = self.queues[receiver] = _Queue()
        return self._drain(queue)

    async def _drain(self, queue: _Queue) -> AsyncIterator[Delivery]:
        while True:
            while queue.items:
                yield queue.items.popleft()
            if queue.closed:
                return
            queue.wake = anyio.Event()
            await queue.wake.wait()

    def unsubscribe(self, receiver: str) -> None:
        queue = self.queues.pop(receiver, None)
        if queue is not None:
            queue.close()

    def stats(self) -> TransportStats:
        return self.counted
