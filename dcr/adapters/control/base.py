"""The control-channel interface.

The coordinator *calls* endpoints (owners and receivers) with the events of
``docs/protocol.md`` (``PrepareRequested``, ``FlushRequested``, ...); endpoints *notify* the
coordinators with their replies.  Calls and replies carry attempt ids and may be lost
(endpoints and coordinators ignore what does not concern them); the engine retries what must
arrive.  A reply goes to every live coordinator, since an endpoint cannot know whether the one
that called it was replaced.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass

from dcr.protocol.events import CoordinatorEvent

__all__ = ["ControlChannel", "ReadCommitRecord"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ReadCommitRecord:
    """Call to an owner: read the commit record now (the coordinator's baseline request)."""


class ControlChannel(ABC):
    """Addressed, unordered, possibly lossy messages between coordinators and endpoints."""

    @abstractmethod
    async def call(self, endpoint: str, message: object) -> None:
        """Deliver ``message`` to ``endpoint``'s inbox (dropped if it has none)."""

    @abstractmethod
    async def notify(self, event: CoordinatorEvent) -> None:
        """Deliver ``event`` to every live coordinator."""

    @abstractmethod
    def endpoint_inbox(self, name: str) -> AsyncIterator[object]:
        """Open ``name``'s inbox; its calls arrive there until :meth:`close_endpoint`."""

    @abstractmethod
    def close_endpoint(self, name: str) -> None:
        """Close ``name``'s inbox (its process is gone); later calls to it are dropped."""

    @abstractmethod
    def coordinator_inbox(self, epoch: int) -> AsyncIterator[CoordinatorEvent]:
        """Open the inbox of the coordinator of ``epoch``."""

    @abstractmethod
    def close_coordinator(self, epoch: int) -> None:
        """Close that coordinator's inbox."""

    @abstractmethod
    async def post(self, epoch: int, event: CoordinatorEvent) -> None:
        """Deliver ``event`` to the coordinator of ``epoch`` only (its own engine's reports)."""
