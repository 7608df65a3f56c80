"""The coordinator's retry policy: attempt ids, the mixed -> overwrite fallback, the join wait.

* Attempt ids increase: endpoints order attempts by id, so a late prepare of a stopped
  attempt is refused (:class:`~dcr.protocol.types.IdSource`).
* Mode: mixed until admission, overwrite after (paper §6.3).  Once an attempt was admitted,
  receivers may hold its partial writes: every retry after a failure, a failed commit or a
  takeover (Algorithm B.2, lines 2-12) uses overwrite mode.
* Join wait: after receivers' proofs of the base version failed, the retry waits (at most
  ``join_wait_s``) for them to be restored by dense refit and report ready, so that the retry
  does not commit without them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dcr.errors import ConfigError, LocalProtocolError
from dcr.protocol import commands as cmd
from dcr.protocol.types import AttemptInfo, CommitRecord, IdSource, Mode, Stage

__all__ = ["RetryPolicy"]


@dataclass(slots=True)
class RetryPolicy:
    """What the next attempt of one transition binds, and whether its prepare waits."""

    mode: Mode
    """Mode of the next attempt: mixed until admission, overwrite after (paper §6.3)."""
    join_wait_s: float = 0.0
    """How long a retry waits for receivers being restored (``CoordinatorConfig.join_wait_s``)."""
    admitted: bool = False
    last_attempt: int = 0
    restoring: set[str] = field(default_factory=set)
    """Receivers a failed proof sent to a dense refit that have not reported ready."""
    join_wait: bool = False
    """The retry waits for ``restoring`` (until ready or the JOIN deadline)."""

    def fresh(self, ids: IdSource) -> tuple[int, str]:
        """``(tau, g)`` of the next attempt."""
        tau, g = ids.fresh()
        if tau <= self.last_attempt:
            # Endpoints order attempts by id (a late prepare of a stopped attempt is refused).
            raise ConfigError(f"attempt id {tau} does not follow attempt {self.last_attempt}")
        self.last_attempt = tau
        return tau, g

    def admit(self) -> None:
        self.admitted = True

    def failed(self) -> None:
        """An attempt failed: after admission, retries use overwrite mode."""
        if self.admitted:
            self.mode = Mode.OVERWRITE

    def overwrite(self) -> None:
        """A commit of an admitted attempt failed: retries use overwrite mode."""
        self.mode = Mode.OVERWRITE

    def take_over(self, old: AttemptInfo, *, base: CommitRecord, epoch: int) -> None:
        """Algorithm B.2, lines 2-12: the attempt ``old`` of a replaced coordinator, which
        starts from ``base`` too, is treated as admitted; every later attempt of coordinator
        ``epoch`` uses overwrite mode."""
        if old.base != base:
            raise ConfigError(f"old attempt {old.attempt} starts from {old.base}, not {base}")
        if old.coordinator >= epoch:
            raise LocalProtocolError(
                f"epoch {epoch} cannot take over attempt of epoch {old.coordinator}",
                attempt=old.attempt,
            )
        self.admitted = True
        self.mode = Mode.OVERWRITE
        self.last_attempt = old.attempt

    def wait_for_joiners(self, tau: int) -> cmd.ArmDeadline | None:
        """The JOIN deadline of attempt ``tau``'s retry when it first waits for the receivers
        being restored (then it starts to), else ``None``: prepare at once."""
        if self.join_wait_s > 0 and self.restoring:
            self.join_wait = True
            return cmd.ArmDeadline(attempt=tau, stage=Stage.JOIN, seconds=self.join_wait_s)
        return None

    def end_wait(self) -> None:
        """The join wait ends: receivers not ready by now join later."""
        self.join_wait = False
        self.restoring.clear()

    def ready(self, receiver: str) -> bool:
        """``receiver`` was restored; whether the join wait may end now."""
        self.restoring.discard(receiver)
        return self.join_wait and not self.restoring

    def gone(self, receiver: str) -> bool:
        """``receiver`` departed: it is not waited for; whether the join wait may end now
        (only when it was waited for)."""
        if receiver not in self.restoring:
            return False
        return self.ready(receiver)
