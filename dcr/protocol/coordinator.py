"""The coordinator core: Algorithm B.2 (and the coordinator's part of B.1) as events -> commands.

One :class:`CoordinatorCore` drives one transition ``K^v -> v+1``: two machines built from the
edge table (the transition lifecycle, the current attempt's).  It never waits: every control
call is a command; replies, timeouts and failures come back as events.  It decides what the
transition does next (admission, commit, failure, stop, cleanup, retry, takeover, departure,
operator abort); its parts live beside it:

* :mod:`dcr.protocol.transition`: :class:`CoordinatorConfig` and the transition lifecycle's
  machine with its guards;
* :mod:`dcr.protocol.attempt`: the current attempt's replies, guards, streaming steps and
  stop-path calls;
* :mod:`dcr.protocol.prepare`: what a prepare binds (:func:`bound_refused`, the proof request)
  and the verdict over the endpoints' proofs;
* :mod:`dcr.protocol.retry`: attempt ids, the mixed -> overwrite fallback and the join wait;
* :mod:`dcr.protocol.outcome`: the owners' baseline update after a commit and the dense
  refits an operator abort waits for.
"""

from __future__ import annotations

from dcr.protocol import commands as cmd
from dcr.protocol import events as ev
from dcr.protocol import messages as msg
from dcr.protocol.attempt import ATTEMPT_EVENTS, RUNNING, STAGE_PHASES, Attempt, AttemptEvent
from dcr.protocol.lifecycle import AttemptPhase, TransitionPhase, Trigger
from dcr.protocol.outcome import AbortRefits, BaselineUpdate
from dcr.protocol.prepare import BaseProofs, bound_refused
from dcr.protocol.proof import ProofRequest, Verdict
from dcr.protocol.retry import RetryPolicy
from dcr.protocol.transition import CoordinatorConfig, Transition
from dcr.protocol.types import (
    AttemptInfo,
    CommitOutcome,
    CommitRecord,
    IdSource,
    Mode,
    Stage,
    TransitionOutcome,
)

__all__ = ["CoordinatorConfig", "CoordinatorCore", "bound_refused"]

_A = AttemptPhase
_T = TransitionPhase
_X = Trigger

_NOT_A_MEMBER = frozenset({"joining", "version", "proof"})
"""Prepare failures after which a receiver must dense-refit and report ready to rejoin."""


