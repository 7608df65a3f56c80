"""The variables of ``models/membership.tla``: a run of several transitions, between which
receivers join, restart and are restored by dense refit and a coordinator may be replaced.

One transition's internals are abstract here (``models/refit.tla`` checks them): an attempt
binds the receiver processes that accept its prepare, each applies its payloads in one step,
and the commit, the owners' baseline updates and the gate reopening follow.  What is explicit
is everything between transitions: the endpoints' status reports, the active coordinator's
membership core (:class:`Core`, a mirror of :class:`dcr.protocol.membership.MembershipCore`),
dense-refit jobs and their ids, restarts with new incarnations, and takeovers by a
coordinator of a newer epoch.

Storage is one value per receiver: the version whose bits it holds exactly, or one of the
sentinels below.  Versions are small integers ``0 .. transitions``; every version up to the
commit record was committed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Self

from dcr.protocol.lifecycle import ReceiverPhase
from dcr.testing.spec.memo import evolve

__all__ = [
    "BAD",
    "LOST",
    "MIXED",
    "NOTHING",
    "Budgets",
    "Commit",
    "Core",
    "DenseCall",
    "Job",
    "Owner",
    "Ready",
    "Receiver",
    "Registered",
    "Reopen",
    "Run",
    "RunConfig",
    "State",
    "Status",
    "attempt_id",
    "job_id",
]

NOTHING = -1
"""A receiver's claim while it holds no committed record (joining, disproved); no version."""
LOST = -2
"""Storage of a process that started empty, or whose checkpoint is not what it claims."""
BAD = -3
"""An XOR entry landed on bits other than its base."""
MIXED = -4
"""Part of a dense job's payloads landed (the job failed on the way)."""


def attempt_id(epoch: int, n: int) -> int:
    """The ``n``-th attempt id of coordinator ``epoch`` (``EpochIds(epoch).attempts()``)."""
    return (epoch << 32) + n


def job_id(epoch: int, n: int) -> int:
    """The ``n``-th dense job id of coordinator ``epoch`` (``EpochIds(epoch).dense_job()``,
    ``n`` from 1)."""
    return (epoch << 32) | (1 << 31) | n


@dataclass(frozen=True, slots=True, kw_only=True)
class RunConfig:
    """Bounds of the explored run."""

    owners: int = 1
    receivers: int = 2
    transitions: int = 2
    """Versions ``0 .. transitions``: how many transitions the trainers stage."""
    restarts: int = 1
    """Receiver processes that die and start again empty (they must be restored)."""
    checkpoints: int = 0
    """Receiver processes that die and start again from the committed version's checkpoint
    (they hold and serve it at once)."""
    foreign: int = 0
    """Receiver processes that start claiming the committed record from a checkpoint whose bits
    are not it (a foreign or corrupted checkpoint)."""
    owner_restarts: int = 0
    takeovers: int = 1
    """Coordinators of a newer epoch that replace the active one."""
    dense_failures: int = 1
    """Dense jobs whose payloads land only in part (a relay node died, say)."""
    timeouts: int = 1
    """Dense jobs sent again at their deadline although still in flight."""
    retries: int = 2
    """Dense jobs sent again after a reported failure (the run's clock is abstract: each
    resend after ``retry_s`` spends one)."""
    settle_timeouts: int = 1
    """Settling periods that end at their deadline rather than when the members reported."""
    join_waits: int = 1
    """Transitions that start after ``join_wait_s`` without a receiver still joining."""
    fingerprint_on_join: bool = True
    reopen_while_restoring: bool = True
    """A restored receiver reopens its gate at a record it holds even while a newer dense job
    of another record runs (today's receiver core: that job's payloads then land while it
    serves).  ``False``: it refuses the reopening until the job ended."""
    verify_restarted: bool = True
    """``TransitionDone`` verifies every member its fingerprint did not disprove, also one that
    restarted after the fingerprinting prepare (today's membership core).  ``False``: those
    stay unverified."""
    early_retire: bool = False
    """A restart reported after ``RunTransition`` but before the run prepared its first
    attempt takes the receiver out of the run.  ``False`` is today's fleet coordinator, which
    drops that ``Retire`` (there is no attempt to fail yet): the restarted process then takes
    part in the first prepare without the fingerprint its restart calls for."""


class Status(NamedTuple):
    """A receiver's status report as the core last received it.  (Owners' reports reach the
    core at once: the prepare itself waits for their candidates.)"""

    inc: int
    record: int
    """The record it holds (``NOTHING`` while it must restore one)."""


class Job(NamedTuple):
    """A dense job the core tracks for one receiver."""

    job: int
    record: int
    failed: bool
    """A failure was reported: the job is sent again (after ``retry_s``)."""


class Core(NamedTuple):
    """The active coordinator's membership core."""

    epoch: int
    """The epoch its ids are issued under (raised by a run that claimed a newer one)."""
    issued: int
    """Dense jobs issued in ``epoch``."""
    receivers: tuple[Status | None, ...]
    """Each receiver's last status report (``None``: never heard from)."""
    unverified: frozenset[int]
    restarted: frozenset[int]
    jobs: tuple[Job | None, ...]
    engaged: frozenset[int]
    settling: int
    """The record the settling waits for its members to report (``NOTHING``: not settling)."""


