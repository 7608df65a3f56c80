"""Sans-IO core of the refit protocol (paper §6.3, §7, App. B).

Everything here is synchronous and pure: cores take events and return commands, the
lifecycles are data (:data:`~dcr.protocol.lifecycle.EDGES`), and time arrives as events.
This package imports only the standard library and ``transitions``; the anyio engine in
:mod:`dcr.engine` runs the cores and executes their commands.
"""

from dcr.protocol.coordinator import CoordinatorConfig as CoordinatorConfig
from dcr.protocol.coordinator import CoordinatorCore as CoordinatorCore
from dcr.protocol.lifecycle import EDGES as EDGES
from dcr.protocol.lifecycle import AttemptPhase as AttemptPhase
from dcr.protocol.lifecycle import Edge as Edge
from dcr.protocol.lifecycle import OwnerPhase as OwnerPhase
from dcr.protocol.lifecycle import ReceiverPhase as ReceiverPhase
from dcr.protocol.lifecycle import TransitionPhase as TransitionPhase
from dcr.protocol.lifecycle import Trigger as Trigger
from dcr.protocol.machine import StateMachine as StateMachine
from dcr.protocol.owner import OwnerCore as OwnerCore
from dcr.protocol.receiver import QueueConfig as QueueConfig
from dcr.protocol.receiver import ReceiverCore as ReceiverCore
from dcr.protocol.types import AttemptInfo as AttemptInfo
from dcr.protocol.types import CommitOutcome as CommitOutcome
from dcr.protocol.types import CommitRecord as CommitRecord
from dcr.protocol.types import CounterIds as CounterIds
from dcr.protocol.types import IdSource as IdSource
from dcr.protocol.types import Mode as Mode
from dcr.protocol.types import PayloadKey as PayloadKey
from dcr.protocol.types import Stage as Stage
from dcr.protocol.types import Timeouts as Timeouts
from dcr.protocol.types import TransitionOutcome as TransitionOutcome
