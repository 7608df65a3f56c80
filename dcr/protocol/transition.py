"""One transition ``K^v -> v+1`` as the coordinator runs it: its configuration and lifecycle.

:class:`CoordinatorConfig` is what a coordinator needs to run one transition.
:class:`Transition` is the machine of the transition lifecycle (built, like every machine,
from the edge table in :mod:`dcr.protocol.lifecycle`) with the guards of Algorithm B.2: a new
prepare waits for the previous attempt's cleanup, a takeover reads the commit record only
once the old attempt stopped everywhere, and the gates reopen only after every owner updated
its baseline (commit) or every receiver where writes landed was dense-refitted (abort).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from dcr.errors import ConfigError
from dcr.protocol import commands as cmd
from dcr.protocol.attempt import AWAITING_OUTCOME, Attempt
from dcr.protocol.lifecycle import AttemptPhase, TransitionPhase, Trigger
from dcr.protocol.machine import StateMachine
from dcr.protocol.outcome import AbortRefits, BaselineUpdate
from dcr.protocol.proof import ProofConfig
from dcr.protocol.types import CommitRecord, Mode, Timeouts, TransitionOutcome

__all__ = ["CoordinatorConfig", "Transition"]

_A = AttemptPhase
_T = TransitionPhase
_X = Trigger


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
    prepare binds the union over its required receivers
    (:func:`~dcr.protocol.prepare.bound_refused`), so owners encode exactly the other names
    relative; ``None``, or a required receiver missing here, binds ``None``: the integration
    setup's ``xor_names``."""

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


class Transition(StateMachine[TransitionPhase]):
    """The transition lifecycle's machine of coordinator ``epoch``.

    Its guards read the current attempt (``current`` returns it) and what must happen before
    the gates reopen (``baseline``, ``refits``); a failing guard raises
    :class:`~dcr.errors.LocalProtocolError`.
    """

    def __init__(
        self,
        epoch: int,
        *,
        current: Callable[[], Attempt | None],
        baseline: BaselineUpdate,
        refits: AbortRefits,
    ) -> None:
        self._current = current
        self._baseline = baseline
        self._refits = refits
        self.reason = ""
        """Why the transition did not commit (named when it ends)."""
        self.outcome: TransitionOutcome | None = None
        super().__init__(
            TransitionPhase,
            name=f"coordinator {epoch}",
            guards={
                _X.PREPARE: self._previous_attempt_cleaned,
                _X.READ_COMMIT: self._old_attempt_stopped,
                _X.CLEANUP: self._cleanup_allowed,
                _X.REOPEN_GATE: self._refits_done,
                _X.ABORT: self._abortable,
            },
        )

    def attempt_cleanup_guard(self) -> str | None:
        """What the transition requires before the attempt is cleaned up (after its stop)."""
        return self._baselines_reported() if self.phase is _T.FINISHING else None

    def end(self, outcome: TransitionOutcome, record: CommitRecord) -> cmd.TransitionEnded:
        """The transition ends with ``outcome``; ``record`` is the commit record it knows."""
        self.outcome = outcome
        a = self._current()
        committed_by = None
        if self._baseline.committed is not None and a is not None:
            # Our own commit, or the replaced coordinator's that takeover found (App. B.2).
            committed_by = a.info.coordinator
        return cmd.TransitionEnded(
            outcome=outcome,
            record=record,
            attempt=a.info.attempt if a else None,
            reason=self.reason,
            committed_by=committed_by,
        )

    # -- guards ----------------------------------------------------------------------------

    def _baselines_reported(self) -> str | None:
        return self._baseline.pending()

    def _previous_attempt_cleaned(self) -> str | None:
        a = self._current()
        if a is None or a.phase is _A.CLEANED:
            return None
        return f"attempt {a.info.attempt} is {a.phase.value}, not cleaned up"

    def _old_attempt_stopped(self) -> str | None:
        a = self._current()
        assert a is not None
        return None if a.phase is _A.STOPPING and a.stop_complete() else "old attempt still running"

    def _cleanup_allowed(self) -> str | None:
        if self.phase is _T.FINISHING:
            return self._baselines_reported()
        a = self._current()
        assert a is not None
        return None if a.phase is _A.CLEANED else "the attempt is not cleaned up"

    def _refits_done(self) -> str | None:
        return self._refits.pending() if self.phase is _T.REFITTING else None

    def _abortable(self) -> str | None:
        a = self._current()
        if a is not None and a.phase in AWAITING_OUTCOME:
            return "a commit outcome is pending"
        return None
