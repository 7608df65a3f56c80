"""What must happen before a transition's request gates reopen (Algorithm B.2, App. B.2).

* After a commit (ours, or the replaced coordinator's that takeover found), every owner
  updates its trackers and residual baseline once it reads ``(v+1, g)``
  (:class:`BaselineUpdate`); then the attempt is cleaned up and the gates reopen under the
  committed record.
* After an operator abort, a closed gate stays closed until a dense refit restores every
  receiver where writes landed (:class:`AbortRefits`); receivers that report no write hold
  the committed record already and reopen at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from dcr.protocol import commands as cmd
from dcr.protocol import messages as msg
from dcr.protocol.types import CommitRecord

__all__ = ["AbortRefits", "BaselineUpdate"]


@dataclass(slots=True)
class BaselineUpdate:
    """The owners' baseline update after a commit: which owners reported the record."""

    owners: tuple[str, ...]
    committed: CommitRecord | None = None
    """The record a commit (ours or the replaced coordinator's) wrote, once known."""
    took_over: bool = False
    """The commit was the replaced coordinator's (found by takeover, App. B.2)."""
    reports: set[str] = field(default_factory=set)
    """Owners that reported the baseline update named by the commit."""

    def start(
        self, record: CommitRecord, deadline: cmd.ArmDeadline
    ) -> list[cmd.CoordinatorCommand]:
        """Owners update trackers and residual baseline once they read ``(v+1, g)``."""
        self.committed = record
        self.reports.clear()
        return [cmd.Call(to=self.owners, message=msg.ReadRecord()), deadline]

    def take(self, owner: str, record: CommitRecord) -> bool:
        """Record ``owner``'s report; whether it counts (it names the committed record)."""
        if record != self.committed or owner not in self.owners:
            return False
        self.reports.add(owner)
        return True

    def ask_again(self, deadline: cmd.ArmDeadline) -> list[cmd.CoordinatorCommand]:
        """The call must arrive (a restarted owner never got it): ask the missing again."""
        missing = [o for o in self.owners if o not in self.reports]
        if not missing:
            return []
        return [cmd.Call(to=tuple(missing), message=msg.ReadRecord()), deadline]

    def pending(self) -> str | None:
        """Guard: every owner reported, or which have not."""
        missing = set(self.owners) - self.reports
        return f"owners {sorted(missing)} have not updated their baseline" if missing else None


@dataclass(slots=True)
class AbortRefits:
    """Paper App. B.2, operator intervention: the dense refits an aborted transition waits for
    before it reopens the gates."""

    dirty: set[str] = field(default_factory=set)
    """Endpoints that reported, when they stopped, that writes may have landed."""
    needed: frozenset[str] = frozenset()
    refitted: set[str] = field(default_factory=set)

    def begin(
        self, members: set[str], joiners: Mapping[str, CommitRecord], record: CommitRecord
    ) -> list[cmd.CoordinatorCommand]:
        """The aborted attempt is cleaned up: request the dense refits still needed."""
        self.needed = frozenset(self.dirty & members)
        self.refitted = {r for r, rec in joiners.items() if rec == record}
        if self.needed - self.refitted:
            return [cmd.RequestDenseRefit(record=record, receivers=self.needed)]
        return []

    def restored(self, receiver: str) -> bool:
        """``receiver`` reported ready after a dense refit; whether one was needed there."""
        if receiver not in self.needed:
            return False
        self.refitted.add(receiver)
        return True

    def gone(self, receiver: str) -> bool:
        """``receiver`` departed: its dense refit is not waited for; whether it was."""
        if receiver not in self.needed - self.refitted:
            return False
        self.needed = self.needed - {receiver}
        return True

    def pending(self) -> str | None:
        """Guard: every receiver where writes landed was restored, or which were not."""
        missing = self.needed - self.refitted
        return f"receivers {sorted(missing)} have not been dense-refitted" if missing else None
