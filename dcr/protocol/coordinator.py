"""The coordinator core: Algorithm B.2 (and the coordinator's part of B.1) as events -> commands.

One :class:`CoordinatorCore` drives one transition ``K^v -> v+1``.  It holds two machines built
from the edge table: the transition lifecycle and the lifecycle of the current attempt.  It
never waits: every control call is a command, and its replies, timeouts and failures come
back as events.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from dcr.errors import ConfigError, LocalProtocolError
from dcr.protocol import commands as cmd
from dcr.protocol import events as ev
from dcr.protocol import messages as msg
from dcr.protocol.lifecycle import AttemptPhase, TransitionPhase, Trigger
from dcr.protocol.machine import StateMachine
from dcr.protocol.proof import Proof, ProofConfig, ProofRequest, Verdict, judge, seed_for
from dcr.protocol.types import (
    AttemptInfo,
    CommitOutcome,
    CommitRecord,
    IdSource,
    Mode,
    Stage,
    Timeouts,
    TransitionOutcome,
)

__all__ = ["CoordinatorConfig", "CoordinatorCore", "bound_refused"]

_A = AttemptPhase
_T = TransitionPhase
_X = Trigger

_RUNNING = frozenset({_A.PREPARING, _A.STREAMING, _A.GATING, _A.APPLYING, _A.FLUSHING})
_AWAITING_OUTCOME = frozenset({_A.COMMITTING, _A.UNKNOWN, _A.RESOLVING, _A.COMMITTED})
_AttemptEvent = (
    ev.Registered | msg.PrepareAccepted | msg.PrepareRejected | msg.AttemptFailed
    | msg.SendsDone | msg.Staged | msg.GateClosed | msg.Acked | ev.CommitReplied | ev.CommitRead
    | ev.ObsoleteMarked | msg.Stopped | msg.Retired | ev.DeadlineExpired
)  # fmt: skip
_ATTEMPT_EVENTS = (
    ev.Registered, msg.PrepareAccepted, msg.PrepareRejected, msg.AttemptFailed, msg.SendsDone,
    msg.Staged, msg.GateClosed, msg.Acked, ev.CommitReplied, ev.CommitRead, ev.ObsoleteMarked,
    msg.Stopped, msg.Retired, ev.DeadlineExpired,
)  # fmt: skip
_NOT_A_MEMBER = frozenset({"joining", "version", "proof"})
"""Prepare failures after which a receiver must dense-refit and report ready to rejoin."""
_STAGE_PHASES = {
    Stage.PREPARE: frozenset({_A.PREPARING}),
    Stage.ARRIVAL: frozenset({_A.STREAMING}),
    Stage.GATE: frozenset({_A.GATING}),
    Stage.FLUSH: frozenset({_A.APPLYING, _A.FLUSHING}),
}


def bound_refused(
    reports: Mapping[str, frozenset[str]] | None, receivers: Iterable[str]
) -> frozenset[str] | None:
    """What a mixed-mode prepare of ``receivers`` binds as ``xor_refused``: the union of their
    reported refused sets (``reports``: receiver -> the canonical names its loader path does
    not preserve bit for bit).

    ``None`` -- the integration setup's ``xor_names`` decide -- when there are no reports, a
    receiver has not reported, or the union is larger than a control message carries
    (:data:`~dcr.protocol.messages.XOR_REFUSED_MAX_BYTES`).
    """
    if reports is None:
        return None
    union: set[str] = set()
    for r in receivers:
        mine = reports.get(r)
        if mine is None:
            return None
        union |= mine
    if msg.refused_size(union) > msg.XOR_REFUSED_MAX_BYTES:
        return None
    return frozenset(union)


@dataclass(frozen=True, slots=True, kw_only=True)
class CoordinatorConfig:
    """What a coordinator needs to run one transition."""

    base: CommitRecord
    """``K^v``: the committed record the transition starts from."""
    owners: tuple[str, ...]
    """Every owner (source membership is fixed during a transition)."""
    receivers: tuple[str, ...]
    """Receivers that hold ``K^v`` now; they are required at the first prepare."""
    epoch: int
    """This coordinator's epoch at the control plane (the engine registers it)."""
    sync: bool = True
    """Synchronous RL closes the gate at the first attempt; asynchronous RL stages first."""
    timeouts: Timeouts = field(default_factory=Timeouts)
    require_post_apply: bool = False
    """Fail an attempt whose ACKs do not report post-apply checks."""
    mode: Mode = Mode.MIXED
    """Mode of the first attempt; retries after admission always use overwrite mode."""
    proof: ProofConfig | None = None
    """Ask for a proof of the base version at every prepare before admission (``None``: no
    proof).  Receivers whose proof fails leave the membership and are dense-refitted."""
    fingerprint: bool = False
    """Request the complete fingerprint at the first prepare (the supervisor sets it for
    receivers started or restored since the last check); needs ``proof``."""
    join_wait_s: float = 0.0
    """After an attempt failed because receivers' proofs failed, how long the retry waits
    for those receivers to be restored by dense refit and report ready, so that they join
    the retry and take part in the commit (0: retry at once without them).  The retry
    starts as soon as every one of them is ready, or when the wait ends."""
    xor_refused: Mapping[str, frozenset[str]] | None = None
    """The receivers' loader classifications, from their status reports: receiver -> the
    canonical names its native loader path does not preserve bit for bit.  Each mixed-mode
    prepare binds the union over its required receivers (:func:`bound_refused`), so owners
    encode exactly the other names relative; ``None``, or a required receiver missing here,
    binds ``None``: the integration setup's ``xor_names``."""

    def __post_init__(self) -> None:
        if not self.owners:
            raise ConfigError("a transition needs at least one owner")
        if len(set(self.owners)) != len(self.owners):
            raise ConfigError(f"duplicate owner names in {self.owners}")
        if len(set(self.receivers)) != len(self.receivers):
            raise ConfigError(f"duplicate receiver names in {self.receivers}")
        if set(self.owners) & set(self.receivers):
            raise ConfigError("an endpoint cannot be both owner and receiver")
        if self.join_wait_s < 0:
            raise ConfigError(f"join_wait_s must be >= 0, got {self.join_wait_s}")


