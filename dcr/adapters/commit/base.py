"""The commit-store interface (paper §6.3, App. B.2 "Commit outcomes", "Failover").

A commit store holds, durably, the commit record ``K = (v, g)`` together with what makes
compare-and-set safe across coordinators: the active coordinator *epoch* (a coordinator that
takes over claims a new epoch; the store then refuses every later registration or commit of an
older one with a conflict), the active attempt, and the attempts marked obsolete (whose commits
it refuses).  Each compare-and-set carries a deadline; the store accepts it only before then, so
``read_commit`` can wait out the deadline and then read an outcome no pending commit can change.

Subclasses implement one primitive, :meth:`CommitStore._transact`, that reads the state and
writes a new one atomically; the base class builds every operation on it.

**A record never rewinds.**  A store that was never written reads as :data:`INITIAL_RECORD`
at epoch 0.  A durable store that has been written remembers that outside the record (the S3
store in a marker object beside it, SQLite in a marker file beside the database), so a record
deleted or expired afterwards is an error (:func:`record_missing`), never an empty state:
reading it as version 0 would start a fleet that committed over from nothing and hand out
coordinator epochs again.  :meth:`CommitStore.reset` is the operator's explicit way back to
the empty state.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Self

import anyio

from dcr.errors import CommitConflict, CommitStoreError, ConfigError
from dcr.protocol.types import CommitOutcome, CommitRecord

if TYPE_CHECKING:
    from dcr.adapters.context import AdapterContext

__all__ = ["INITIAL_RECORD", "CommitState", "CommitStore", "record_missing"]

INITIAL_RECORD = CommitRecord(version=0, candidate="g0")
"""The record of a store that has never committed: version 0 of the initial checkpoint."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CommitState:
    """Everything the store holds for one policy.

    ``revision`` increases with every change; a compare-and-set must observe it unchanged, so
    two writers can never both win (an S3 ETag or an etcd ``mod_revision`` plays this role).
    """

    record: CommitRecord
    epoch: int = 0
    """Epoch of the active coordinator (0: none claimed yet)."""
    attempt: int | None = None
    """The active attempt: the one the active coordinator registered last."""
    deadline: float | None = None
    """Commit deadline of the active attempt's last compare-and-set (store clock, seconds)."""
    obsolete: frozenset[int] = frozenset()
    info: str = ""
    """What the active coordinator registered with the active attempt (opaque to the store;
    the engine keeps the attempt's :class:`~dcr.protocol.types.AttemptInfo` here so that a
    coordinator that takes over can resume it)."""
    address: str = ""
    """Control address of the active coordinator: where endpoints find it (paper App. C)."""
    lease: float | None = None
    """Until when (store clock) the active coordinator's process is known to be alive; a
    standby takes over once it has passed.  ``None``: no lease is kept."""
    revision: int = 0


Transaction = Callable[[CommitState], CommitState | None]
"""Reads the current state and returns the new one, or ``None`` to change nothing."""

RESET_COMMAND = "dcr commit-store reset --fleet <fleet file>"
"""The command line that resets the commit store a fleet file names."""


def record_missing(where: str, evidence: str) -> CommitStoreError:
    """The error of a durable store whose record is gone although ``evidence`` shows it was
    written: the fleet committed, and reading the record as version 0 would rewind it."""
    return CommitStoreError(
        f"the commit record {where} is missing, but {evidence}: the fleet has committed, and "
        "reading the record as version 0 would start it over from nothing (receivers rewound, "
        "coordinator epochs handed out again). It was deleted or expired (a lifecycle rule "
        "over the prefix, a cleanup script). Restore it (an earlier object version, a backup), "
        f"or start the fleet afresh on purpose: `{RESET_COMMAND}` (or `await store.reset()`) "
        "deletes what is left of the record, then the store reads as never written",
        retryable=False,
        check="missing",
    )


