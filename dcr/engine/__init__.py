"""The anyio engine: services that run the protocol cores, and the context managers that
embed them in any running asyncio (or trio) event loop.

A trainer process hosts one :class:`OwnerService` per training rank (``open_owner``), a
rollout worker hosts one :class:`ReceiverService` per serving rank (``open_receiver``), and
one process per transition runs a :class:`CoordinatorService` (``open_coordinator``).
:class:`~dcr.local.LocalRefit` wires all of them in one process.
"""

from dcr.engine.coordinator import CoordinatorService as CoordinatorService
from dcr.engine.coordinator import Supervisor as Supervisor
from dcr.engine.coordinator import open_coordinator as open_coordinator
from dcr.engine.integration import Integration as Integration
from dcr.engine.owner import OwnerService as OwnerService
from dcr.engine.owner import TrainingSide as TrainingSide
from dcr.engine.owner import open_owner as open_owner
from dcr.engine.receiver import ReceiverHooks as ReceiverHooks
from dcr.engine.receiver import ReceiverService as ReceiverService
from dcr.engine.receiver import open_receiver as open_receiver

__all__ = [
    "CoordinatorService",
    "Integration",
    "OwnerService",
    "ReceiverHooks",
    "ReceiverService",
    "Supervisor",
    "TrainingSide",
    "open_coordinator",
    "open_owner",
    "open_receiver",
]
