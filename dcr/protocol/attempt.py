"""The coordinator's record of one attempt: Algorithm B.1 and the stop path, attempt side.

An :class:`Attempt` holds what the coordinator knows of the current attempt ``tau`` (the
replies collected so far) and the attempt lifecycle's machine, whose guards read those
replies.  It takes the streaming steps whose replies are complete (request gate,
``open_apply``, flush, compare-and-set) and sends the calls of the stop path (App. B.2) to its
endpoints.  What the transition does about a failure, a stop or a commit outcome is the
coordinator's (:mod:`dcr.protocol.coordinator`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import InitVar, dataclass, field

from dcr.protocol import commands as cmd
from dcr.protocol import events as ev
from dcr.protocol import messages as msg
from dcr.protocol.lifecycle import AttemptPhase, Trigger
from dcr.protocol.machine import Guard, StateMachine
from dcr.protocol.proof import Proof, ProofRequest
from dcr.protocol.types import AttemptInfo, CommitRecord, Stage, Timeouts

__all__ = [
    "ATTEMPT_EVENTS",
    "AWAITING_OUTCOME",
    "RUNNING",
    "STAGE_PHASES",
    "Attempt",
    "AttemptEvent",
]

_A = AttemptPhase
_X = Trigger

AttemptEvent = (
    ev.Registered | msg.PrepareAccepted | msg.PrepareRejected | msg.AttemptFailed
    | msg.SendsDone | msg.Staged | msg.GateClosed | msg.Acked | ev.CommitReplied | ev.CommitRead
    | ev.ObsoleteMarked | msg.Stopped | msg.Retired | ev.DeadlineExpired
)  # fmt: skip
"""Events that concern one attempt (they name its id): replies, outcomes, its deadlines."""
ATTEMPT_EVENTS = (
    ev.Registered, msg.PrepareAccepted, msg.PrepareRejected, msg.AttemptFailed, msg.SendsDone,
    msg.Staged, msg.GateClosed, msg.Acked, ev.CommitReplied, ev.CommitRead, ev.ObsoleteMarked,
    msg.Stopped, msg.Retired, ev.DeadlineExpired,
)  # fmt: skip

RUNNING = frozenset({_A.PREPARING, _A.STREAMING, _A.GATING, _A.APPLYING, _A.FLUSHING})
"""Phases in which the attempt runs (a failure stops it)."""
AWAITING_OUTCOME = frozenset({_A.COMMITTING, _A.UNKNOWN, _A.RESOLVING, _A.COMMITTED})
"""Phases in which a commit outcome is pending (the transition may not abort)."""
STAGE_PHASES = {
    Stage.PREPARE: frozenset({_A.PREPARING}),
    Stage.ARRIVAL: frozenset({_A.STREAMING}),
    Stage.GATE: frozenset({_A.GATING}),
    Stage.FLUSH: frozenset({_A.APPLYING, _A.FLUSHING}),
}
"""The phases a stage's deadline covers: it fails the attempt if it expires in one of them."""


