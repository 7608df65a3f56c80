"""Back-pressure of a receiver's ingestion (paper App. B.1): deliveries parked unread.

While the bounded queue is full, the deliveries the transport hands over are held unread and
unacknowledged, so that the owners slow down -- except the one payload the declared order
needs next, which always gets through.  ``window`` is the transport's credit: how many
deliveries it hands over without acknowledgement.  Parked deliveries leave one of them free;
beyond that they are acknowledged unread and held in host memory.

A delivery can also come *early*: the payloads of a dense-refit job may overtake the job's
call to the receiver (they travel on the transport, the call on the control channel).  Such
a delivery is held the same way until its job or attempt starts, and then goes through as
if it had just arrived; at most ``window`` (or :data:`EARLY_HELD` without credit) are held,
so holding never costs more memory than the transport's window already allows.
"""

from __future__ import annotations

from collections.abc import Callable

from dcr.protocol import commands as cmd
from dcr.protocol.ingest import Ingest
from dcr.protocol.types import PayloadKey

__all__ = ["EARLY_HELD", "Parking"]

EARLY_HELD = 16
"""The most early deliveries held for a transport without credit (``window=None``)."""


class Parking:
    """The deliveries a receiver holds unread, in arrival order, across its ingestions."""

    def __init__(self, window: int | None) -> None:
        self.window = window
        self._parked: dict[int, PayloadKey] = {}
        """Deliveries held unread while the queue back-pressures ingestion, in arrival order."""
        self._unacked: list[int] = []
        """Parked deliveries not yet acknowledged to the transport, oldest first."""
        self._early: set[int] = set()
        """Parked deliveries whose attempt or dense job has not started yet."""

    def __len__(self) -> int:
        return len(self._parked)

    def park(self, delivery: int, key: PayloadKey, out: list[cmd.ReceiverCommand]) -> None:
        """Hold a delivery unread and unacknowledged: the owners slow down (App. B.1)."""
        self._parked[delivery] = key
        self._unacked.append(delivery)
        if self.window is not None and len(self._unacked) >= self.window:
            # Keep one credit for the payload the declared order needs next.
            out.append(cmd.Acknowledge(delivery=self._unacked.pop(0)))

    def hold_early(self, delivery: int, key: PayloadKey, out: list[cmd.ReceiverCommand]) -> None:
        """Hold a delivery whose attempt (or dense job) has not started yet, if room is left;
        it is discarded (and so acknowledged) beyond :meth:`early_limit`."""
        if len(self._early) >= self.early_limit:
            out.append(cmd.Discard(delivery=delivery, reason="early-overflow"))
            return
        self._early.add(delivery)
        self.park(delivery, key, out)

    @property
    def early_limit(self) -> int:
        return self.window if self.window is not None else EARLY_HELD

    @property
    def early(self) -> int:
        """How many held deliveries wait for their attempt or dense job to start."""
        return len(self._early)

    def adopt(self, attempt: int) -> list[tuple[int, PayloadKey]]:
        """The early deliveries of ``attempt``, which has just started, in arrival order: from
        now on they are parked like any other (their acknowledgements unchanged)."""
        taken = [(d, k) for d, k in self._parked.items() if k.attempt == attempt]
        taken = [(d, k) for d, k in taken if d in self._early]
        self._early.difference_update(d for d, _ in taken)
        return taken

    def take(self, delivery: int) -> None:
        """Let a parked delivery through (its reception checks acknowledge it if need be)."""
        self._unpark(delivery)

    def _unpark(self, delivery: int) -> None:
        del self._parked[delivery]
        self._early.discard(delivery)
        if delivery in self._unacked:
            self._unacked.remove(delivery)

    def release(self, s: Ingest, capacity: int, out: list[cmd.ReceiverCommand]) -> None:
        """Let parked deliveries of ``s`` through: the wanted one while paused, otherwise as
        many as the queue has room for, in arrival order."""
        for delivery, key in list(self._parked.items()):
            if key.attempt != s.attempt or delivery in self._early:
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
