"""The receiver core: ingestion, deduplication, the bounded queue and declared-order application.

The core never touches bytes or tensors.  The engine runs the reception checks on each
payload's bytes and reports the result as :class:`~dcr.protocol.events.PayloadArrived`; the
core decides what happens to the payload (stage, decode, apply, discard) and when the
receiver may acknowledge, stop or reopen its request gate (paper App. B.1, B.2).

Storage safety rules that protect G1 even against a faulty coordinator:

* a receiver whose storage may hold a partial write refuses a mixed-mode attempt (XOR masks
  assume the committed bits);
* it reopens its gate only at a record it verifiably holds: the target of an attempt it fully
  applied and acknowledged, a record it restored by dense refit, or its committed record when
  nothing was written since.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass, field

from dcr.errors import ConfigError
from dcr.protocol import commands as cmd
from dcr.protocol import events as ev
from dcr.protocol.lifecycle import ReceiverPhase, Trigger
from dcr.protocol.machine import StateMachine
from dcr.protocol.types import AttemptInfo, CommitRecord, Mode, PayloadKey

__all__ = ["QueueConfig", "ReceiverCore"]

_R = ReceiverPhase
_X = Trigger
_RUNNING = frozenset({_R.PREPARED, _R.GATED, _R.APPLYING, _R.FLUSHING})


@dataclass(frozen=True, slots=True, kw_only=True)
class QueueConfig:
    """Bound on decoded payloads held for application (paper App. C: 32 groups of 8 + 1)."""

    groups: int = 32
    group_size: int = 8
    """Payloads applied by one ``Apply`` command (one assembly group)."""

    def __post_init__(self) -> None:
        if self.groups < 1 or self.group_size < 1:
            raise ConfigError(f"queue needs at least one group of one payload, got {self}")

    @property
    def capacity(self) -> int:
        """Decoded payloads held at most: the full groups plus the group being assembled."""
        return (self.groups + 1) * self.group_size


@dataclass(slots=True)
class _Ingest:
    """Per-attempt ingestion state, keyed by ``(owner, payload id)``."""

    info: AttemptInfo
    seen: dict[tuple[str, int], bytes] = field(default_factory=dict)
    highest: int = -1
    """Highest payload id seen or declared; nothing beyond it can be applied yet."""
    finals: dict[str, int] = field(default_factory=dict)
    staged: set[PayloadKey] = field(default_factory=set)
    decoding: set[PayloadKey] = field(default_factory=set)
    decoded: set[PayloadKey] = field(default_factory=set)
    applying: tuple[PayloadKey, ...] = ()
    cursor: int = 0
    applied: dict[str, int] = field(default_factory=dict)
    all_checked: bool = True
    apply_open: bool = False
    expected: dict[str, int] | None = None
    staged_reported: bool = False
    synchronizing: bool = False
    paused: bool = False
    want: PayloadKey | None = None
    """While paused: the one payload ingestion still lets through."""
    stop_pending: bool = False

    waiting: list[tuple[int, PayloadKey]] = field(default_factory=list)
    """Synchronous RL: staged payloads by declared position (a heap), for decoding."""
    rank: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rank = {o: i for i, o in enumerate(self.info.owners)}

    def position(self, key: PayloadKey) -> int:
        """Index of ``key`` in the declared order ``(payload id, owner)`` (App. B.1)."""
        return key.payload_id * len(self.info.owners) + self.rank[key.owner]

    def order(self) -> Iterator[tuple[int, PayloadKey]]:
        """Keys in declared order from the cursor, skipping owners known to be finished."""
        owners = self.info.owners
        pos = self.cursor
        while pos // len(owners) <= self.highest:
            pid, i = divmod(pos, len(owners))
            final = self.finals.get(owners[i])
            if final is None or pid <= final:
                yield pos, PayloadKey(attempt=self.info.attempt, owner=owners[i], payload_id=pid)
            pos += 1

    def next_key(self) -> PayloadKey | None:
        """The payload to apply next, or ``None`` if every owner's final one is applied."""
        for _, key in self.order():
            return key
        owners = self.info.owners
        if all(o in self.finals for o in owners):
            return None
        # Some owner's final payload is unknown: its next id is what comes next.
        pid, i = divmod(self.cursor, len(owners))
        while owners[i] in self.finals and pid > self.finals[owners[i]]:
            pid, i = divmod(pid * len(owners) + i + 1, len(owners))
        return PayloadKey(attempt=self.info.attempt, owner=owners[i], payload_id=pid)

    @property
    def used(self) -> int:
        return len(self.decoding) + len(self.decoded)

    def complete(self) -> bool:
        """Every owner's final payload is known and every payload up to it was applied."""
        owners = self.info.owners
        return all(o in self.finals for o in owners) and all(
            self.applied.get(o, 0) == self.finals[o] + 1 for o in owners
        )

    def counts(self) -> tuple[tuple[str, int], ...]:
        return tuple((o, self.applied.get(o, 0)) for o in self.info.owners)

    def arrived(self) -> tuple[tuple[str, int], ...] | None:
        """``(owner, count)`` when every payload up to each owner's final one arrived.

        Ingestion refuses ids beyond an owner's final one, so counting suffices.
        """
        owners = self.info.owners
        if not all(o in self.finals for o in owners):
            return None
        if len(self.seen) != sum(self.finals[o] + 1 for o in owners):
            return None
        return tuple((o, self.finals[o] + 1) for o in owners)