@dataclass(slots=True, kw_only=True)
class Attempt:
    """Bookkeeping of the current attempt (replies collected so far).

    ``epoch`` is the coordinator's epoch (its calls carry it, also for a replaced
    coordinator's attempt taken over); ``cleanup_guard`` is what the transition requires
    before the attempt is cleaned up, beyond its stop.
    """

    info: AttemptInfo
    epoch: int
    timeouts: Timeouts
    cleanup_guard: InitVar[Callable[[], str | None]]
    machine: StateMachine[AttemptPhase] = field(init=False)
    registered: bool = False
    accepted: set[str] = field(default_factory=set)
    sends: dict[str, int] = field(default_factory=dict)
    staged: dict[str, tuple[tuple[str, int], ...]] = field(default_factory=dict)
    gated: set[str] = field(default_factory=set)
    acks: set[str] = field(default_factory=set)
    stopped: set[str] = field(default_factory=set)
    retired: set[str] = field(default_factory=set)
    departed: set[str] = field(default_factory=set)
    """Retired receivers that departed (:class:`~dcr.protocol.events.Departed`): not waited
    for, but still addressed by the stop path, cleanup and the gate's reopening."""
    commit_deadline_passed: bool = False
    arrival_checked: bool = False
    joined: frozenset[str] = frozenset()
    proof: ProofRequest | None = None
    xor_refused: frozenset[str] | None = None
    proofs: dict[str, Proof | None] = field(default_factory=dict)
    judged: bool = False

    def __post_init__(self, cleanup_guard: Callable[[], str | None]) -> None:
        self.machine = self._machine(cleanup_guard)

    @property
    def phase(self) -> AttemptPhase:
        return self.machine.phase

    @property
    def endpoints(self) -> frozenset[str]:
        return frozenset(self.info.owners) | self.info.receivers

    @property
    def everyone(self) -> tuple[str, ...]:
        """Owners in their order, then receivers sorted: the order calls go out in."""
        return (*self.info.owners, *sorted(self.info.receivers))

    @property
    def addressed(self) -> list[str]:
        """Receivers the stop path, cleanup and reopening call, sorted: every receiver but a
        retired one (whose process is gone); a departed receiver may only be out of reach,
        and finds the calls waiting when it comes back."""
        return sorted(self.info.receivers - (self.retired - self.departed))

    def expected(self) -> tuple[tuple[str, int], ...]:
        return tuple((o, self.sends[o]) for o in self.info.owners)

    def fire(self, trigger: Trigger) -> None:
        self.machine.fire(trigger)

    def allows(self, trigger: Trigger) -> bool:
        return self.machine.can_fire(trigger)

    def deadline(self, stage: Stage) -> cmd.ArmDeadline:
        """Arm ``stage``'s deadline for this attempt."""
        return cmd.ArmDeadline(
            attempt=self.info.attempt, stage=stage, seconds=self.timeouts.of(stage)
        )

    # -- admission and streaming (Algorithm B.1) -------------------------------------------

    def on_registered(self, out: list[cmd.CoordinatorCommand]) -> None:
        """The control plane registered the attempt: its endpoints learn it now."""
        if self.phase is _A.PREPARING and not self.registered:
            self.registered = True
            prepare = msg.Prepare(info=self.info, proof=self.proof, xor_refused=self.xor_refused)
            out.append(cmd.Call(to=self.everyone, message=prepare))

    def accept(self, endpoint: str, proof: Proof | None) -> bool:
        """Record an endpoint's acceptance of the prepare (with its proof); whether it counts."""
        if endpoint not in self.endpoints:
            return False
        self.accepted.add(endpoint)
        self.proofs[endpoint] = proof
        return True

    def start_streaming(self, out: list[cmd.CoordinatorCommand]) -> str | None:
        """Owners start sending (the attempt was admitted); as :meth:`advance`."""
        out.append(
            cmd.Call(to=self.info.owners, message=msg.StartStreaming(attempt=self.info.attempt))
        )
        if not self.info.sync:
            out.append(self.deadline(Stage.ARRIVAL))
        return self.advance(out)

    def take(self, event: msg.SendsDone | msg.Staged | msg.GateClosed) -> bool:
        """Record a streaming reply; whether it counted (then the attempt may advance)."""
        match event:
            case msg.SendsDone(owner=owner, payload_count=count):
                if owner in self.info.owners and self.phase in RUNNING:
                    self.sends[owner] = count
                    return True
            case msg.Staged(receiver=receiver):
                if receiver in self.info.receivers and self.phase in RUNNING:
                    self.staged[receiver] = event.counts
                    return True
            case msg.GateClosed(receiver=receiver):
                if receiver in self.info.receivers and self.phase is _A.GATING:
                    self.gated.add(receiver)
                    return True
        return False

    def advance(self, out: list[cmd.CoordinatorCommand]) -> str | None:
        """Take every streaming step whose replies are complete (gate, open_apply, flush).

        Returns why the attempt fails instead (the arrival check found a mismatch).
        """
        tau = self.info.attempt
        if self.phase is _A.STREAMING and not self.info.sync and self.arrival_mismatch():
            return f"arrival check failed: {self.arrival_mismatch()}"
        if (
            self.phase is _A.STREAMING
            and not self.info.sync
            and not self.arrival_checked
            and len(self.sends) == len(self.info.owners)
        ):
            # Every owner declared its sent list: receivers that still miss a payload fail
            # the attempt after the transport's arrival grace instead of waiting for the
            # arrival deadline (paper App. B.1, arrival check).
            self.arrival_checked = True
            out.append(
                cmd.Call(
                    to=tuple(sorted(self.info.receivers)),
                    message=msg.CheckArrival(attempt=tau, expected=self.expected()),
                )
            )
        if self.phase is _A.STREAMING and self.allows(_X.WAIT_FOR_REQUESTS):
            # Synchronous RL closes the gate when the attempt starts; asynchronous RL only
            # after every expected payload arrived (paper §7.2, App. B.1 streaming).
            self.fire(_X.WAIT_FOR_REQUESTS)
            out.append(
                cmd.Call(
                    to=tuple(sorted(self.info.receivers)),
                    message=msg.WaitForRequests(attempt=tau, epoch=self.epoch),
                )
            )
            out.append(self.deadline(Stage.GATE))
        if self.phase is _A.GATING and self.allows(_X.OPEN_APPLY):
            self.fire(_X.OPEN_APPLY)
            out.append(
                cmd.Call(
                    to=tuple(sorted(self.info.receivers)),
                    message=msg.OpenApply(attempt=tau, epoch=self.epoch),
                )
            )
            # One deadline covers the rest of streaming, the arrival check and the drain.
            out.append(self.deadline(Stage.FLUSH))
        if self.phase is _A.APPLYING and self.allows(_X.FLUSH):
            self.fire(_X.FLUSH)
            out.append(
                cmd.Call(to=self.everyone, message=msg.Flush(attempt=tau, expected=self.expected()))
            )
        if self.phase is _A.FLUSHING and self.allows(_X.COMMIT):
            self.commit(out)
        return None

    def ack_problem(self, event: msg.Acked, require_post_apply: bool) -> str | None:
        """Why a receiver's completion ACK fails the attempt, or ``None``."""
        if event.applied != self.expected():
            # Arrival check of flush: the ACK must cover every payload the owners declared.
            return f"{event.receiver} applied {event.applied}, owners sent {self.expected()}"
        if require_post_apply and not event.post_apply_checked:
            return f"{event.receiver} acknowledged without post-apply checks"
        return None

    # -- commit (Algorithm B.2, lines 22-35) -----------------------------------------------

    def commit(self, out: list[cmd.CoordinatorCommand]) -> None:
        self.fire(_X.COMMIT)
        out.append(
            cmd.CompareAndSet(
                attempt=self.info.attempt,
                epoch=self.epoch,
                expected=self.info.base,
                new=self.info.target,
                deadline_s=self.timeouts.of(Stage.COMMIT),
            )
        )

    def on_commit_deadline(self, out: list[cmd.CoordinatorCommand]) -> None:
        """No commit of tau can land any more: an outcome not known yet is read."""
        self.commit_deadline_passed = True
        if self.phase is _A.COMMITTING:
            self.fire(_X.COMMIT_UNKNOWN)
        self.read_commit_if_final(out)

    def read_commit_if_final(self, out: list[cmd.CoordinatorCommand]) -> None:
        """Paper App. B.2: read_commit waits until no commit of tau can change the record."""
        if self.phase is _A.UNKNOWN and self.allows(_X.READ_COMMIT):
            self.fire(_X.READ_COMMIT)
            out.append(cmd.ReadCommit(attempt=self.info.attempt))

    # -- the stop path and cleanup (Algorithm B.2, lines 36-43) ----------------------------

    def mark_obsolete(self, out: list[cmd.CoordinatorCommand]) -> None:
        self.fire(_X.MARK_OBSOLETE)
        out.append(cmd.RecordObsolete(attempt=self.info.attempt))
        out.append(self.mark_obsolete_call())
        out.append(self.deadline(Stage.STOP))

    def mark_obsolete_call(self) -> cmd.Call:
        return cmd.Call(
            to=self.everyone, message=msg.MarkObsolete(attempt=self.info.attempt, epoch=self.epoch)
        )

    def stop_and_wait(self, out: list[cmd.CoordinatorCommand]) -> bool:
        """The attempt is recorded obsolete: stop its delivery and ask every endpoint to stop;
        whether it was (then the stop may be complete already)."""
        if self.phase is not _A.OBSOLETE:
            return False
        self.fire(_X.STOP_AND_WAIT)
        out.append(cmd.StopDelivery(attempt=self.info.attempt))
        out.extend(self.stop_and_wait_commands())
        out.append(self.deadline(Stage.STOP))
        return True

    def stop_and_wait_commands(self) -> list[cmd.CoordinatorCommand]:
        """Ask the endpoints that have not stopped yet; the supervisor retires dead ones."""
        receivers = [r for r in self.addressed if r not in self.stopped]
        to = (*self.info.owners, *receivers)
        return [
            cmd.Call(to=to, message=msg.StopAndWait(attempt=self.info.attempt, epoch=self.epoch)),
            cmd.CheckRetired(attempt=self.info.attempt, endpoints=to),
        ]

    def on_stop_deadline(self, out: list[cmd.CoordinatorCommand]) -> None:
        """Stop-path calls are idempotent: ask again and keep waiting (a receiver that never
        acknowledges needs the operator, paper App. B.2)."""
        if self.phase is _A.OBSOLETE:
            out.append(cmd.RecordObsolete(attempt=self.info.attempt))
            out.append(self.mark_obsolete_call())
        elif self.phase is _A.STOPPING and not self.stop_complete():
            out.extend(self.stop_and_wait_commands())
        else:
            return
        out.append(self.deadline(Stage.STOP))

    def stop_complete(self) -> bool:
        return self.endpoints <= self.stopped | self.retired

    def cleanup_commands(self) -> list[cmd.CoordinatorCommand]:
        return [
            cmd.ReleaseDelivery(attempt=self.info.attempt),
            cmd.Call(
                to=(*self.info.owners, *self.addressed),
                message=msg.Cleanup(attempt=self.info.attempt),
            ),
        ]

    def reopen_gate_call(self, receivers: list[str], record: CommitRecord) -> cmd.Call:
        """Reopen the request gates of ``receivers`` at ``record``, which they hold."""
        return cmd.Call(
            to=tuple(receivers),
            message=msg.ReopenGate(attempt=self.info.attempt, epoch=self.epoch, record=record),
        )

    # -- guards (a failing guard raises LocalProtocolError) --------------------------------

    def _machine(self, cleanup_guard: Callable[[], str | None]) -> StateMachine[AttemptPhase]:
        def cleanup_allowed() -> str | None:
            if self.phase is _A.STOPPING and not self.stop_complete():
                return "endpoints are still stopping"
            return cleanup_guard()

        tau = self.info.attempt
        guards: dict[Trigger, Guard] = {
            _X.SEND: self._all_prepared,
            _X.WAIT_FOR_REQUESTS: self._arrived_or_sync,
            _X.OPEN_APPLY: self._all_gated,
            _X.FLUSH: self._all_sent,
            _X.COMMIT: self._all_acked,
            _X.READ_COMMIT: self._no_commit_can_land,
            _X.CLEANUP: cleanup_allowed,
        }
        return StateMachine(AttemptPhase, name=f"attempt {tau}", attempt=tau, guards=guards)

    def _all_prepared(self) -> str | None:
        missing = self.endpoints - self.accepted
        if not self.registered:
            return "the control plane has not registered the attempt"
        return f"prepare not accepted by {sorted(missing)}" if missing else None

    def arrival_mismatch(self) -> str | None:
        """Asynchronous RL: every receiver holds what the owners declared, or why not."""
        if len(self.sends) < len(self.info.owners):
            return None
        expected = self.expected()
        for r, counts in self.staged.items():
            if counts != expected:
                return f"{r} staged {counts}, owners sent {expected}"
        return None

    def _arrived_or_sync(self) -> str | None:
        if self.info.sync:
            return None
        if len(self.sends) < len(self.info.owners):
            return "owners are still sending"
        missing = self.info.receivers - self.staged.keys()
        if missing:
            return f"payloads have not all arrived at {sorted(missing)}"
        return self.arrival_mismatch()

    def _all_gated(self) -> str | None:
        missing = self.info.receivers - self.gated
        return f"gate not closed at {sorted(missing)}" if missing else None

    def _all_sent(self) -> str | None:
        missing = set(self.info.owners) - self.sends.keys()
        return f"owners {sorted(missing)} are still sending" if missing else None

    def _all_acked(self) -> str | None:
        missing = self.info.receivers - self.acks
        return f"no completion ACK from {sorted(missing)}" if missing else None

    def _no_commit_can_land(self) -> str | None:
        return None if self.commit_deadline_passed else "the commit deadline has not passed"
