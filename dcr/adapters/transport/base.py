"""The transport interface (paper App. C, Fig. C.1: ``send``, ``stop_and_wait``, ``cleanup``).

Owners hand payloads to :meth:`Transport.send` under their key ``(attempt, owner, payload id)``;
every subscribed receiver (or every receiver named in ``to``) eventually gets each payload as a
:class:`Delivery`.  Keys come from the transport's own metadata (an object key, a relay
envelope), not from the payload bytes, so a receiver can name a payload whose bytes are damaged.

A receiver confirms each delivery it took into its staging queue with :meth:`Transport.taken`
(the *queueing ACK* of paper App. C); transports that bound what is in flight use these ACKs
for credit, so a slow receiver slows owners down instead of growing memory.
``stop_and_wait(attempt)`` stops delivery of the attempt and returns once nothing of it is in
flight; ``cleanup(attempt)`` releases what the transport still holds of it.  A new transport
is one subclass of :class:`Transport`; a layer around one (fault injection, timing) is one
subclass of :class:`TransportWrapper`.  A transport that queues deliveries per receiver hands
each receiver a :class:`Deliveries` over its :class:`Inbox`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, Self

import anyio

from dcr.errors import ConfigError
from dcr.protocol.types import PayloadKey

if TYPE_CHECKING:
    from dcr.adapters.context import AdapterContext

__all__ = [
    "Deliveries",
    "Delivery",
    "Inbox",
    "Transport",
    "TransportStats",
    "TransportWrapper",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class Delivery:
    """One payload as a receiver gets it."""

    key: PayloadKey
    data: bytes
    addressed: bool = False
    """Sent to this receiver by name (``send(..., to=...)``: a dense refit's payloads), not
    to every subscriber.  Such a payload may overtake the call that announces its job, so
    the receiver holds it until the call arrives instead of dropping it."""


class Inbox(Protocol):
    """One receiver's queue of deliveries as a transport keeps it: :class:`Deliveries` reads
    it.  The transport appends to ``inbox``, then sets ``wake`` (when there is one) to wake
    the reader; it sets ``closed`` (and ``wake``) when the subscription ends."""

    @property
    def inbox(self) -> deque[Delivery]: ...

    @property
    def closed(self) -> bool: ...

    @property
    def wake(self) -> anyio.Event | None: ...

    @wake.setter
    def wake(self, event: anyio.Event) -> None: ...


class Deliveries(AsyncIterator[Delivery]):
    """The async iterator ``subscribe`` returns over one receiver's :class:`Inbox`: it yields
    the deliveries in arrival order, waits on a fresh ``wake`` event while the inbox is
    empty, and ends once the subscription is closed and its inbox drained."""

    def __init__(self, sub: Inbox) -> None:
        self._sub = sub

    def __aiter__(self) -> Deliveries:
        return self

    async def __anext__(self) -> Delivery:
        sub = self._sub
        while not sub.inbox:
            if sub.closed:
                raise StopAsyncIteration
            wake = sub.wake = anyio.Event()
            await wake.wait()
        return sub.inbox.popleft()


@dataclass(frozen=True, slots=True, kw_only=True)
class TransportStats:
    """Payload traffic as this transport object saw it (paper §8.7 definitions).

    ``cross_bytes`` (V_cross) counts payload bytes that crossed the training -> rollout
    boundary, every copy included (a payload re-sent after a fault counts twice);
    ``payload_bytes`` (V_payload) counts each distinct payload ``(attempt, owner, id)`` once.
    For a fault-free attempt the two are equal.
    """

    payloads: int = 0
    """Distinct payloads accepted."""
    payload_bytes: int = 0
    cross_bytes: int = 0


class Transport(ABC):
    """Moves payload bytes from owners to every subscribed receiver.

    ``arrival_grace_s``: after an owner's ``send`` returned, how long its payload may still
    take to reach a receiver.  At flush a receiver waits this long for expected payloads, then
    fails the attempt for the missing ones (paper App. B.1, the arrival check).
    """

    arrival_grace_s: float = 30.0
    receiver_window: int | None = None
    """Deliveries a receiver may hold without acknowledging them (:meth:`taken`) before the
    transport stops handing it more; ``None`` when the transport keeps no such credit."""
    needs_relay_processes: ClassVar[bool] = False
    """Whether a fleet using this transport runs ``dcr relay`` processes, one per rollout
    node (the relay tree), for the launcher to start, supervise and strike with faults."""

    @classmethod
    def from_config(cls, options: Mapping[str, Any], context: AdapterContext) -> Self:
        """The transport of one process, from its fleet file section (``options``: the keys
        beside ``kind``) and the process around it (:class:`~dcr.adapters.context.
        AdapterContext`).  Unknown keys raise :class:`~dcr.errors.ConfigError`.

        Transports that a fleet file can name override it; this one refuses.
        """
        raise ConfigError(
            f"{cls.__module__}.{cls.__qualname__} defines no from_config(options, context), "
            f"so [{context.section}] cannot name it"
        )

    @abstractmethod
    async def send(self, key: PayloadKey, data: bytes, *, to: frozenset[str] | None = None) -> None:
        """Accept a payload for delivery; raises :class:`~dcr.errors.TransportError`.

        ``to`` limits delivery to the named receivers (a dense refit of one joining receiver);
        ``None`` delivers to every subscribed receiver.  Payloads of an attempt that
        :meth:`stop_and_wait` stopped are refused (``retryable=False``).
        """

    @abstractmethod
    async def stop_and_wait(self, attempt: int) -> None:
        """Stop delivering ``attempt`` and return once none of its payloads is in flight."""

    @abstractmethod
    async def cleanup(self, attempt: int) -> None:
        """Release everything the transport holds of ``attempt``."""

    @abstractmethod
    def subscribe(self, receiver: str) -> AsyncIterator[Delivery]:
        """The deliveries for ``receiver``, in arrival order, until :meth:`unsubscribe`."""

    @abstractmethod
    def unsubscribe(self, receiver: str) -> None:
        """End ``receiver``'s subscription (its process is gone)."""

    async def taken(self, receiver: str, key: PayloadKey) -> None:  # noqa: B027 - optional
        """Queueing ACK: ``receiver`` took ``key`` into its staging queue (or discarded it).

        Transports without credit ignore it.
        """

    def stats(self) -> TransportStats:
        """Traffic counters (zero where the transport object cannot see them)."""
        return TransportStats()

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Release connections and background tasks."""


class TransportWrapper(Transport):
    """A transport that delegates every call to ``inner``: subclasses override the calls they
    observe or change (the fault injection of :mod:`dcr.adapters.faulty`, the fleet's timing
    of sends)."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.arrival_grace_s = inner.arrival_grace_s
        self.receiver_window = inner.receiver_window

    async def send(self, key: PayloadKey, data: bytes, *, to: frozenset[str] | None = None) -> None:
        await self.inner.send(key, data, to=to)

    async def stop_and_wait(self, attempt: int) -> None:
        await self.inner.stop_and_wait(attempt)

    async def cleanup(self, attempt: int) -> None:
        await self.inner.cleanup(attempt)

    def subscribe(self, receiver: str) -> AsyncIterator[Delivery]:
        return self.inner.subscribe(receiver)

    def unsubscribe(self, receiver: str) -> None:
        self.inner.unsubscribe(receiver)

    async def taken(self, receiver: str, key: PayloadKey) -> None:
        await self.inner.taken(receiver, key)

    def stats(self) -> TransportStats:
        return self.inner.stats()

    async def aclose(self) -> None:
        await self.inner.aclose()