class Run(NamedTuple):
    """The transition the core started (``RunTransition``) and its progress."""

    base: int
    required: frozenset[int]
    """``RunTransition.members``: whom the core required (its view, for verification)."""
    members: frozenset[int]
    """Whom the coordinator still requires (members leave when a prepare fails at them)."""
    fingerprint: bool
    """``RunTransition.fingerprint``: its first prepare fingerprints the members."""
    proving: bool
    """The next prepare fingerprints (the first one of a fingerprinting run)."""
    take_over: bool
    epoch: int
    """The epoch the run claimed at the commit store (every run claims a new one)."""
    attempt: int
    """The attempt in progress (0: none; its prepare is next)."""
    tries: int
    """Attempts prepared so far (ids ``attempt_id(epoch, 0 ..)``)."""
    overwrite: bool
    bound: frozenset[tuple[int, int]]
    """``(receiver, incarnation)`` of the processes that accepted the attempt's prepare."""
    applied: frozenset[int]
    committed: bool
    reported: frozenset[int]
    """Owners that reported the baseline update."""
    disproved: frozenset[int] | None
    """Receivers the fingerprinting prepare disproved (``None``: no proof judged)."""


class Registered(NamedTuple):
    """The last attempt the control plane registered."""

    epoch: int
    attempt: int
    base: int
    receivers: frozenset[int]


class Owner(NamedTuple):
    inc: int
    baseline: int
    staged: bool


class Receiver(NamedTuple):
    phase: ReceiverPhase
    inc: int
    storage: int
    held: int
    """The committed record it claims to hold exactly (``NOTHING`` while it must restore)."""
    dirty: bool
    """Writes landed since it held ``held`` (it refuses a mixed-mode attempt)."""
    gate: bool
    seen: int
    """The newest coordinator epoch whose call reached it: older calls are refused."""
    dense: Job | None
    """The dense job it is restoring (``failed`` unused)."""
    acked: int
    """The version of the attempt it applied and acknowledged (``NOTHING`` if none)."""
    foreign: bool
    """It started from a checkpoint that is not what it claims, and nothing rewrote it since."""


class DenseCall(NamedTuple):
    """A ``DenseRefit`` call on its way to the receiver."""

    job: int
    receiver: int
    record: int
    epoch: int


class Reopen(NamedTuple):
    """A ``ReopenGate`` call of a restored receiver in flight."""

    job: int
    receiver: int
    record: int
    epoch: int


class Ready(NamedTuple):
    """A ``ReceiverReady`` report in flight: ``job`` restored ``record`` at process ``inc``
    (the report names the job, not the process)."""

    receiver: int
    inc: int
    job: int
    record: int


class Commit(NamedTuple):
    """History: one commit of the record."""

    epoch: int
    """The epoch of the coordinator whose attempt committed."""
    lease: int
    """The active epoch when the control plane changed the record."""
    missing: frozenset[tuple[int, int]]
    """Processes the attempt bound that did not acknowledge it."""


class Budgets(NamedTuple):
    restarts: int = 0
    checkpoints: int = 0
    foreign: int = 0
    owner_restarts: int = 0
    takeovers: int = 0
    dense_failures: int = 0
    timeouts: int = 0
    retries: int = 0
    settle_timeouts: int = 0
    join_waits: int = 0


@dataclass(frozen=True, slots=True)
class State:
    """One state of the membership model."""

    record: int
    """The committed version."""
    lease: int
    """The active coordinator epoch (the control plane accepts only its prepares and commits)."""
    generation: int
    """Coordinator processes started so far; the active one is the last."""
    registered: Registered | None
    core: Core
    run: Run | None
    owners: tuple[Owner, ...]
    receivers: tuple[Receiver, ...]
    to_receivers: frozenset[DenseCall]
    """Dense calls on their way to the receiver they restore (the owners handle a call in the
    step that issues it: they send, or refuse when their baseline is not its record)."""
    sent: frozenset[tuple[int, int]]
    """``(job, record)`` whose payloads every owner sent."""
    reopens: frozenset[Reopen]
    readies: frozenset[Ready]
    stale_epoch: int
    """History: the newest epoch a replaced coordinator issued dense jobs under (0: none)."""
    commits: tuple[Commit, ...]
    budgets: Budgets
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "_hash",
            hash(
                (
                    self.record, self.lease, self.generation, self.registered, self.core,
                    self.run, self.owners, self.receivers, self.to_receivers,
                    self.sent, self.reopens, self.readies, self.stale_epoch, self.commits,
                    self.budgets,
                )
            ),
        )  # fmt: skip

    def __hash__(self) -> int:
        return self._hash

    def evolve(self, **changes: Any) -> Self:
        """A copy with ``changes`` (:func:`dcr.testing.spec.memo.evolve`)."""
        return evolve(self, **changes)
