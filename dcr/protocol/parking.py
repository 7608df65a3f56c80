"""Back-pressure of a receiver's ingestion (paper App. B.1): deliveries parked unread.

While the bounded queue is full, the deliveries the transport hands over are held unread and
unacknowledged, so that the owners slow down -- except the one payload the declared order
needs next, which always gets through.  ``window`` is the transport's credit: how many
deliveries it hands over without acknowledgement.  Parked deliveries leave one of them free;
beyond that they are acknowledged unread and held in host memory.
"""

from __future__ import annotations

from collections.abc import Callable

from dcr.protocol import commands as cmd
from dcr.protocol.ingest import Ingest
from dcr.protocol.types import PayloadKey

__all__ = ["Parking"]


class Parking:
    """The deliveries a receiver holds unread, in arrival order, across its ingestions."""

    def __init__(self, window: int | None) -> None:
        self.window = window
        self._parked: dict[int, PayloadKey] = {}
        """Deliveries held unread while the queue back-pressures ingestion, in arrival order."""
        self._unacked: list[int] = []
        """Parked deliveries not yet acknowledged to the transport, oldest first."""

    def __len__(self) -> int:
        return len(self._parked)

    def park(self, delivery: int, key: PayloadKey, out: list[cmd.ReceiverCommand]) -> None:
        """Hold a delivery unread and unacknowledged: the owners slow down (App. B.1)."""
        self._parked[delivery] = key
        self._unacked.append(delivery)
        if self.window is not None and len(self._unacked) >= self.window:
            # Keep one credit for the payload the declared order needs next.
            out.append(cmd.Acknowledge(delivery=self._unacked.pop(0)))

    def _unpark(self, delivery: int) -> None:
        del self._parked[delivery]
        if delivery in self._unacked:
            self._unacked.remove(delivery)

    def release(self, s: Ingest, capacity: int, out: list[cmd.ReceiverCommand]) -> None:
        """Let parked deliveries of ``s`` through: the wanted one while paused, otherwise as
        many as the queue has room for, in arrival order."""
        for delivery, key in list(self._parked.items()):
            if key.attempt != s.attempt:
                continue
            if s.paused and key != s.want:
                continue
            if not s.paused and s.full(capacity):
                break
            self._unpark(delivery)
            s.checking.add(delivery)
            out.append(cmd.CheckPayload(delivery=delivery))

    def discard(
        self, drop: Callable[[PayloadKey], bool], reason: str, out: list[cmd.ReceiverCommand]
    ) -> None:
        """Discard the parked deliveries whose key ``drop`` selects."""
        for delivery, key in list(self._parked.items()):
            if drop(key):
                self._unpark(delivery)
                out.append(cmd.Discard(delivery=delivery, reason=reason))