@dataclass(slots=True)
class _Attempt:
    """Bookkeeping of the current attempt (replies collected so far)."""

    info: AttemptInfo
    machine: StateMachine[AttemptPhase]
    registered: bool = False
    accepted: set[str] = field(default_factory=set)
    sends: dict[str, int] = field(default_factory=dict)
    staged: dict[str, tuple[tuple[str, int], ...]] = field(default_factory=dict)
    gated: set[str] = field(default_factory=set)
    acks: set[str] = field(default_factory=set)
    stopped: set[str] = field(default_factory=set)
    retired: set[str] = field(default_factory=set)
    commit_deadline_passed: bool = False
    arrival_checked: bool = False
    joined: frozenset[str] = frozenset()
    proof: ProofRequest | None = None
    xor_refused: frozenset[str] | None = None
    proofs: dict[str, Proof | None] = field(default_factory=dict)
    judged: bool = False

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

    def expected(self) -> tuple[tuple[str, int], ...]:
        return tuple((o, self.sends[o]) for o in self.info.owners)


class CoordinatorCore:
    """Drives one transition; :meth:`handle` takes an event and returns commands."""

    def __init__(self, config: CoordinatorConfig, ids: IdSource) -> None:
        self.config = config
        self._ids = ids
        self._record = config.base
        self._mode = config.mode
        self._admitted = False
        self._members: set[str] = set(config.receivers)
        self._joiners: dict[str, CommitRecord] = {}
        self._attempt: _Attempt | None = None
        self._committed: CommitRecord | None = None
        self._took_over_commit = False
        self._reports: set[str] = set()
        self._dirty: set[str] = set()
        self._refit_needed: frozenset[str] = frozenset()
        self._refitted: set[str] = set()
        self._abort_reason: str | None = None
        self._reason = ""
        self._last_attempt = 0
        self._outcome: TransitionOutcome | None = None
        proof = config.proof
        self._fingerprint_due = proof is not None and (
            config.fingerprint or proof.fingerprint_each_commit
        )
        self._verdicts: list[Verdict] = []
        self._restoring: set[str] = set()
        """Receivers a failed proof sent to a dense refit that have not reported ready."""
        self._join_wait = False
        """The retry waits for ``_restoring`` (until ready or the JOIN deadline)."""
        self._transition = StateMachine(
            TransitionPhase,
            name=f"coordinator {config.epoch}",
            guards={
                _X.PREPARE: self._previous_attempt_cleaned,
                _X.READ_COMMIT: self._old_attempt_stopped,
                _X.CLEANUP: self._cleanup_allowed,
                _X.REOPEN_GATE: self._refits_done,
                _X.ABORT: self._abortable,
            },
        )

    # -- read-only views -------------------------------------------------------------------

    @property
    def phase(self) -> TransitionPhase:
        return self._transition.phase

    @property
    def attempt(self) -> AttemptInfo | None:
        return self._attempt.info if self._attempt else None

    @property
    def attempt_phase(self) -> AttemptPhase | None:
        return self._attempt.phase if self._attempt else None

    @property
    def mode(self) -> Mode:
        """Mode of the next attempt: mixed until admission, overwrite after (paper §6.3)."""
        return self._mode

    @property
    def admitted(self) -> bool:
        return self._admitted

    @property
    def members(self) -> frozenset[str]:
        """Receivers that will be required at the next prepare (joiners not yet included)."""
        return frozenset(self._members)

    @property
    def acks(self) -> frozenset[str]:
        return frozenset(self._attempt.acks) if self._attempt else frozenset()

    @property
    def reported(self) -> frozenset[str]:
        """Owners that reported the baseline update named by the commit."""
        return frozenset(self._reports)

    @property
    def committed(self) -> CommitRecord | None:
        """The record a commit (ours or the replaced coordinator's) wrote, once known."""
        return self._committed

    @property
    def outcome(self) -> TransitionOutcome | None:
        return self._outcome

    @property
    def verdicts(self) -> tuple[Verdict, ...]:
        """The proofs of the base version judged so far, one per proving prepare."""
        return tuple(self._verdicts)

    # -- events ----------------------------------------------------------------------------

    def handle(self, event: ev.CoordinatorEvent) -> list[cmd.CoordinatorCommand]:
        """Apply one event; return the commands to execute, in order.

        Events of attempts other than the current one, and events the current phase has no
        use for (late replies, stale deadlines), change nothing and return no commands.
        """
        out: list[cmd.CoordinatorCommand] = []
        if self._outcome is not None:
            return out
        match event:
            case ev.StartTransition():
                self._prepare(out)
            case ev.TakeOver(old=old):
                self._take_over(old, out)
            case ev.OperatorAbort(reason=reason):
                self._abort_reason = reason
                self._abort_if_requested(out)
            case ev.Conflict(attempt=attempt):
                if attempt is None or self._is_current(attempt):
                    self._stand_down(out, "the control plane raised conflict")
            case msg.BaselineUpdated(owner=owner, record=record):
                self._on_baseline_updated(owner, record, out)
            case msg.ReceiverReady(receiver=receiver, record=record):
                self._on_receiver_ready(receiver, record, out)
            case _:
                if isinstance(event, _ATTEMPT_EVENTS) and self._is_current(event.attempt):
                    self._on_attempt_event(event, out)
        return out

    def _on_attempt_event(self, event: _AttemptEvent, out: list[cmd.CoordinatorCommand]) -> None:
        a = self._attempt
        assert a is not None
        match event:
            case ev.Registered():
                if a.phase is _A.PREPARING and not a.registered:
                    a.registered = True
                    prepare = msg.Prepare(info=a.info, proof=a.proof, xor_refused=a.xor_refused)
                    out.append(cmd.Call(to=a.everyone, message=prepare))
            case msg.PrepareAccepted(endpoint=endpoint, proof=proof):
                if endpoint in a.endpoints:
                    a.accepted.add(endpoint)
                    a.proofs[endpoint] = proof
                    self._admit_if_prepared(out)
            case msg.PrepareRejected(endpoint=endpoint, check=check, message=message):
                self._on_rejected(
                    endpoint, f"prepare rejected by {endpoint} ({check}) {message}", out
                )
            case msg.AttemptFailed(endpoint=endpoint, check=check, message=message):
                if check in _NOT_A_MEMBER and endpoint in a.info.receivers:
                    # Paper App. B.2, joining receivers: it joins again once it reports that
                    # a dense refit restored the committed record.
                    self._members.discard(endpoint)
                self._fail(out, f"{endpoint} failed the attempt ({check}) {message}")
            case msg.SendsDone(owner=owner, payload_count=count):
                if owner in a.info.owners and a.phase in _RUNNING:
                    a.sends[owner] = count
                    self._advance(out)
            case msg.Staged(receiver=receiver):
                if receiver in a.info.receivers and a.phase in _RUNNING:
                    a.staged[receiver] = event.counts
                    self._advance(out)
            case msg.GateClosed(receiver=receiver):
                if receiver in a.info.receivers and a.phase is _A.GATING:
                    a.gated.add(receiver)
                    self._advance(out)
            case msg.Acked():
                self._on_acked(event, out)
            case ev.CommitReplied(outcome=outcome):
                self._on_commit_replied(outcome, out)
            case ev.CommitRead(record=record):
                self._on_commit_read(record, out)
            case ev.ObsoleteMarked():
                if a.phase is _A.OBSOLETE:
                    self._fire(_X.STOP_AND_WAIT)
                    out.append(cmd.StopDelivery(attempt=a.info.attempt))
                    out.extend(self._stop_and_wait_commands())
                    out.append(
                        cmd.ArmDeadline(
                            attempt=a.info.attempt,
                            stage=Stage.STOP,
                            seconds=self._timeout(Stage.STOP),
                        )
                    )
                    # Stops and retirements may all have arrived while the attempt was being
                    # marked obsolete: then nothing else would complete the stop.
                    self._after_stopped(out)
            case msg.Stopped(endpoint=endpoint, dirty=dirty):
                if endpoint in a.endpoints:
                    a.stopped.add(endpoint)
                    if dirty:
                        self._dirty.add(endpoint)
                    self._after_stopped(out)
            case msg.Retired(endpoint=endpoint):
                self._on_retired(endpoint, out)
            case ev.DeadlineExpired(stage=stage):
                self._on_deadline(stage, out)

    # -- admission and streaming (Algorithm B.1) -------------------------------------------

    def _prepare(self, out: list[cmd.CoordinatorCommand]) -> None:
        """Start a fresh attempt: bind tau, g, the mode, the required receivers and, in mixed
        mode, their loader classification (what may travel relative)."""
        if not self._transition.can_fire(_X.PREPARE):
            self._transition.fire(_X.PREPARE)  # raises, naming the phase or the guard
        tau, g = self._ids.fresh()
        if tau <= self._last_attempt:
            # Endpoints order attempts by id (a late prepare of a stopped attempt is refused).
            raise ConfigError(f"attempt id {tau} does not follow attempt {self._last_attempt}")
        self._last_attempt = tau
        joined = frozenset(r for r, rec in self._joiners.items() if rec == self._record)
        for r in joined:
            del self._joiners[r]
        self._members |= joined
        info = AttemptInfo(
            attempt=tau,
            candidate=g,
            base=self._record,
            mode=self._mode,
            sync=self.config.sync,
            coordinator=self.config.epoch,
            owners=self.config.owners,
            receivers=frozenset(self._members),
        )
        self._transition.fire(_X.PREPARE)
        self._attempt = _Attempt(
            info=info,
            machine=self._attempt_machine(tau),
            joined=joined,
            proof=self._proof_request(tau, g, joined),
            xor_refused=(
                bound_refused(self.config.xor_refused, info.receivers)
                if info.mode is Mode.MIXED
                else None
            ),
        )
        self._fire(_X.PREPARE)
        # Endpoints learn the attempt only after the control plane registered it, so that no
        # endpoint binds an attempt of a coordinator that was already replaced.
        out.append(cmd.RegisterAttempt(info=info))
        out.append(
            cmd.ArmDeadline(attempt=tau, stage=Stage.PREPARE, seconds=self._timeout(Stage.PREPARE))
        )

    def _proof_request(self, tau: int, g: str, joined: frozenset[str]) -> ProofRequest | None:
        """What this prepare asks endpoints to prove (only before admission: after it,
        receivers may hold the failed attempt's partial writes, which the overwrite retry
        repairs)."""
        proof = self.config.proof
        if proof is None or self._admitted:
            return None
        fingerprint = self._fingerprint_due or (bool(joined) and proof.fingerprint_on_join)
        if not proof.samples and not fingerprint:
            return None
        return ProofRequest(seed=seed_for(tau, g), samples=proof.samples, fingerprint=fingerprint)

    def _disproved(self, out: list[cmd.CoordinatorCommand]) -> bool:
        """Judge the proofs once every endpoint accepted; True when a receiver failed.

        Receivers whose storage does not hold the base version are told so, leave the
        membership, are restored by dense refit, and the attempt fails (before admission,
        so the retry runs in mixed mode without them).
        """
        a = self._attempt
        assert a is not None
        if a.proof is None or a.judged:
            return False
        a.judged = True
        owners = {o: a.proofs.get(o) for o in a.info.owners}
        receivers = {r: a.proofs.get(r) for r in a.info.receivers}
        verdict = judge(a.proof, owners, receivers)
        self._verdicts.append(verdict)
        if a.proof.fingerprint:
            self._fingerprint_due = False
        if not verdict.failed:
            return False
        failed = frozenset(verdict.failed)
        self._members -= failed
        self._restoring |= failed
        tau = a.info.attempt
        for r in sorted(failed):
            out.append(
                cmd.Call(
                    to=(r,),
                    message=msg.Disproved(
                        attempt=tau, epoch=self.config.epoch, reason=verdict.failed[r]
                    ),
                )
            )
        out.append(cmd.RequestDenseRefit(record=self._record, receivers=failed))
        first = min(failed)
        self._fail(
            out,
            f"{len(failed)} receivers do not hold {self._record} ({first}: "
            f"{verdict.failed[first]})",
        )
        return True

    def _admit_if_prepared(self, out: list[cmd.CoordinatorCommand]) -> None:
        a = self._attempt
        assert a is not None
        if a.phase is not _A.PREPARING or not self._attempt_machine_allows(_X.SEND):
            return
        if self._disproved(out):
            return
        self._fire(_X.SEND)
        if self.phase is _T.ADMITTING:
            self._transition.fire(_X.SEND)
            self._admitted = True
        out.append(cmd.Call(to=a.info.owners, message=msg.StartStreaming(attempt=a.info.attempt)))
        if not a.info.sync:
            out.append(
                cmd.ArmDeadline(
                    attempt=a.info.attempt,
                    stage=Stage.ARRIVAL,
                    seconds=self._timeout(Stage.ARRIVAL),
                )
            )
        self._advance(out)

    def _advance(self, out: list[cmd.CoordinatorCommand]) -> None:
        """Take every streaming step whose replies are complete (gate, open_apply, flush)."""
        a = self._attempt
        assert a is not None
        tau = a.info.attempt
        if a.phase is _A.STREAMING and not a.info.sync and self._arrival_mismatch():
            self._fail(out, f"arrival check failed: {self._arrival_mismatch()}")
            return
        if (
            a.phase is _A.STREAMING
            and not a.info.sync
            and not a.arrival_checked
            and len(a.sends) == len(a.info.owners)
        ):
            # Every owner declared its sent list: receivers that still miss a payload fail
            # the attempt after the transport's arrival grace instead of waiting for the
            # arrival deadline (paper App. B.1, arrival check).
            a.arrival_checked = True
            out.append(
                cmd.Call(
                    to=tuple(sorted(a.info.receivers)),
                    message=msg.CheckArrival(attempt=tau, expected=a.expected()),
                )
            )
        if a.phase is _A.STREAMING and self._attempt_machine_allows(_X.WAIT_FOR_REQUESTS):
            # Synchronous RL closes the gate when the attempt starts; asynchronous RL only
            # after every expected payload arrived (paper §7.2, App. B.1 streaming).
            self._fire(_X.WAIT_FOR_REQUESTS)
            out.append(
                cmd.Call(
                    to=tuple(sorted(a.info.receivers)),
                    message=msg.WaitForRequests(attempt=tau, epoch=self.config.epoch),
                )
            )
            out.append(
                cmd.ArmDeadline(attempt=tau, stage=Stage.GATE, seconds=self._timeout(Stage.GATE))
            )
        if a.phase is _A.GATING and self._attempt_machine_allows(_X.OPEN_APPLY):
            self._fire(_X.OPEN_APPLY)
            out.append(
                cmd.Call(
                    to=tuple(sorted(a.info.receivers)),
                    message=msg.OpenApply(attempt=tau, epoch=self.config.epoch),
                )
            )
            # One deadline covers the rest of streaming, the arrival check and the drain.
            out.append(
                cmd.ArmDeadline(attempt=tau, stage=Stage.FLUSH, seconds=self._timeout(Stage.FLUSH))
            )
        if a.phase is _A.APPLYING and self._attempt_machine_allows(_X.FLUSH):
            self._fire(_X.FLUSH)
            out.append(
                cmd.Call(to=a.everyone, message=msg.Flush(attempt=tau, expected=a.expected()))
            )
        if a.phase is _A.FLUSHING and self._attempt_machine_allows(_X.COMMIT):
            self._commit(out)

    def _on_acked(self, event: msg.Acked, out: list[cmd.CoordinatorCommand]) -> None:
        a = self._attempt
        assert a is not None
        if event.receiver not in a.info.receivers or a.phase is not _A.FLUSHING:
            return
        if event.applied != a.expected():
            # Arrival check of flush: the ACK must cover every payload the owners declared.
            self._fail(out, f"{event.receiver} applied {event.applied}, owners sent {a.expected()}")
            return
        if self.config.require_post_apply and not event.post_apply_checked:
            self._fail(out, f"{event.receiver} acknowledged without post-apply checks")
            return
        a.acks.add(event.receiver)
        self._advance(out)

    # -- commit (Algorithm B.2, lines 22-35) -----------------------------------------------

    def _commit(self, out: list[cmd.CoordinatorCommand]) -> None:
        a = self._attempt
        assert a is not None
        self._fire(_X.COMMIT)
        out.append(
            cmd.CompareAndSet(
                attempt=a.info.attempt,
                epoch=self.config.epoch,
                expected=a.info.base,
                new=a.info.target,
                deadline_s=self._timeout(Stage.COMMIT),
            )
        )

    def _on_commit_replied(self, outcome: CommitOutcome, out: list[cmd.CoordinatorCommand]) -> None:
        a = self._attempt
        assert a is not None
        if a.phase is not _A.COMMITTING:
            return
        if outcome is CommitOutcome.SUCCEEDED:
            self._on_committed(a.info.target, out)
        elif outcome is CommitOutcome.FAILED:
            self._commit_failed(out)
        elif outcome is CommitOutcome.CONFLICT:
            self._stand_down(out, "commit conflict")
        else:
            self._fire(_X.COMMIT_UNKNOWN)
            self._read_commit_if_final(out)

    def _read_commit_if_final(self, out: list[cmd.CoordinatorCommand]) -> None:
        """Paper App. B.2: read_commit waits until no commit of tau can change the record."""
        a = self._attempt
        assert a is not None
        if a.phase is _A.UNKNOWN and self._attempt_machine_allows(_X.READ_COMMIT):
            self._fire(_X.READ_COMMIT)
            out.append(cmd.ReadCommit(attempt=a.info.attempt))

    def _on_commit_read(self, record: CommitRecord, out: list[cmd.CoordinatorCommand]) -> None:
        a = self._attempt
        assert a is not None
        if self.phase is _T.RESOLVING:
            # Takeover: did the replaced coordinator's commit take effect?
            self._record = record
            if record == a.info.target:
                self._transition.fire(_X.COMMIT_SUCCEEDED)
                self._took_over_commit = True
                self._start_baseline_update(record, out)
            elif record == a.info.base:
                self._transition.fire(_X.COMMIT_FAILED)
                self._mode = Mode.OVERWRITE
                self._cleanup_then_continue(out)
            else:
                self._stand_down(out, f"the commit record moved to {record}")
        elif a.phase is _A.RESOLVING:
            if record == a.info.target:
                self._on_committed(record, out)
            elif record == a.info.base:
                self._commit_failed(out)
            else:
                self._record = record
                self._stand_down(out, f"the commit record moved to {record}")

    def _on_committed(self, record: CommitRecord, out: list[cmd.CoordinatorCommand]) -> None:
        self._fire(_X.COMMIT_SUCCEEDED)
        self._transition.fire(_X.COMMIT_SUCCEEDED)
        self._record = record
        self._start_baseline_update(record, out)

    def _start_baseline_update(
        self, record: CommitRecord, out: list[cmd.CoordinatorCommand]
    ) -> None:
        """Owners update trackers and residual baseline once they read ``(v+1, g)``."""
        self._committed = record
        self._reports.clear()
        out.append(cmd.Call(to=self.config.owners, message=msg.ReadRecord()))
        out.append(self._baseline_deadline())

    def _baseline_deadline(self) -> cmd.ArmDeadline:
        a = self._attempt
        assert a is not None
        return cmd.ArmDeadline(
            attempt=a.info.attempt, stage=Stage.BASELINE, seconds=self._timeout(Stage.BASELINE)
        )

    def _commit_failed(self, out: list[cmd.CoordinatorCommand]) -> None:
        self._fire(_X.COMMIT_FAILED)
        self._transition.fire(_X.COMMIT_FAILED)
        self._mode = Mode.OVERWRITE
        if not self._abort_if_requested(out):
            self._mark_obsolete(out)

    def _on_baseline_updated(
        self, owner: str, record: CommitRecord, out: list[cmd.CoordinatorCommand]
    ) -> None:
        if (
            self.phase is not _T.FINISHING
            or record != self._committed
            or owner not in self.config.owners
        ):
            return
        self._reports.add(owner)
        self._transition.fire(_X.BASELINE_UPDATE)
        if not self._transition.can_fire(_X.CLEANUP):
            return
        # Every owner reported: clean up, then reopen the gate under the committed attempt;
        # receivers drop their KV caches before the gate reopens (paper App. B.2).
        a = self._attempt
        assert a is not None and self._committed is not None
        self._fire(_X.CLEANUP)
        self._transition.fire(_X.CLEANUP)
        out.extend(self._cleanup_commands())
        self._transition.fire(_X.REOPEN_GATE)
        out.append(
            cmd.Call(
                to=tuple(sorted(a.info.receivers - a.retired)),
                message=msg.ReopenGate(
                    attempt=a.info.attempt, epoch=self.config.epoch, record=self._committed
                ),
            )
        )
        outcome = (
            TransitionOutcome.CONFLICT if self._took_over_commit else TransitionOutcome.COMMITTED
        )
        self._end(outcome, out)

    # -- failure, stop, cleanup, retry (Algorithm B.2, lines 36-43) ------------------------

    def _on_rejected(self, endpoint: str, reason: str, out: list[cmd.CoordinatorCommand]) -> None:
        a = self._attempt
        assert a is not None
        if a.phase is not _A.PREPARING:
            return
        if endpoint in a.joined:
            # A joiner whose prepare failed must report ready (after another refit) again.
            self._members.discard(endpoint)
        if self.phase is _T.ADMITTING and endpoint not in a.joined:
            self._fire(_X.REJECT)
            self._transition.fire(_X.REJECT)
            self._reason = reason
            self._mark_obsolete(out)
        else:
            # After admission every reject triggers overwrite recovery (paper App. B.1).
            self._fail(out, reason)

    def _fail(self, out: list[cmd.CoordinatorCommand], reason: str) -> None:
        a = self._attempt
        assert a is not None
        if a.phase not in _RUNNING:
            return
        self._fire(_X.FAIL)
        if self.phase in (_T.ADMITTING, _T.RUNNING):
            self._transition.fire(_X.FAIL)
        if self._admitted:
            self._mode = Mode.OVERWRITE
        self._reason = reason
        if not self._abort_if_requested(out):
            self._mark_obsolete(out)

    def _mark_obsolete(self, out: list[cmd.CoordinatorCommand]) -> None:
        a = self._attempt
        assert a is not None
        self._fire(_X.MARK_OBSOLETE)
        out.append(cmd.RecordObsolete(attempt=a.info.attempt))
        out.append(self._mark_obsolete_call())
        out.append(
            cmd.ArmDeadline(
                attempt=a.info.attempt, stage=Stage.STOP, seconds=self._timeout(Stage.STOP)
            )
        )

    def _mark_obsolete_call(self) -> cmd.Call:
        a = self._attempt
        assert a is not None
        return cmd.Call(
            to=a.everyone, message=msg.MarkObsolete(attempt=a.info.attempt, epoch=self.config.epoch)
        )

    def _stop_and_wait_commands(self) -> list[cmd.CoordinatorCommand]:
        """Ask the endpoints that have not stopped yet; the supervisor retires dead ones."""
        a = self._attempt
        assert a is not None
        receivers = sorted(a.info.receivers - a.stopped - a.retired)
        to = (*a.info.owners, *receivers)
        return [
            cmd.Call(
                to=to, message=msg.StopAndWait(attempt=a.info.attempt, epoch=self.config.epoch)
            ),
            cmd.CheckRetired(attempt=a.info.attempt, endpoints=to),
        ]

    def _cleanup_commands(self) -> list[cmd.CoordinatorCommand]:
        a = self._attempt
        assert a is not None
        return [
            cmd.ReleaseDelivery(attempt=a.info.attempt),
            cmd.Call(
                to=(*a.info.owners, *sorted(a.info.receivers - a.retired)),
                message=msg.Cleanup(attempt=a.info.attempt),
            ),
        ]

    def _on_retired(self, endpoint: str, out: list[cmd.CoordinatorCommand]) -> None:
        """An endpoint that cannot resume leaves the membership between attempts (App. B.2)."""
        a = self._attempt
        assert a is not None
        if endpoint not in a.endpoints:
            return
        a.retired.add(endpoint)
        if endpoint in a.info.receivers:
            self._members.discard(endpoint)
        if a.phase in _RUNNING:
            self._fail(out, f"{endpoint} was retired")
        else:
            self._after_stopped(out)

    def _after_stopped(self, out: list[cmd.CoordinatorCommand]) -> None:
        a = self._attempt
        assert a is not None
        if a.phase is not _A.STOPPING or not self._stop_complete():
            return
        if self.phase is _T.TAKING_OVER:
            self._transition.fire(_X.READ_COMMIT)
            out.append(cmd.ReadCommit(attempt=a.info.attempt))
            return
        if self.phase in (_T.READMITTING, _T.RECOVERING, _T.REJECTING, _T.ABORTING):
            self._cleanup_then_continue(out)

    def _cleanup_then_continue(self, out: list[cmd.CoordinatorCommand]) -> None:
        """cleanup(tau), then retry, end, or wait for dense refits (Algorithm B.2, 38-43)."""
        a = self._attempt
        assert a is not None
        if a.phase is _A.STOPPING:
            self._fire(_X.CLEANUP)
            out.extend(self._cleanup_commands())
        if self.phase is _T.REJECTING:
            self._transition.fire(_X.CLEANUP)
            self._end(TransitionOutcome.REJECTED, out)
        elif self.phase is _T.ABORTING:
            self._transition.fire(_X.CLEANUP)
            # Paper App. B.2, operator intervention: a closed gate stays closed until a dense
            # refit restores every receiver where writes landed; receivers that report no
            # write hold the committed record already and reopen at once.
            self._refit_needed = frozenset(self._dirty & self._members)
            self._refitted = {r for r, rec in self._joiners.items() if rec == self._record}
            if self._refit_needed - self._refitted:
                out.append(cmd.RequestDenseRefit(record=self._record, receivers=self._refit_needed))
            self._reopen_after_refit(out)
        elif not self._abort_if_requested(out):
            self._retry(out)

    def _retry(self, out: list[cmd.CoordinatorCommand]) -> None:
        """Prepare the next attempt, first waiting (bounded) for disproved receivers being
        restored, so that the retry does not commit without them."""
        a = self._attempt
        assert a is not None
        if self.config.join_wait_s > 0 and self._restoring:
            self._join_wait = True
            out.append(
                cmd.ArmDeadline(
                    attempt=a.info.attempt, stage=Stage.JOIN, seconds=self.config.join_wait_s
                )
            )
            return
        self._prepare(out)

    def _retry_now(self, out: list[cmd.CoordinatorCommand]) -> None:
        """End the join wait: prepare at once (receivers not ready by now join later)."""
        self._join_wait = False
        self._restoring.clear()
        if not self._abort_if_requested(out) and self._transition.can_fire(_X.PREPARE):
            self._prepare(out)

    def _on_deadline(self, stage: Stage, out: list[cmd.CoordinatorCommand]) -> None:
        a = self._attempt
        assert a is not None
        if stage is Stage.JOIN:
            if self._join_wait:
                self._retry_now(out)
        elif stage is Stage.BASELINE:
            # The call must arrive (a restarted owner never got it): ask the missing again.
            missing = [o for o in self.config.owners if o not in self._reports]
            if self.phase is _T.FINISHING and missing:
                out.append(cmd.Call(to=tuple(missing), message=msg.ReadRecord()))
                out.append(self._baseline_deadline())
        elif stage is Stage.COMMIT:
            a.commit_deadline_passed = True
            if a.phase is _A.COMMITTING:
                self._fire(_X.COMMIT_UNKNOWN)
            self._read_commit_if_final(out)
        elif stage is Stage.STOP:
            # Stop-path calls are idempotent: ask again and keep waiting (a receiver that never
            # acknowledges needs the operator, paper App. B.2).
            if a.phase is _A.OBSOLETE:
                out.append(cmd.RecordObsolete(attempt=a.info.attempt))
                out.append(self._mark_obsolete_call())
            elif a.phase is _A.STOPPING and not self._stop_complete():
                out.extend(self._stop_and_wait_commands())
            else:
                return
            out.append(
                cmd.ArmDeadline(
                    attempt=a.info.attempt, stage=Stage.STOP, seconds=self._timeout(Stage.STOP)
                )
            )
        elif a.phase in _STAGE_PHASES[stage]:
            self._fail(out, f"{stage.value} deadline expired")

    # -- takeover, conflict, abort (paper App. B.2) ----------------------------------------

    def _take_over(self, old: AttemptInfo | None, out: list[cmd.CoordinatorCommand]) -> None:
        if old is None:
            self._prepare(out)
            return
        if old.base != self.config.base:
            raise ConfigError(
                f"old attempt {old.attempt} starts from {old.base}, not {self.config.base}"
            )
        if old.coordinator >= self.config.epoch:
            raise LocalProtocolError(
                f"epoch {self.config.epoch} cannot take over attempt of epoch {old.coordinator}",
                attempt=old.attempt,
            )
        # Algorithm B.2, lines 2-12: the old attempt is treated as admitted; every later
        # attempt of this coordinator uses overwrite mode.
        self._admitted = True
        self._mode = Mode.OVERWRITE
        self._last_attempt = old.attempt
        self._transition.fire(_X.TAKE_OVER)
        self._members = set(old.receivers)
        self._attempt = _Attempt(info=old, machine=self._attempt_machine(old.attempt))
        self._fire(_X.TAKE_OVER)
        self._mark_obsolete(out)

    def _stand_down(self, out: list[cmd.CoordinatorCommand], reason: str) -> None:
        """Another coordinator owns the transition: no commit, no gate operation, no retry."""
        if self._attempt is not None and self._attempt.machine.can_fire(_X.CONFLICT):
            self._fire(_X.CONFLICT)
        self._transition.fire(_X.CONFLICT)
        self._reason = reason
        self._end(TransitionOutcome.CONFLICT, out)

    def _abort_if_requested(self, out: list[cmd.CoordinatorCommand]) -> bool:
        """Take a pending operator abort once the transition may abort; True if it did."""
        if self._abort_reason is None or not self._transition.can_fire(_X.ABORT):
            return False
        self._join_wait = False
        self._transition.fire(_X.ABORT)
        self._reason = f"operator abort: {self._abort_reason}"
        a = self._attempt
        assert a is not None
        if a.phase in _RUNNING:
            self._fire(_X.FAIL)
        if a.phase is _A.FAILED:
            self._mark_obsolete(out)
        elif a.phase is _A.CLEANED:
            self._cleanup_then_continue(out)
        return True

    def _on_receiver_ready(
        self, receiver: str, record: CommitRecord, out: list[cmd.CoordinatorCommand]
    ) -> None:
        """A receiver restored ``record`` by dense refit: it joins at the next prepare."""
        if record != self._record:
            return  # the record moved on: it must refit again before joining (App. B.2)
        self._joiners[receiver] = record
        self._restoring.discard(receiver)
        if self._join_wait and not self._restoring:
            self._retry_now(out)
        if self.phase is _T.REFITTING and receiver in self._refit_needed:
            self._refitted.add(receiver)
            self._transition.fire(_X.DENSE_REFIT)
            self._reopen_after_refit(out)

    def _reopen_after_refit(self, out: list[cmd.CoordinatorCommand]) -> None:
        if not self._transition.can_fire(_X.REOPEN_GATE):
            return
        self._transition.fire(_X.REOPEN_GATE)
        a = self._attempt
        assert a is not None
        if self._members:
            out.append(
                cmd.Call(
                    to=tuple(sorted(self._members)),
                    message=msg.ReopenGate(
                        attempt=a.info.attempt, epoch=self.config.epoch, record=self._record
                    ),
                )
            )
        self._end(TransitionOutcome.ABORTED, out)

    def _end(self, outcome: TransitionOutcome, out: list[cmd.CoordinatorCommand]) -> None:
        self._outcome = outcome
        a = self._attempt
        committed_by = None
        if self._committed is not None and a is not None:
            # Our own commit, or the replaced coordinator's that takeover found (App. B.2).
            committed_by = a.info.coordinator
        out.append(
            cmd.TransitionEnded(
                outcome=outcome,
                record=self._record,
                attempt=a.info.attempt if a else None,
                reason=self._reason,
                committed_by=committed_by,
            )
        )

    # -- guards (a failing guard raises LocalProtocolError) --------------------------------

    def _attempt_machine(self, tau: int) -> StateMachine[AttemptPhase]:
        return StateMachine(
            AttemptPhase,
            name=f"attempt {tau}",
            attempt=tau,
            guards={
                _X.SEND: self._all_prepared,
                _X.WAIT_FOR_REQUESTS: self._arrived_or_sync,
                _X.OPEN_APPLY: self._all_gated,
                _X.FLUSH: self._all_sent,
                _X.COMMIT: self._all_acked,
                _X.READ_COMMIT: self._no_commit_can_land,
                _X.CLEANUP: self._attempt_cleanup_allowed,
            },
        )

    def _all_prepared(self) -> str | None:
        a = self._attempt
        assert a is not None
        missing = a.endpoints - a.accepted
        if not a.registered:
            return "the control plane has not registered the attempt"
        return f"prepare not accepted by {sorted(missing)}" if missing else None

    def _arrival_mismatch(self) -> str | None:
        """Asynchronous RL: every receiver holds what the owners declared, or why not."""
        a = self._attempt
        assert a is not None
        if len(a.sends) < len(a.info.owners):
            return None
        expected = a.expected()
        for r, counts in a.staged.items():
            if counts != expected:
                return f"{r} staged {counts}, owners sent {expected}"
        return None

    def _arrived_or_sync(self) -> str | None:
        a = self._attempt
        assert a is not None
        if a.info.sync:
            return None
        if len(a.sends) < len(a.info.owners):
            return "owners are still sending"
        missing = a.info.receivers - a.staged.keys()
        if missing:
            return f"payloads have not all arrived at {sorted(missing)}"
        return self._arrival_mismatch()

    def _all_gated(self) -> str | None:
        a = self._attempt
        assert a is not None
        missing = a.info.receivers - a.gated
        return f"gate not closed at {sorted(missing)}" if missing else None

    def _all_sent(self) -> str | None:
        a = self._attempt
        assert a is not None
        missing = set(a.info.owners) - a.sends.keys()
        return f"owners {sorted(missing)} are still sending" if missing else None

    def _all_acked(self) -> str | None:
        a = self._attempt
        assert a is not None
        missing = a.info.receivers - a.acks
        return f"no completion ACK from {sorted(missing)}" if missing else None

    def _no_commit_can_land(self) -> str | None:
        a = self._attempt
        assert a is not None
        return None if a.commit_deadline_passed else "the commit deadline has not passed"

    def _stop_complete(self) -> bool:
        a = self._attempt
        assert a is not None
        return a.endpoints <= a.stopped | a.retired

    def _attempt_cleanup_allowed(self) -> str | None:
        a = self._attempt
        assert a is not None
        if a.phase is _A.STOPPING and not self._stop_complete():
            return "endpoints are still stopping"
        return self._baselines_reported() if self.phase is _T.FINISHING else None

    def _baselines_reported(self) -> str | None:
        missing = set(self.config.owners) - self._reports
        return f"owners {sorted(missing)} have not updated their baseline" if missing else None

    def _previous_attempt_cleaned(self) -> str | None:
        a = self._attempt
        if a is None or a.phase is _A.CLEANED:
            return None
        return f"attempt {a.info.attempt} is {a.phase.value}, not cleaned up"

    def _old_attempt_stopped(self) -> str | None:
        a = self._attempt
        assert a is not None
        return (
            None
            if a.phase is _A.STOPPING and self._stop_complete()
            else "old attempt still running"
        )

    def _cleanup_allowed(self) -> str | None:
        if self.phase is _T.FINISHING:
            return self._baselines_reported()
        a = self._attempt
        assert a is not None
        return None if a.phase is _A.CLEANED else "the attempt is not cleaned up"

    def _refits_done(self) -> str | None:
        if self.phase is not _T.REFITTING:
            return None
        missing = self._refit_needed - self._refitted
        return f"receivers {sorted(missing)} have not been dense-refitted" if missing else None

    def _abortable(self) -> str | None:
        a = self._attempt
        if a is not None and a.phase in _AWAITING_OUTCOME:
            return "a commit outcome is pending"
        return None

    # -- helpers ---------------------------------------------------------------------------

    def _fire(self, trigger: Trigger) -> None:
        assert self._attempt is not None
        self._attempt.machine.fire(trigger)

    def _attempt_machine_allows(self, trigger: Trigger) -> bool:
        assert self._attempt is not None
        return self._attempt.machine.can_fire(trigger)

    def _is_current(self, attempt: int) -> bool:
        return self._attempt is not None and self._attempt.info.attempt == attempt

    def _timeout(self, stage: Stage) -> float:
        return self.config.timeouts.of(stage)
