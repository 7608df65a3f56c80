"""The transport interface (paper App. C, Fig. C.1: ``send``, ``stop_and_wait``, ``cleanup``).

Owners hand payloads to :meth:`Transport.send` under their key ``(attempt, owner, payload id)``;
every subscribed receiver eventually gets each payload as a :class:`Delivery`.  Keys come from
the transport's own metadata (an object key, a relay envelope), not from the payload bytes, so a
receiver can name a payload whose bytes are damaged.  ``stop_and_wait(attempt)`` stops delivery
of the attempt and returns once nothing of it is in flight; ``cleanup(attempt)`` releases what
the transport still holds of it.  A new transport is one subclass of :class:`Transport`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass

from dcr.protocol.types import PayloadKey

__all__ = ["Delivery", "Transport"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Delivery:
    """One payload as a receiver gets it."""

    key: PayloadKey
    data: bytes


class Transport(ABC):
    """Moves payload bytes from owners to every subscribed receiver.

    ``arrival_grace_s``: after an owner's ``send`` returned, how long its payload may still
    take to reach a receiver.  At flush a receiver waits this long for expected payloads, then
    fails the attempt for the missing ones (paper App. B.1, the arrival check).
    """

    arrival_grace_s: float = 30.0

    @abstractmethod
    async def send(self, key: PayloadKey, data: bytes) -> None:
        """Accept a payload for delivery; raises :class:`~dcr.errors.TransportError`.

        Payloads of an attempt that :meth:`stop_and_wait` stopped are refused
        (``retryable=False``).
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

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Release connections and background tasks."""