class CoordinatorCore:
    """Drives one transition; :meth:`handle` takes an event and returns commands."""

    def __init__(self, config: CoordinatorConfig, ids: IdSource) -> None:
        self.config = config
        self._ids = ids
        self._record = config.base
        self._policy = RetryPolicy(mode=config.mode, join_wait_s=config.join_wait_s)
        self._members: set[str] = set(config.receivers)
        self._joiners: dict[str, CommitRecord] = {}
        self._attempt: Attempt | None = None
        self._baseline = BaselineUpdate(config.owners)
        self._refits = AbortRefits()
        self._abort_reason: str | None = None
        self._proofs = BaseProofs(config.proof, fingerprint=config.fingerprint)
        self._transition = Transition(config.epoch, current=lambda: self._attempt,
                                      baseline=self._baseline, refits=self._refits)  # fmt: skip

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
        return self._policy.mode

    @property
    def admitted(self) -> bool:
        return self._policy.admitted

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
        return frozenset(self._baseline.reports)

    @property
    def committed(self) -> CommitRecord | None:
        """The record a commit (ours or the replaced coordinator's) wrote, once known."""
        return self._baseline.committed

    @property
    def outcome(self) -> TransitionOutcome | None:
        return self._transition.outcome

    @property
    def verdicts(self) -> tuple[Verdict, ...]:
        """The proofs of the base version judged so far, one per proving prepare."""
        return self._proofs.verdicts

    # -- events ----------------------------------------------------------------------------

    def handle(self, event: ev.CoordinatorEvent) -> list[cmd.CoordinatorCommand]:
        """Apply one event; return the commands to execute, in order.

        Events of attempts other than the current one, and events the current phase has no
        use for (late replies, stale deadlines), change nothing and return no commands.
        """
        out: list[cmd.CoordinatorCommand] = []
        if self._transition.outcome is not None:
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
            case ev.Departed(endpoint=endpoint):
                self._on_departed(endpoint, out)
            case _:
                if isinstance(event, ATTEMPT_EVENTS) and self._is_current(event.attempt):
                    self._on_attempt_event(event, out)
        return out

    def _on_attempt_event(self, event: AttemptEvent, out: list[cmd.CoordinatorCommand]) -> None:
        a = self._attempt
        assert a is not None
        match event:
            case ev.Registered():
                a.on_registered(out)
            case msg.PrepareAccepted(endpoint=endpoint, proof=proof):
                if a.accept(endpoint, proof):
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
            case msg.SendsDone() | msg.Staged() | msg.GateClosed():
                if a.take(event):
                    self._advance(out)
            case msg.Acked():
                self._on_acked(event, out)
            case ev.CommitReplied(outcome=outcome):
                self._on_commit_replied(outcome, out)
            case ev.CommitRead(record=record):
                self._on_commit_read(record, out)
            case ev.ObsoleteMarked():
                if a.stop_and_wait(out):
                    # Stops and retirements may all have arrived while the attempt was being
                    # marked obsolete: then nothing else would complete the stop.
                    self._after_stopped(out)
            case msg.Stopped(endpoint=endpoint, dirty=dirty):
                if endpoint in a.endpoints:
                    a.stopped.add(endpoint)
                    if dirty:
                        self._refits.dirty.add(endpoint)
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
        tau, g = self._policy.fresh(self._ids)
        joined = frozenset(r for r, rec in self._joiners.items() if rec == self._record)
        for r in joined:
            del self._joiners[r]
        self._members |= joined
        info = AttemptInfo(
            attempt=tau,
            candidate=g,
            base=self._record,
            mode=self._policy.mode,
            sync=self.config.sync,
            coordinator=self.config.epoch,
            owners=self.config.owners,
            receivers=frozenset(self._members),
        )
        self._transition.fire(_X.PREPARE)
        self._attempt = self._new_attempt(
            info,
            joined=joined,
            proof=self._proofs.request(tau, g, joined, admitted=self._policy.admitted),
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
        out.append(self._attempt.deadline(Stage.PREPARE))

    def _disproved(self, out: list[cmd.CoordinatorCommand]) -> bool:
        """Judge the proofs once every endpoint accepted; True when a receiver failed.

        Receivers whose storage does not hold the base version are told so, leave the
        membership, are restored by dense refit, and the attempt fails (before admission,
        so the retry runs in mixed mode without them).
        """
        assert self._attempt is not None
        disproved = self._proofs.disproved(self._attempt, self._record, out)
        if disproved is None:
            return False
        failed, reason = disproved
        self._members -= failed
        self._policy.restoring |= failed
        self._fail(out, reason)
        return True

    def _admit_if_prepared(self, out: list[cmd.CoordinatorCommand]) -> None:
        a = self._attempt
        assert a is not None
        if a.phase is not _A.PREPARING or not a.allows(_X.SEND):
            return
        if self._disproved(out):
            return
        self._fire(_X.SEND)
        if self.phase is _T.ADMITTING:
            self._transition.fire(_X.SEND)
            self._policy.admit()
        self._fail_on(a.start_streaming(out), out)

    def _advance(self, out: list[cmd.CoordinatorCommand]) -> None:
        """Take every streaming step whose replies are complete (gate, open_apply, flush)."""
        assert self._attempt is not None
        self._fail_on(self._attempt.advance(out), out)

    def _on_acked(self, event: msg.Acked, out: list[cmd.CoordinatorCommand]) -> None:
        a = self._attempt
        assert a is not None
        if event.receiver not in a.info.receivers or a.phase is not _A.FLUSHING:
            return
        problem = a.ack_problem(event, self.config.require_post_apply)
        if problem is not None:
            self._fail(out, problem)
        else:
            a.acks.add(event.receiver)
            self._advance(out)

    # -- commit (Algorithm B.2, lines 22-35) -----------------------------------------------

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
            a.read_commit_if_final(out)

    def _on_commit_read(self, record: CommitRecord, out: list[cmd.CoordinatorCommand]) -> None:
        a = self._attempt
        assert a is not None
        if self.phase is _T.RESOLVING:
            # Takeover: did the replaced coordinator's commit take effect?
            self._record = record
            if record == a.info.target:
                self._transition.fire(_X.COMMIT_SUCCEEDED)
                self._baseline.took_over = True
                self._start_baseline_update(record, out)
            elif record == a.info.base:
                self._transition.fire(_X.COMMIT_FAILED)
                self._policy.overwrite()
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
        # Durable, and every required receiver acknowledged holding it: their gates reopen
        # now, while the owners update their baselines (only the next transition needs them);
        # a receiver cleans up as it reopens, so the reopening at the end finds it open.
        a = self._attempt
        assert a is not None
        out.append(a.reopen_gate_call(sorted(a.info.receivers & a.acks), record))
        self._start_baseline_update(record, out)

    def _start_baseline_update(
        self, record: CommitRecord, out: list[cmd.CoordinatorCommand]
    ) -> None:
        """Owners update trackers and residual baseline once they read ``(v+1, g)``."""
        assert self._attempt is not None
        out.extend(self._baseline.start(record, self._attempt.deadline(Stage.BASELINE)))

    def _commit_failed(self, out: list[cmd.CoordinatorCommand]) -> None:
        self._fire(_X.COMMIT_FAILED)
        self._transition.fire(_X.COMMIT_FAILED)
        self._policy.overwrite()
        if not self._abort_if_requested(out):
            self._mark_obsolete(out)

    def _on_baseline_updated(
        self, owner: str, record: CommitRecord, out: list[cmd.CoordinatorCommand]
    ) -> None:
        if self.phase is not _T.FINISHING or not self._baseline.take(owner, record):
            return
        self._transition.fire(_X.BASELINE_UPDATE)
        if not self._transition.can_fire(_X.CLEANUP):
            return
        # Every owner reported: clean up, then reopen the gate under the committed attempt;
        # receivers drop their KV caches before the gate reopens (paper App. B.2).
        a = self._attempt
        committed = self._baseline.committed
        assert a is not None and committed is not None
        self._fire(_X.CLEANUP)
        self._transition.fire(_X.CLEANUP)
        out.extend(a.cleanup_commands())
        self._transition.fire(_X.REOPEN_GATE)
        out.append(a.reopen_gate_call(a.addressed, committed))
        took_over = self._baseline.took_over
        self._end(TransitionOutcome.CONFLICT if took_over else TransitionOutcome.COMMITTED, out)

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
            self._transition.reason = reason
            self._mark_obsolete(out)
        else:
            # After admission every reject triggers overwrite recovery (paper App. B.1).
            self._fail(out, reason)

    def _fail(self, out: list[cmd.CoordinatorCommand], reason: str) -> None:
        a = self._attempt
        assert a is not None
        if a.phase not in RUNNING:
            return
        self._fire(_X.FAIL)
        if self.phase in (_T.ADMITTING, _T.RUNNING):
            self._transition.fire(_X.FAIL)
        self._policy.failed()
        self._transition.reason = reason
        if not self._abort_if_requested(out):
            self._mark_obsolete(out)

    def _fail_on(self, reason: str | None, out: list[cmd.CoordinatorCommand]) -> None:
        """Fail the attempt when a step found a ``reason`` to."""
        if reason is not None:
            self._fail(out, reason)

    def _mark_obsolete(self, out: list[cmd.CoordinatorCommand]) -> None:
        assert self._attempt is not None
        self._attempt.mark_obsolete(out)

    def _on_retired(self, endpoint: str, out: list[cmd.CoordinatorCommand]) -> None:
        """An endpoint that cannot resume leaves the membership between attempts (App. B.2)."""
        a = self._attempt
        assert a is not None
        if endpoint not in a.endpoints:
            return
        a.retired.add(endpoint)
        if endpoint in a.info.receivers:
            self._members.discard(endpoint)
        if a.phase in RUNNING:
            self._fail(out, f"{endpoint} was retired")
        else:
            self._after_stopped(out)

    def _on_departed(self, endpoint: str, out: list[cmd.CoordinatorCommand]) -> None:
        """A receiver left the fleet: no later attempt requires it, the current one is retired
        from it (it fails if it still runs), and nothing waits for it to be restored."""
        if endpoint in self.config.owners:
            return  # every transition needs every owner: that is the operator's to resolve
        self._members.discard(endpoint)
        self._joiners.pop(endpoint, None)
        a = self._attempt
        if a is not None and endpoint in a.info.receivers:
            a.departed.add(endpoint)
            if endpoint not in a.retired:
                self._on_retired(endpoint, out)
        if self._policy.gone(endpoint):
            self._retry_now(out)  # the join wait waited for it alone
        if self.phase is _T.REFITTING and self._refits.gone(endpoint):
            self._reopen_after_refit(out)

    def _after_stopped(self, out: list[cmd.CoordinatorCommand]) -> None:
        a = self._attempt
        assert a is not None
        if a.phase is not _A.STOPPING or not a.stop_complete():
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
            out.extend(a.cleanup_commands())
        if self.phase is _T.REJECTING:
            self._transition.fire(_X.CLEANUP)
            self._end(TransitionOutcome.REJECTED, out)
        elif self.phase is _T.ABORTING:
            self._transition.fire(_X.CLEANUP)
            # Paper App. B.2, operator intervention: a closed gate stays closed until a dense
            # refit restores every receiver where writes landed; receivers that report no
            # write hold the committed record already and reopen at once.
            out.extend(self._refits.begin(self._members, self._joiners, self._record))
            self._reopen_after_refit(out)
        elif not self._abort_if_requested(out):
            self._retry(out)

    def _retry(self, out: list[cmd.CoordinatorCommand]) -> None:
        """Prepare the next attempt, first waiting (bounded) for disproved receivers being
        restored, so that the retry does not commit without them."""
        assert self._attempt is not None
        wait = self._policy.wait_for_joiners(self._attempt.info.attempt)
        if wait is not None:
            out.append(wait)
        else:
            self._prepare(out)

    def _retry_now(self, out: list[cmd.CoordinatorCommand]) -> None:
        """End the join wait: prepare at once (receivers not ready by now join later)."""
        self._policy.end_wait()
        if not self._abort_if_requested(out) and self._transition.can_fire(_X.PREPARE):
            self._prepare(out)

    def _on_deadline(self, stage: Stage, out: list[cmd.CoordinatorCommand]) -> None:
        a = self._attempt
        assert a is not None
        if stage is Stage.JOIN:
            if self._policy.join_wait:
                self._retry_now(out)
        elif stage is Stage.BASELINE:
            if self.phase is _T.FINISHING:
                out.extend(self._baseline.ask_again(a.deadline(Stage.BASELINE)))
        elif stage is Stage.COMMIT:
            a.on_commit_deadline(out)
        elif stage is Stage.STOP:
            a.on_stop_deadline(out)
        elif a.phase in STAGE_PHASES[stage]:
            self._fail(out, f"{stage.value} deadline expired")

    # -- takeover, conflict, abort (paper App. B.2) ----------------------------------------

    def _take_over(self, old: AttemptInfo | None, out: list[cmd.CoordinatorCommand]) -> None:
        if old is None:
            self._prepare(out)
            return
        # Algorithm B.2, lines 2-12: the old attempt is treated as admitted; every later
        # attempt of this coordinator uses overwrite mode.
        self._policy.take_over(old, base=self.config.base, epoch=self.config.epoch)
        self._transition.fire(_X.TAKE_OVER)
        self._members = set(old.receivers)
        self._attempt = self._new_attempt(old)
        self._fire(_X.TAKE_OVER)
        self._mark_obsolete(out)

    def _stand_down(self, out: list[cmd.CoordinatorCommand], reason: str) -> None:
        """Another coordinator owns the transition: no commit, no gate operation, no retry."""
        if self._attempt is not None and self._attempt.machine.can_fire(_X.CONFLICT):
            self._fire(_X.CONFLICT)
        self._transition.fire(_X.CONFLICT)
        self._transition.reason = reason
        self._end(TransitionOutcome.CONFLICT, out)

    def _abort_if_requested(self, out: list[cmd.CoordinatorCommand]) -> bool:
        """Take a pending operator abort once the transition may abort; True if it did."""
        if self._abort_reason is None or not self._transition.can_fire(_X.ABORT):
            return False
        self._policy.join_wait = False
        self._transition.fire(_X.ABORT)
        self._transition.reason = f"operator abort: {self._abort_reason}"
        a = self._attempt
        assert a is not None
        if a.phase in RUNNING:
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
        if self._policy.ready(receiver):
            self._retry_now(out)
        if self.phase is _T.REFITTING and self._refits.restored(receiver):
            self._transition.fire(_X.DENSE_REFIT)
            self._reopen_after_refit(out)

    def _reopen_after_refit(self, out: list[cmd.CoordinatorCommand]) -> None:
        if not self._transition.can_fire(_X.REOPEN_GATE):
            return
        self._transition.fire(_X.REOPEN_GATE)
        a = self._attempt
        assert a is not None
        if self._members:
            out.append(a.reopen_gate_call(sorted(self._members), self._record))
        self._end(TransitionOutcome.ABORTED, out)

    def _end(self, outcome: TransitionOutcome, out: list[cmd.CoordinatorCommand]) -> None:
        out.append(self._transition.end(outcome, self._record))

    # -- helpers ---------------------------------------------------------------------------

    def _fire(self, trigger: Trigger) -> None:
        assert self._attempt is not None
        self._attempt.machine.fire(trigger)

    def _is_current(self, attempt: int) -> bool:
        return self._attempt is not None and self._attempt.info.attempt == attempt

    def _new_attempt(
        self,
        info: AttemptInfo,
        *,
        joined: frozenset[str] = frozenset(),
        proof: ProofRequest | None = None,
        xor_refused: frozenset[str] | None = None,
    ) -> Attempt:
        return Attempt(
            info=info,
            epoch=self.config.epoch,
            timeouts=self.config.timeouts,
            cleanup_guard=self._transition.attempt_cleanup_guard,
            joined=joined,
            proof=proof,
            xor_refused=xor_refused,
        )