class ReceiverCore:
    """One rollout rank's protocol state; :meth:`handle` takes an event and returns commands."""

    def __init__(
        self, name: str, *, held: CommitRecord | None, queue: QueueConfig | None = None
    ) -> None:
        self.name = name
        self.queue = queue or QueueConfig()
        self._held = held
        self._dirty = False
        self._acked: CommitRecord | None = None
        self._gate_open = held is not None
        self._epoch = 0
        self._latest = 0
        """Highest attempt id seen; a prepare that arrives after its attempt was stopped is
        refused (attempt ids increase, see :class:`~dcr.protocol.types.IdSource`)."""
        self._ingest: _Ingest | None = None
        self._failed = False
        self._m = StateMachine(
            ReceiverPhase,
            name=f"receiver {name}",
            initial=_R.READY if held is not None else _R.JOINING,
            guards={_X.ACK: self._drained, _X.REOPEN_GATE: self._holds_record},
        )

    # -- read-only views -------------------------------------------------------------------

    @property
    def phase(self) -> ReceiverPhase:
        return self._m.phase

    @property
    def held(self) -> CommitRecord | None:
        """The committed record the storage holds (exactly, unless :attr:`dirty`)."""
        return self._held

    @property
    def dirty(self) -> bool:
        """Whether an attempt's writes may have landed since :attr:`held`."""
        return self._dirty

    @property
    def gate_open(self) -> bool:
        return self._gate_open

    @property
    def attempt(self) -> AttemptInfo | None:
        return self._ingest.info if self._ingest else None

    @property
    def applied(self) -> tuple[tuple[str, int], ...]:
        return self._ingest.counts() if self._ingest else ()

    @property
    def reading(self) -> bool:
        """False while the bounded queue back-pressures ingestion."""
        return not (self._ingest and self._ingest.paused)

    # -- events ----------------------------------------------------------------------------

    def handle(self, event: ev.ReceiverEvent) -> list[cmd.ReceiverCommand]:
        """Apply one event; return the commands to execute, in order."""
        out: list[cmd.ReceiverCommand] = []
        match event:
            case ev.PrepareRequested(info=info, rejection=rejection):
                self._on_prepare(info, rejection, out)
            case ev.PayloadArrived():
                self._on_arrived(event, out)
            case ev.PayloadDecoded(key=key, failure=failure):
                self._on_decoded(key, failure, out)
            case ev.PayloadsApplied():
                self._on_applied(event, out)
            case ev.WaitForRequestsRequested(attempt=tau, epoch=epoch):
                if self._current(tau, epoch) and self.phase is _R.PREPARED:
                    self._m.fire(_X.WAIT_FOR_REQUESTS)
                    self._gate_open = False
                    out.append(cmd.CloseGate(attempt=tau))
            case ev.RequestsDrained(attempt=tau):
                if self._current(tau, self._epoch) and self.phase in (_R.GATED, _R.APPLYING):
                    out.append(cmd.Notify(event=ev.GateClosed(attempt=tau, receiver=self.name)))
            case ev.OpenApplyRequested(attempt=tau, epoch=epoch):
                if self._current(tau, epoch) and self.phase is _R.GATED:
                    self._m.fire(_X.OPEN_APPLY)
                    assert self._ingest is not None
                    self._ingest.apply_open = True
                    self._pump(out)
            case ev.FlushRequested(attempt=tau, expected=expected):
                if self._current(tau, self._epoch) and self.phase is _R.APPLYING:
                    self._on_flush(dict(expected), out)
            case ev.Synchronized(attempt=tau):
                self._on_synchronized(tau, out)
            case ev.MarkObsoleteRequested(attempt=tau, epoch=epoch):
                self._see_epoch(epoch)
                self._latest = max(self._latest, tau)
                if self._is_active(tau):
                    self._mark_obsolete()
            case ev.StopAndWaitRequested(attempt=tau, epoch=epoch):
                self._see_epoch(epoch)
                self._latest = max(self._latest, tau)
                self._on_stop(tau, out)
            case ev.CleanupRequested(attempt=tau):
                if self._is_active(tau) and self._m.can_fire(_X.CLEANUP):
                    self._cleanup(out)
            case ev.ReopenGateRequested(attempt=tau, epoch=epoch, record=record):
                self._on_reopen(tau, epoch, record, out)
            case ev.DenseRefitDone(record=record):
                self._on_dense_refit(record, out)
        return out

    # -- admission -------------------------------------------------------------------------

    def _on_prepare(
        self, info: AttemptInfo, rejection: str | None, out: list[cmd.ReceiverCommand]
    ) -> None:
        s = self._ingest
        if s is not None and s.info.attempt == info.attempt:
            # A repeated call (the engine retries control calls): answer it again.
            if self.phase in _RUNNING:
                out.append(
                    cmd.Notify(event=ev.PrepareAccepted(attempt=info.attempt, endpoint=self.name))
                )
            return
        if (
            self.phase is _R.STOPPED
            and s is not None
            and not s.applying
            and info.coordinator >= self._epoch
        ):
            # A stopped attempt has no pending writes; a lost cleanup must not block the retry.
            self._cleanup(out)
        if rejection is not None:
            # The engine's metadata or loader-classification check failed: reject.
            out.append(
                cmd.Notify(
                    event=ev.PrepareRejected(
                        attempt=info.attempt, endpoint=self.name, check=rejection
                    )
                )
            )
            return
        problem = self._prepare_problem(info)
        if problem is not None:
            # Not a failed check but a state that cannot take the attempt: a failure.
            check, message = problem
            out.append(
                cmd.Notify(
                    event=ev.AttemptFailed(
                        attempt=info.attempt, endpoint=self.name, check=check, message=message
                    )
                )
            )
            return
        self._see_epoch(info.coordinator)
        self._latest = info.attempt
        self._m.fire(_X.PREPARE)
        self._ingest = _Ingest(info=info)
        self._failed = False
        out.append(cmd.Notify(event=ev.PrepareAccepted(attempt=info.attempt, endpoint=self.name)))

    def _prepare_problem(self, info: AttemptInfo) -> tuple[str, str] | None:
        if info.coordinator < self._epoch:
            return "epoch", f"coordinator {info.coordinator} was replaced by {self._epoch}"
        if info.attempt <= self._latest:
            return "stale", f"attempt {info.attempt} was stopped before its prepare arrived"
        if self.phase is _R.JOINING:
            return "joining", "no committed version: a dense refit must come first"
        if not self._m.can_fire(_X.PREPARE):
            return "busy", f"receiver is {self.phase.value}"
        if info.base != self._held:
            return "version", f"receiver holds {self._held}, attempt starts from {info.base}"
        if self._dirty and info.mode is Mode.MIXED:
            # XOR masks assume the committed bits; a partial write needs an overwrite retry.
            return "mode", "storage may hold a partial write; mixed mode refused"
        return None

    # -- ingestion (reception checks and deduplication, App. B.1) --------------------------

    def _on_arrived(self, e: ev.PayloadArrived, out: list[cmd.ReceiverCommand]) -> None:
        key = PayloadKey(attempt=e.attempt, owner=e.owner, payload_id=e.payload_id)
        s = self._ingest
        if s is None or not self._is_active(e.attempt) or self.phase not in _RUNNING:
            out.append(cmd.Discard(key=key, reason="not the active attempt"))
            return
        if e.owner not in s.info.owners:
            self._fail("schema", f"payload from unknown owner {e.owner!r}", out, discard=key)
            return
        if e.rejection is not None:
            self._fail(
                e.rejection,
                f"payload {e.owner}/{e.payload_id} failed {e.rejection}",
                out,
                discard=key,
            )
            return
        previous = s.seen.get((e.owner, e.payload_id))
        if previous is not None:
            if previous == e.digest:
                out.append(cmd.Discard(key=key, reason="duplicate"))
            else:
                self._fail(
                    "conflicting-duplicate",
                    f"payload {e.owner}/{e.payload_id} arrived twice with different bytes",
                    out,
                    discard=key,
                )
            return
        problem = self._order_problem(s, e)
        if problem is not None:
            self._fail("declared-order", problem, out, discard=key)
            return
        s.seen[(e.owner, e.payload_id)] = e.digest
        s.highest = max(s.highest, e.payload_id)
        if e.final:
            s.finals[e.owner] = e.payload_id
        self._m.fire(_X.INGEST)
        s.staged.add(key)
        if s.info.sync:
            heapq.heappush(s.waiting, (s.position(key), key))
        out.append(cmd.StagePayload(key=key))
        self._pump(out)

    @staticmethod
    def _order_problem(s: _Ingest, e: ev.PayloadArrived) -> str | None:
        final = s.finals.get(e.owner)
        if final is not None and e.payload_id > final:
            return f"payload {e.owner}/{e.payload_id} follows final payload {final}"
        if e.final and any(o == e.owner and pid > e.payload_id for o, pid in s.seen):
            return f"final payload {e.owner}/{e.payload_id} precedes a later one"
        if s.expected is not None and e.payload_id >= s.expected.get(e.owner, 0):
            return f"payload {e.owner}/{e.payload_id} was not declared by its owner"
        return None

    # -- the bounded queue and declared-order application ----------------------------------

    def _pump(self, out: list[cmd.ReceiverCommand]) -> None:
        """Decode into free queue slots, apply the next group, report arrival and drain."""
        s = self._ingest
        if s is None or self._failed or self.phase not in _RUNNING:
            return
        tau = s.info.attempt
        nxt = s.next_key()
        if s.info.sync:
            # Decode on arrival; one slot stays reserved for the next payload in declared
            # order so that later payloads cannot fill the queue first (App. B.1).
            if nxt is not None and nxt in s.staged and s.used < self.queue.capacity:
                self._decode(s, nxt, out)
            while s.waiting and s.used < self.queue.capacity - 1:
                _, key = heapq.heappop(s.waiting)
                if key in s.staged:
                    self._decode(s, key, out)
        elif s.apply_open:
            # Asynchronous RL: staged payloads are decoded in declared order after open_apply.
            for _, key in s.order():
                present = key in s.staged or key in s.decoding or key in s.decoded
                if s.used >= self.queue.capacity or not present:
                    break
                if key in s.staged:
                    self._decode(s, key, out)
        if s.apply_open and not s.applying:
            group: list[PayloadKey] = []
            for _, key in s.order():
                if key not in s.decoded or len(group) == self.queue.group_size:
                    break
                group.append(key)
            if group:
                s.applying = tuple(group)
                self._dirty = True
                self._m.fire(_X.APPLY)
                out.append(cmd.Apply(attempt=tau, keys=s.applying))
        if not s.info.sync and not s.staged_reported and (counts := s.arrived()) is not None:
            s.staged_reported = True
            out.append(cmd.Notify(event=ev.Staged(attempt=tau, receiver=self.name, counts=counts)))
        if s.info.sync:
            full = len(s.staged) + s.used >= self.queue.capacity
            if full:
                missing = nxt is not None and all(
                    nxt not in held for held in (s.staged, s.decoding, s.decoded, s.applying)
                )
                want = nxt if missing else None
                # Re-announce when the payload the declared order needs next has changed:
                # ingestion must let exactly that one through, or nothing can move.
                if not s.paused or want != s.want:
                    s.paused, s.want = True, want
                    out.append(cmd.PauseIngest(attempt=tau, want=want))
            elif s.paused:
                s.paused, s.want = False, None
                out.append(cmd.ResumeIngest(attempt=tau))
        if self.phase is _R.FLUSHING and not s.synchronizing and s.complete():
            s.synchronizing = True
            out.append(cmd.Synchronize(attempt=tau))

    @staticmethod
    def _decode(s: _Ingest, key: PayloadKey, out: list[cmd.ReceiverCommand]) -> None:
        s.staged.discard(key)
        s.decoding.add(key)
        out.append(cmd.Decode(key=key))

    def _on_decoded(
        self, key: PayloadKey, failure: str | None, out: list[cmd.ReceiverCommand]
    ) -> None:
        s = self._ingest
        if s is None or key not in s.decoding:
            return
        s.decoding.discard(key)
        if failure is not None:
            self._fail(failure, f"payload {key.owner}/{key.payload_id} failed to decode", out)
            return
        s.decoded.add(key)
        self._pump(out)

    def _on_applied(self, e: ev.PayloadsApplied, out: list[cmd.ReceiverCommand]) -> None:
        s = self._ingest
        if s is None or not s.applying or e.keys != s.applying or e.attempt != s.info.attempt:
            return
        s.applying = ()
        if e.failure is not None:
            self._fail(e.failure, f"applying {len(e.keys)} payloads failed: {e.failure}", out)
        else:
            s.cursor = s.position(e.keys[-1]) + 1
            for key in e.keys:
                s.decoded.discard(key)
                s.applied[key.owner] = s.applied.get(key.owner, 0) + 1
            s.all_checked = s.all_checked and e.post_apply_checked
            self._pump(out)
        self._reply_stopped_if_drained(out)

    def _on_flush(self, expected: dict[str, int], out: list[cmd.ReceiverCommand]) -> None:
        """Flush: check arrival against the owners' declared sent lists, then drain (App. B.1)."""
        s = self._ingest
        assert s is not None
        self._m.fire(_X.FLUSH)
        s.expected = expected
        for o in s.info.owners:
            count = expected.get(o, 0)
            if s.finals.get(o, count - 1) != count - 1 or any(
                owner == o and pid >= count for owner, pid in s.seen
            ):
                self._fail("arrival", f"owner {o} declared {count} payloads", out)
                return
            s.finals[o] = count - 1
            s.highest = max(s.highest, count - 1)
        self._pump(out)

    def _on_synchronized(self, tau: int, out: list[cmd.ReceiverCommand]) -> None:
        s = self._ingest
        if (
            s is None
            or not self._is_active(tau)
            or not s.synchronizing
            or self.phase is not _R.FLUSHING
        ):
            return
        self._m.fire(_X.ACK)
        self._acked = s.info.target
        out.append(
            cmd.Notify(
                event=ev.Acked(
                    attempt=tau,
                    receiver=self.name,
                    applied=s.counts(),
                    post_apply_checked=s.all_checked,
                )
            )
        )

    # -- failure and the stop path (App. B.2) ----------------------------------------------

    def _fail(
        self,
        check: str,
        message: str,
        out: list[cmd.ReceiverCommand],
        *,
        discard: PayloadKey | None = None,
    ) -> None:
        """A peer or payload broke the protocol: the attempt fails; nothing more is applied."""
        s = self._ingest
        assert s is not None
        if discard is not None:
            out.append(cmd.Discard(key=discard, reason=check))
        if self._failed:
            return
        self._failed = True
        self._m.fire(_X.FAIL)
        out.append(
            cmd.Notify(
                event=ev.AttemptFailed(
                    attempt=s.info.attempt, endpoint=self.name, check=check, message=message
                )
            )
        )

    def _mark_obsolete(self) -> None:
        if self._m.can_fire(_X.MARK_OBSOLETE):
            self._m.fire(_X.MARK_OBSOLETE)

    def _on_stop(self, tau: int, out: list[cmd.ReceiverCommand]) -> None:
        """Acknowledge once no write of the attempt can land; unknown attempts return at once."""
        if self._is_active(tau):
            self._mark_obsolete()
            if self.phase is _R.OBSOLETE:
                self._m.fire(_X.STOP_AND_WAIT)
            s = self._ingest
            if s is not None and s.applying:
                s.stop_pending = True
                return
        out.append(cmd.Notify(event=ev.Stopped(attempt=tau, endpoint=self.name, dirty=self._dirty)))

    def _reply_stopped_if_drained(self, out: list[cmd.ReceiverCommand]) -> None:
        s = self._ingest
        if s is not None and s.stop_pending and not s.applying:
            s.stop_pending = False
            out.append(
                cmd.Notify(
                    event=ev.Stopped(attempt=s.info.attempt, endpoint=self.name, dirty=self._dirty)
                )
            )

    def _cleanup(self, out: list[cmd.ReceiverCommand]) -> None:
        s = self._ingest
        assert s is not None
        self._m.fire(_X.CLEANUP)
        s.staged.clear()
        s.waiting.clear()
        s.decoding.clear()
        s.decoded.clear()
        out.append(cmd.Release(attempt=s.info.attempt))

    # -- end of transition, dense refit ----------------------------------------------------

    def _on_reopen(
        self, tau: int, epoch: int, record: CommitRecord, out: list[cmd.ReceiverCommand]
    ) -> None:
        if epoch < self._epoch or self.phase is _R.READY:
            return  # a replaced coordinator never touches the gate; reopening is idempotent
        self._see_epoch(epoch)
        if self.phase is _R.ACKED and self._is_active(tau):
            self._cleanup(out)  # the cleanup call was lost or overtaken
        if not self._m.can_fire(_X.REOPEN_GATE, record=record):
            reason = self._holds_record(record=record) or f"receiver is {self.phase.value}"
            out.append(
                cmd.Notify(
                    event=ev.AttemptFailed(
                        attempt=tau, endpoint=self.name, check="gate-version", message=reason
                    )
                )
            )
            return
        self._m.fire(_X.REOPEN_GATE, record=record)
        self._held = record
        self._dirty = False
        self._acked = None
        self._ingest = None
        self._gate_open = True
        # Paper App. B.2: KV caches are invalidated before the gate reopens.
        out.append(cmd.InvalidateKvCache())
        out.append(cmd.OpenGate())

    def _on_dense_refit(self, record: CommitRecord, out: list[cmd.ReceiverCommand]) -> None:
        self._m.fire(_X.DENSE_REFIT)
        self._held = record
        self._dirty = False
        self._acked = None
        self._ingest = None
        self._gate_open = False
        out.append(cmd.Notify(event=ev.ReceiverReady(receiver=self.name, record=record)))

    # -- guards and helpers ----------------------------------------------------------------

    def _drained(self) -> str | None:
        s = self._ingest
        if s is None or not s.complete():
            return "payloads are still missing or queued"
        return None

    def _holds_record(self, *, record: object = None) -> str | None:
        if record == self._acked or (record == self._held and not self._dirty):
            return None
        return (
            f"storage does not hold {record} "
            f"(held {self._held}, acked {self._acked}, dirty={self._dirty})"
        )

    def _see_epoch(self, epoch: int) -> None:
        self._epoch = max(self._epoch, epoch)

    def _is_active(self, tau: int) -> bool:
        return self._ingest is not None and self._ingest.info.attempt == tau

    def _current(self, tau: int, epoch: int) -> bool:
        """A call for the active attempt from a coordinator that was not replaced."""
        if epoch < self._epoch or not self._is_active(tau):
            return False
        self._see_epoch(epoch)
        return True