class CommitStore(ABC):
    """Durable commit record with compare-and-set; all operations are atomic.

    ``clock`` is the store's clock (seconds); it must agree with the coordinators' clocks
    within the margin their deadlines allow (the paper assumes clock-synchronized coordinators
    and control plane).
    """

    def __init__(self, *, clock: Callable[[], float] = time.time, poll_s: float = 0.05) -> None:
        self.clock = clock
        self.poll_s = poll_s

    @classmethod
    def from_config(cls, options: Mapping[str, Any], context: AdapterContext) -> Self:
        """The commit store of one process, from its fleet file section (``options``: the
        keys beside ``kind``) and the process around it (:class:`~dcr.adapters.context.
        AdapterContext`; its ``store`` is ``None``).  Every process of a fleet must reach the
        same record.  Unknown keys raise :class:`~dcr.errors.ConfigError`.

        Stores that a fleet file can name override it; this one refuses.
        """
        raise ConfigError(
            f"{cls.__module__}.{cls.__qualname__} defines no from_config(options, context), "
            f"so [{context.section}] cannot name it"
        )

    @abstractmethod
    async def _transact(self, fn: Transaction) -> CommitState:
        """Atomically apply ``fn`` to the stored state; return the state after it.

        An optimistic store may call ``fn`` again after losing a race (S3 conditional
        writes); every operation's ``fn`` therefore answers from its last call only.
        Implementations convert vendor errors into :class:`~dcr.errors.CommitStoreError`.
        """

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""

    async def reset(self, *, dry_run: bool = False) -> list[str]:
        """Delete what the store holds of this record, so that it reads as a store never
        written (:data:`INITIAL_RECORD`, epoch 0): an operator's deliberate fresh start, also
        the way out of a missing record (:func:`record_missing`).  Never while a fleet uses
        the record.  Returns what it deleted (``dry_run``: what it would delete, deleting
        nothing); empty when nothing was stored.

        Durable stores override it; this one refuses.
        """
        raise CommitStoreError(
            f"{type(self).__name__} keeps no durable record to reset; make a new store",
            retryable=False,
            check="reset",
        )

    async def read(self) -> CommitState:
        """The current state."""
        return await self._transact(lambda s: None)

    async def claim(self, *, address: str = "", lease_s: float | None = None) -> int:
        """Become the active coordinator: returns a new epoch, newer than every earlier one.

        ``address`` is where endpoints reach it; ``lease_s`` starts a lease that
        :meth:`renew` extends (standbys wait for it to lapse, see :meth:`claim_if_lapsed`).
        """
        lease = None if lease_s is None else self.clock() + lease_s
        state = await self._transact(
            lambda s: replace(
                s, epoch=s.epoch + 1, address=address, lease=lease, revision=s.revision + 1
            )
        )
        return state.epoch

    async def claim_if_lapsed(self, *, address: str, lease_s: float) -> int | None:
        """A standby's claim: a new epoch only if no coordinator holds a live lease.

        Returns ``None`` while the active coordinator's lease runs (it renews it while its
        process is alive).  Of several standbys racing, exactly one wins.
        """

        won: list[int] = []

        def fn(s: CommitState) -> CommitState | None:
            won.clear()
            now = self.clock()
            if s.epoch and s.lease is not None and s.lease > now:
                return None
            won.append(s.epoch + 1)
            return replace(
                s, epoch=s.epoch + 1, address=address, lease=now + lease_s, revision=s.revision + 1
            )

        await self._transact(fn)
        return won[0] if won else None

    async def renew(self, *, epoch: int, lease_s: float) -> None:
        """Extend the lease of coordinator ``epoch``; :class:`CommitConflict` if replaced."""
        replaced: list[int] = []

        def fn(s: CommitState) -> CommitState | None:
            replaced.clear()
            if s.epoch != epoch:
                replaced.append(s.epoch)
                return None
            return replace(s, lease=self.clock() + lease_s, revision=s.revision + 1)

        await self._transact(fn)
        if replaced:
            raise CommitConflict(
                f"coordinator epoch {epoch} was replaced by epoch {replaced[0]}", check="lease"
            )

    async def register(
        self, *, epoch: int, attempt: int, base: CommitRecord, info: str = ""
    ) -> CommitState:
        """Admit ``attempt`` at prepare; it becomes the active attempt.

        Raises :class:`~dcr.errors.CommitConflict` when ``epoch`` is no longer the active
        coordinator's (paper App. B: the control plane accepts prepare only from it) or the
        record no longer equals ``base`` (the transition was committed meanwhile).
        """
        conflict: list[str] = []

        def fn(s: CommitState) -> CommitState | None:
            conflict.clear()
            if s.epoch != epoch:
                conflict.append(f"coordinator epoch {epoch} was replaced by epoch {s.epoch}")
                return None
            if s.record != base:
                conflict.append(f"the record is {s.record}, not {base}")
                return None
            return replace(s, attempt=attempt, deadline=None, info=info, revision=s.revision + 1)

        state = await self._transact(fn)
        if conflict:
            raise CommitConflict(conflict[0], attempt=attempt, check="register")
        return state

    async def compare_and_set(
        self,
        *,
        epoch: int,
        attempt: int,
        expected: CommitRecord,
        new: CommitRecord,
        deadline: float,
    ) -> CommitOutcome:
        """Replace ``expected`` by ``new`` if nothing forbids it (paper App. B.2).

        ``CONFLICT``: the epoch was replaced, or the record holds neither ``expected`` nor
        ``new`` (another coordinator committed).  ``FAILED``: the attempt is obsolete or not
        the active one, or the store's clock passed ``deadline``.  ``SUCCEEDED`` also when the
        record already holds ``new`` (a repeated commit of the same attempt).
        """
        outcome: list[CommitOutcome] = []

        def fn(s: CommitState) -> CommitState | None:
            outcome.clear()
            if s.epoch != epoch:
                outcome.append(CommitOutcome.CONFLICT)
            elif s.record == new:
                outcome.append(CommitOutcome.SUCCEEDED)
            elif s.record != expected:
                outcome.append(CommitOutcome.CONFLICT)
            elif attempt in s.obsolete or s.attempt != attempt or self.clock() >= deadline:
                outcome.append(CommitOutcome.FAILED)
            else:
                outcome.append(CommitOutcome.SUCCEEDED)
                return replace(s, record=new, deadline=deadline, revision=s.revision + 1)
            return None

        try:
            await self._transact(fn)
        except CommitStoreError:
            # The write may or may not have happened: read_commit resolves it after the
            # deadline (paper App. B.2, unknown outcome).
            return CommitOutcome.UNKNOWN
        return outcome[0]

    async def mark_obsolete(self, *, attempt: int) -> None:
        """Refuse every later commit of ``attempt`` (paper App. B.2, stopping an attempt)."""

        def fn(s: CommitState) -> CommitState | None:
            if attempt in s.obsolete:
                return None
            return replace(s, obsolete=s.obsolete | {attempt}, revision=s.revision + 1)

        await self._transact(fn)

    async def read_commit(self, *, attempt: int, deadline: float) -> CommitRecord:
        """The record once no commit of ``attempt`` can change it any more.

        Waits until the store's clock passes ``deadline`` (the one the attempt's commit
        carried) or the attempt is obsolete, then reads (paper App. B.2: read_commit waits
        past the deadline, which bounds the wait).
        """
        while True:
            state = await self.read()
            remaining = deadline - self.clock()
            if attempt in state.obsolete or remaining <= 0:
                return state.record
            await anyio.sleep(min(remaining, self.poll_s))
