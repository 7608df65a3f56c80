"""The receiver core: ingestion, deduplication, the bounded queue and declared-order application.

The core never touches bytes or tensors; it decides.  The engine reports each payload the
transport hands over (:class:`~dcr.protocol.events.PayloadReceived`); the core either asks
for its reception checks (:class:`~dcr.protocol.commands.CheckPayload`, which also sends the
transport's queueing ACK) or keeps it parked, unread and unacknowledged, while its bounded
queue back-pressures ingestion -- except the one payload the declared order needs next.
Checked payloads come back as ``PayloadArrived``; the core then stages, decodes, applies or
discards them, runs the arrival check of flush with a deadline of its own, and decides when
the receiver may acknowledge, stop or reopen its request gate (paper App. B.1, B.2).

A receiver that starts, restarts or falls behind restores the committed version by a dense
refit: a :class:`~dcr.protocol.messages.DenseRefit` job whose payloads (every element,
overwrite) go through the same ingestion and apply path, after which it reports
``ReceiverReady`` and joins at the next prepare.

Storage safety rules that protect G1 even against a faulty coordinator:

* a receiver whose storage may hold a partial write refuses a mixed-mode attempt (XOR masks
  assume the committed bits);
* it reopens its gate only at a record it verifiably holds: the target of an attempt it fully
  applied and acknowledged, a record it restored by dense refit, or its committed record when
  nothing was written since.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from dcr.errors import ConfigError
from dcr.protocol import commands as cmd
from dcr.protocol import events as ev
from dcr.protocol import messages as msg
from dcr.protocol.lifecycle import ReceiverPhase, Trigger
from dcr.protocol.machine import StateMachine
from dcr.protocol.proof import Proof
from dcr.protocol.types import AttemptInfo, CommitRecord, Mode, PayloadKey, Stage

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
    """Per-attempt (or per dense-refit job) ingestion state, keyed by ``(owner, payload id)``."""

    info: AttemptInfo
    dense: bool = False
    proof: Proof | None = None
    """This receiver's proof of the base version, sent with its acceptance."""
    seen: dict[tuple[str, int], bytes] = field(default_factory=dict)
    received: set[PayloadKey] = field(default_factory=set)
    """Keys of every delivery the transport handed over, checked or not (arrival check)."""
    checking: set[int] = field(default_factory=set)
    """Deliveries whose reception checks are running."""
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
    arrival_armed: bool = False
    staged_reported: bool = False
    synchronizing: bool = False
    paused: bool = False
    want: PayloadKey | None = None
    """While paused: the one payload ingestion still lets through."""
    stop_pending: bool = False
    failed: bool = False

    waiting: list[tuple[int, PayloadKey]] = field(default_factory=list)
    """Synchronous RL: staged payloads by declared position (a heap), for decoding."""
    rank: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rank = {o: i for i, o in enumerate(self.info.owners)}

    @property
    def attempt(self) -> int:
        return self.info.attempt

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

    def full(self, capacity: int) -> bool:
        """Payloads being checked, staged and decoded fill the bounded queue."""
        return len(self.checking) + len(self.staged) + self.used >= capacity

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

    def missing(self) -> list[PayloadKey]:
        """Declared payloads (``expected``) the transport never handed over."""
        if self.expected is None:
            return []
        return [
            key
            for o in self.info.owners
            for pid in range(self.expected.get(o, 0))
            if (key := PayloadKey(attempt=self.info.attempt, owner=o, payload_id=pid))
            not in self.received
        ]


class ReceiverCore:
    """One rollout rank's protocol state; :meth:`handle` takes an event and returns commands.

    ``arrival_grace_s`` is the transport's promise: how long a payload may still take to
    arrive after its owner's ``send`` returned.  The arrival check of flush waits that long
    for missing payloads, then fails the attempt (paper App. B.1).  ``window`` is the
    transport's credit: how many deliveries it hands over without acknowledgement.  Parked
    deliveries leave one of them free, so the payload the declared order needs next can
    always get through; beyond that they are acknowledged unread and held in host memory.
    """

    def __init__(
        self,
        name: str,
        *,
        held: CommitRecord | None,
        queue: QueueConfig | None = None,
        arrival_grace_s: float = 0.0,
        window: int | None = None,
    ) -> None:
        if arrival_grace_s < 0:
            raise ConfigError(f"arrival_grace_s must be >= 0, got {arrival_grace_s}")
        if window is not None and window < 1:
            raise ConfigError(f"window must be >= 1, got {window}")
        self.window = window
        self.name = name
        self.queue = queue or QueueConfig()
        self.arrival_grace_s = arrival_grace_s
        self._held = held
        self._dirty = False
        self._acked: CommitRecord | None = None
        self._gate_open = held is not None
        self._epoch = 0
        self._latest = 0
        """Highest attempt id seen; a prepare that arrives after its attempt was stopped is
        refused (attempt ids increase, see :class:`~dcr.protocol.types.IdSource`)."""
        self._ingest: _Ingest | None = None
        self._dense: _Ingest | None = None
        """The dense-refit job in progress (its ``info.base`` is the record it restores)."""
        self._parked: dict[int, PayloadKey] = {}
        """Deliveries held unread while the queue back-pressures ingestion, in arrival order."""
        self._unacked: list[int] = []
        """Parked deliveries not yet acknowledged to the transport, oldest first."""
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
    def dense_job(self) -> int | None:
        """The dense-refit job in progress, if any."""
        return self._dense.attempt if self._dense else None

    @property
    def restoring(self) -> CommitRecord | None:
        """The committed record the dense-refit job in progress restores, if any."""
        return self._dense.info.base if self._dense else None

    @property
    def applied(self) -> tuple[tuple[str, int], ...]:
        return self._ingest.counts() if self._ingest else ()

    @property
    def reading(self) -> bool:
        """False while the bounded queue back-pressures ingestion."""
        return not (self._ingest and self._ingest.paused)

    @property
    def parked(self) -> int:
        """Deliveries held unread (and unacknowledged) by back-pressure."""
        return len(self._parked)

    # -- events ----------------------------------------------------------------------------

    def handle(self, event: ev.ReceiverEvent) -> list[cmd.ReceiverCommand]:
        """Apply one event; return the commands to execute, in order."""
        out: list[cmd.ReceiverCommand] = []
        match event:
            case msg.Prepare(info=info):
                self._on_prepare(info, None, None, out)
            case ev.PrepareChecked(info=info, rejection=rejection, proof=proof):
                self._on_prepare(info, rejection, proof, out)
            case msg.Disproved(attempt=tau, epoch=epoch):
                self._on_disproved(tau, epoch, out)
            case ev.PayloadReceived(delivery=delivery, key=key):
                self._on_received(delivery, key, out)
            case ev.PayloadArrived():
                self._on_arrived(event, out)
            case ev.PayloadDecoded(key=key, failure=failure):
                self._on_decoded(key, failure, out)
            case ev.PayloadsApplied():
                self._on_applied(event, out)
            case msg.WaitForRequests(attempt=tau, epoch=epoch):
                if self._current(tau, epoch) and self.phase is _R.PREPARED:
                    self._m.fire(_X.WAIT_FOR_REQUESTS)
                    self._gate_open = False
                    out.append(cmd.CloseGate(attempt=tau))
            case ev.RequestsDrained(attempt=tau):
                if self._current(tau, self._epoch) and self.phase in (_R.GATED, _R.APPLYING):
                    out.append(cmd.Notify(message=msg.GateClosed(attempt=tau, receiver=self.name)))
            case msg.OpenApply(attempt=tau, epoch=epoch):
                if self._current(tau, epoch) and self.phase is _R.GATED:
                    self._m.fire(_X.OPEN_APPLY)
                    assert self._ingest is not None
                    self._ingest.apply_open = True
                    self._pump(self._ingest, out)
            case msg.CheckArrival(attempt=tau, expected=expected) if self._is_dense(tau):
                assert self._dense is not None
                if self._declare(self._dense, dict(expected), out):
                    self._pump(self._dense, out)
            case msg.CheckArrival(attempt=tau, expected=expected):
                s = self._ingest
                if (
                    self._current(tau, self._epoch)
                    and s is not None
                    and not s.info.sync
                    and self.phase in _RUNNING
                    and self._declare(s, dict(expected), out)
                ):
                    self._pump(s, out)
            case msg.Flush(attempt=tau, expected=expected):
                if self._current(tau, self._epoch) and self.phase is _R.APPLYING:
                    self._on_flush(dict(expected), out)
            case ev.Synchronized(attempt=tau):
                self._on_synchronized(tau, out)
            case ev.DeadlineExpired(attempt=tau, stage=Stage.ARRIVAL):
                self._on_arrival_deadline(tau, out)
            case msg.MarkObsolete(attempt=tau, epoch=epoch):
                self._see_epoch(epoch)
                self._latest = max(self._latest, tau)
                if self._is_active(tau):
                    self._mark_obsolete()
            case msg.StopAndWait(attempt=tau, epoch=epoch):
                self._see_epoch(epoch)
                self._latest = max(self._latest, tau)
                self._on_stop(tau, out)
            case msg.Cleanup(attempt=tau):
                if self._is_active(tau) and self._m.can_fire(_X.CLEANUP):
                    self._cleanup(out)
            case msg.ReopenGate(attempt=tau, epoch=epoch, record=record):
                self._on_reopen(tau, epoch, record, out)
            case msg.DenseRefit():
                self._on_dense_call(event, out)
            case ev.DenseRefitDone(record=record):
                self._restored(record, out)
            case _:
                pass  # calls meant for owners
        return out

    # -- admission -------------------------------------------------------------------------

    def _on_prepare(
        self,
        info: AttemptInfo,
        rejection: str | None,
        proof: Proof | None,
        out: list[cmd.ReceiverCommand],
    ) -> None:
        s = self._ingest
        if s is not None and s.info.attempt == info.attempt:
            # A repeated call (the engine retries control calls): answer it again.
            if self.phase in _RUNNING:
                out.append(
                    cmd.Notify(
                        message=msg.PrepareAccepted(
                            attempt=info.attempt, endpoint=self.name, proof=s.proof
                        )
                    )
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
                    message=msg.PrepareRejected(
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
                    message=msg.AttemptFailed(
                        attempt=info.attempt, endpoint=self.name, check=check, message=message
                    )
                )
            )
            return
        self._see_epoch(info.coordinator)
        self._latest = info.attempt
        self._m.fire(_X.PREPARE)
        self._ingest = _Ingest(info=info, proof=proof)
        self._discard_parked(lambda key: key.attempt != info.attempt, "obsolete", out)
        out.append(
            cmd.Notify(
                message=msg.PrepareAccepted(attempt=info.attempt, endpoint=self.name, proof=proof)
            )
        )

    def _on_disproved(self, tau: int, epoch: int, out: list[cmd.ReceiverCommand]) -> None:
        """The proof of the base version failed: the storage holds no committed record.

        The receiver stops serving, fails the attempt if it still runs, and waits for a dense
        refit (allowed once the attempt is cleaned up) before it joins again.
        """
        if epoch < self._epoch or not self._is_active(tau):
            return
        self._see_epoch(epoch)
        self._held = None
        self._acked = None
        if self.phase is _R.PREPARED:
            self._m.fire(_X.FAIL)
        if self._gate_open:
            self._gate_open = False
            out.append(cmd.CloseGate(attempt=tau))

    def _prepare_problem(self, info: AttemptInfo) -> tuple[str, str] | None:
        if info.coordinator < self._epoch:
            return "epoch", f"coordinator {info.coordinator} was replaced by {self._epoch}"
        if info.attempt <= self._latest:
            return "stale", f"attempt {info.attempt} was stopped before its prepare arrived"
        if self.phase is _R.JOINING:
            return "joining", "no committed version: a dense refit must come first"
        if self._dense is not None:
            return "joining", f"dense refit {self._dense.attempt} is still running"
        if not self._m.can_fire(_X.PREPARE):
            return "busy", f"receiver is {self.phase.value}"
        if info.base != self._held:
            return "version", f"receiver holds {self._held}, attempt starts from {info.base}"
        if self._dirty and info.mode is Mode.MIXED:
            # XOR masks assume the committed bits; a partial write needs an overwrite retry.
            return "mode", "storage may hold a partial write; mixed mode refused"
        return None

    # -- ingestion (back-pressure, reception checks, deduplication; App. B.1) --------------

    def _stream_of(self, attempt: int) -> _Ingest | None:
        """The ingestion a payload of ``attempt`` belongs to: the dense job or the attempt."""
        if self._dense is not None and self._dense.attempt == attempt:
            return self._dense
        s = self._ingest
        if s is not None and s.attempt == attempt and self.phase in _RUNNING and not s.failed:
            return s
        return None

    def _on_received(self, delivery: int, key: PayloadKey, out: list[cmd.ReceiverCommand]) -> None:
        s = self._stream_of(key.attempt)
        if s is None:
            out.append(cmd.Discard(delivery=delivery, reason="not the active attempt"))
            return
        s.received.add(key)
        if s.paused and key != s.want:
            self._park(delivery, key, out)
            return
        s.checking.add(delivery)
        out.append(cmd.CheckPayload(delivery=delivery))
        self._pump(s, out)

    def _on_arrived(self, e: ev.PayloadArrived, out: list[cmd.ReceiverCommand]) -> None:
        key = e.key
        s = self._stream_of(key.attempt)
        if s is None or e.delivery not in s.checking:
            out.append(cmd.Discard(delivery=e.delivery, reason="not the active attempt"))
            return
        s.checking.discard(e.delivery)
        if key.owner not in s.info.owners:
            self._fail(s, "schema", f"payload from unknown owner {key.owner!r}", out)
            out.append(cmd.Discard(delivery=e.delivery, reason="schema"))
            return
        if e.rejection is not None:
            message = f"payload {key.owner}/{key.payload_id} failed {e.rejection}"
            if e.detail:
                message += f": {e.detail}"
            self._fail(s, e.rejection, message, out)
            out.append(cmd.Discard(delivery=e.delivery, reason=e.rejection))
            return
        previous = s.seen.get((key.owner, key.payload_id))
        if previous is not None:
            if previous != e.digest:
                message = f"payload {key.owner}/{key.payload_id} arrived twice with other bytes"
                self._fail(s, "conflicting-duplicate", message, out)
            out.append(cmd.Discard(delivery=e.delivery, reason="duplicate"))
            self._pump(s, out)
            return
        problem = self._order_problem(s, key, e.final)
        if problem is not None:
            self._fail(s, "declared-order", problem, out)
            out.append(cmd.Discard(delivery=e.delivery, reason="declared-order"))
            return
        s.seen[(key.owner, key.payload_id)] = e.digest
        s.highest = max(s.highest, key.payload_id)
        if e.final:
            s.finals[key.owner] = key.payload_id
        if not s.dense:
            self._m.fire(_X.INGEST)
        s.staged.add(key)
        if s.info.sync:
            heapq.heappush(s.waiting, (s.position(key), key))
        out.append(cmd.StagePayload(key=key, delivery=e.delivery, keep_decoded=s.info.sync))
        self._pump(s, out)

    @staticmethod
    def _order_problem(s: _Ingest, key: PayloadKey, final: bool) -> str | None:
        last = s.finals.get(key.owner)
        if last is not None and key.payload_id > last:
            return f"payload {key.owner}/{key.payload_id} follows final payload {last}"
        if final and any(o == key.owner and pid > key.payload_id for o, pid in s.seen):
            return f"final payload {key.owner}/{key.payload_id} precedes a later one"
        if s.expected is not None and key.payload_id >= s.expected.get(key.owner, 0):
            return f"payload {key.owner}/{key.payload_id} was not declared by its owner"
        return None

    def _park(self, delivery: int, key: PayloadKey, out: list[cmd.ReceiverCommand]) -> None:
        """Hold a delivery unread and unacknowledged: the owners slow down (App. B.1)."""
        self._parked[delivery] = key
        self._unacked.append(delivery)
        if self.window is not None and len(self._unacked) >= self.window:
            # Keep one credit for the payload the declared order needs next.
            out.append(cmd.Acknowledge(delivery=self._unacked.pop(0)))

    def _unpark(self, delivery: int) -> None:
        del self._parked[delivery]
        if delivery in self._unacked:
            self._unacked.remove(delivery)

    def _release_parked(self, s: _Ingest, out: list[cmd.ReceiverCommand]) -> None:
        """Let parked deliveries of ``s`` through: the wanted one while paused, otherwise as
        many as the queue has room for, in arrival order."""
        for delivery, key in list(self._parked.items()):
            if key.attempt != s.attempt:
                continue
            if s.paused and key != s.want:
                continue
            if not s.paused and s.full(self.queue.capacity):
                break
            self._unpark(delivery)
            s.checking.add(delivery)
            out.append(cmd.CheckPayload(delivery=delivery))

    def _discard_parked(
        self, drop: Callable[[PayloadKey], bool], reason: str, out: list[cmd.ReceiverCommand]
    ) -> None:
        for delivery, key in list(self._parked.items()):
            if drop(key):
                self._unpark(delivery)
                out.append(cmd.Discard(delivery=delivery, reason=reason))

    # -- the bounded queue and declared-order application ----------------------------------

    def _pump(self, s: _Ingest, out: list[cmd.ReceiverCommand]) -> None:
        """Decode into free queue slots, apply the next group, report arrival and drain."""
        if s.failed or (not s.dense and (s is not self._ingest or self.phase not in _RUNNING)):
            return
        tau = s.attempt
        capacity = self.queue.capacity
        nxt = s.next_key()
        if s.info.sync:
            # Decode on arrival; one slot stays reserved for the next payload in declared
            # order so that later payloads cannot fill the queue first (App. B.1).
            if nxt is not None and nxt in s.staged and s.used < capacity:
                self._decode(s, nxt, out)
            while s.waiting and s.used < capacity - 1:
                _, key = heapq.heappop(s.waiting)
                if key in s.staged:
                    self._decode(s, key, out)
        elif s.apply_open:
            # Asynchronous RL: staged payloads are decoded in declared order after open_apply.
            for _, key in s.order():
                present = key in s.staged or key in s.decoding or key in s.decoded
                if s.used >= capacity or not present:
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
                if not s.dense:
                    self._m.fire(_X.APPLY)
                out.append(cmd.Apply(attempt=tau, keys=s.applying))
        if (
            not s.info.sync
            and not s.dense
            and not s.staged_reported
            and (counts := s.arrived()) is not None
        ):
            s.staged_reported = True
            out.append(
                cmd.Notify(message=msg.Staged(attempt=tau, receiver=self.name, counts=counts))
            )
        if s.info.sync:
            self._backpressure(s, nxt, out)
        finishing = s.dense or self.phase is _R.FLUSHING
        if finishing and not s.synchronizing and s.complete():
            s.synchronizing = True
            out.append(cmd.Synchronize(attempt=tau))

    def _backpressure(
        self, s: _Ingest, nxt: PayloadKey | None, out: list[cmd.ReceiverCommand]
    ) -> None:
        """Pause ingestion while the queue is full, letting only the next payload through."""
        if s.full(self.queue.capacity):
            in_hand = (s.staged, s.decoding, s.decoded, s.applying)
            missing = nxt is not None and all(nxt not in held for held in in_hand)
            s.paused, s.want = True, nxt if missing else None
        else:
            s.paused, s.want = False, None
        if self._parked:
            self._release_parked(s, out)

    @staticmethod
    def _decode(s: _Ingest, key: PayloadKey, out: list[cmd.ReceiverCommand]) -> None:
        s.staged.discard(key)
        s.decoding.add(key)
        out.append(cmd.Decode(key=key))

    def _on_decoded(
        self, key: PayloadKey, failure: str | None, out: list[cmd.ReceiverCommand]
    ) -> None:
        s = self._stream_of(key.attempt)
        if s is None or key not in s.decoding:
            return
        s.decoding.discard(key)
        if failure is not None:
            self._fail(s, failure, f"payload {key.owner}/{key.payload_id} failed to decode", out)
            return
        s.decoded.add(key)
        self._pump(s, out)

    def _on_applied(self, e: ev.PayloadsApplied, out: list[cmd.ReceiverCommand]) -> None:
        s = self._dense if self._dense and self._dense.attempt == e.attempt else self._ingest
        if s is None or not s.applying or e.keys != s.applying or e.attempt != s.attempt:
            return
        s.applying = ()
        if e.failure is not None:
            self._fail(s, e.failure, f"applying {len(e.keys)} payloads failed: {e.failure}", out)
        else:
            s.cursor = s.position(e.keys[-1]) + 1
            for key in e.keys:
                s.decoded.discard(key)
                s.applied[key.owner] = s.applied.get(key.owner, 0) + 1
            s.all_checked = s.all_checked and e.post_apply_checked
            self._pump(s, out)
        self._reply_stopped_if_drained(out)

    # -- the arrival check (App. B.1) ------------------------------------------------------

    def _declare(
        self, s: _Ingest, expected: dict[str, int], out: list[cmd.ReceiverCommand]
    ) -> bool:
        """Take the owners' declared sent lists; arm the arrival deadline for missing ones.

        Returns False (after failing the attempt) when what arrived contradicts them.
        """
        s.expected = expected
        for o in s.info.owners:
            count = expected.get(o, 0)
            if s.finals.get(o, count - 1) != count - 1 or any(
                owner == o and pid >= count for owner, pid in s.seen
            ):
                self._fail(s, "arrival", f"owner {o} declared {count} payloads", out)
                return False
            s.finals[o] = count - 1
            s.highest = max(s.highest, count - 1)
        missing = s.missing()
        if missing and not s.arrival_armed:
            if self.arrival_grace_s <= 0:
                self._fail_missing(s, missing, out)
                return False
            s.arrival_armed = True
            out.append(
                cmd.ArmDeadline(
                    attempt=s.attempt, stage=Stage.ARRIVAL, seconds=self.arrival_grace_s
                )
            )
        return True

    def _is_dense(self, tau: int) -> bool:
        return self._dense is not None and self._dense.attempt == tau and not self._dense.failed

    def _on_arrival_deadline(self, tau: int, out: list[cmd.ReceiverCommand]) -> None:
        s = self._dense if self._is_dense(tau) else self._ingest
        if s is None or s.attempt != tau or s.failed:
            return
        if not s.dense and self.phase not in _RUNNING:
            return
        missing = s.missing()
        if missing:
            self._fail_missing(s, missing, out)

    def _fail_missing(
        self, s: _Ingest, missing: list[PayloadKey], out: list[cmd.ReceiverCommand]
    ) -> None:
        first = missing[0]
        self._fail(
            s,
            "missing",
            f"{len(missing)} declared payloads never arrived (first {first.owner}/"
            f"{first.payload_id})",
            out,
        )

    def _on_flush(self, expected: dict[str, int], out: list[cmd.ReceiverCommand]) -> None:
        """Flush: check arrival against the owners' declared sent lists, then drain (App. B.1)."""
        s = self._ingest
        assert s is not None
        self._m.fire(_X.FLUSH)
        if self._declare(s, expected, out):
            self._pump(s, out)

    def _on_synchronized(self, tau: int, out: list[cmd.ReceiverCommand]) -> None:
        d = self._dense
        if d is not None and d.attempt == tau and d.synchronizing and not d.failed:
            self._restored(d.info.base, out)
            return
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
                message=msg.Acked(
                    attempt=tau,
                    receiver=self.name,
                    applied=s.counts(),
                    post_apply_checked=s.all_checked,
                )
            )
        )

    # -- failure and the stop path (App. B.2) ----------------------------------------------

    def _fail(self, s: _Ingest, check: str, message: str, out: list[cmd.ReceiverCommand]) -> None:
        """A peer or payload broke the protocol: the attempt (or dense job) fails; nothing
        more of it is applied."""
        if s.failed:
            return
        s.failed = True
        if not s.dense and self.phase not in _RUNNING:
            return  # the attempt is already being stopped: nothing more of it is applied
        if s.dense:
            # The coordinator retries the dense refit with a fresh job.
            self._drop_dense(out)
        else:
            self._m.fire(_X.FAIL)
        out.append(
            cmd.Notify(
                message=msg.AttemptFailed(
                    attempt=s.attempt, endpoint=self.name, check=check, message=message
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
        out.append(
            cmd.Notify(message=msg.Stopped(attempt=tau, endpoint=self.name, dirty=self._dirty))
        )

    def _reply_stopped_if_drained(self, out: list[cmd.ReceiverCommand]) -> None:
        s = self._ingest
        if s is not None and s.stop_pending and not s.applying:
            s.stop_pending = False
            out.append(
                cmd.Notify(
                    message=msg.Stopped(attempt=s.attempt, endpoint=self.name, dirty=self._dirty)
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
        s.checking.clear()
        s.paused, s.want = False, None
        self._discard_parked(lambda key: key.attempt == s.attempt, "released", out)
        out.append(cmd.Release(attempt=s.attempt))

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
                    message=msg.AttemptFailed(
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

    def _on_dense_call(self, call: msg.DenseRefit, out: list[cmd.ReceiverCommand]) -> None:
        """Start restoring ``call.record`` from the owners' dense payloads of ``call.job``.

        Allowed where the lifecycle allows a dense refit (joining, restored an older record,
        or cleaned after a failed attempt); a newer job replaces one still running.
        """
        if self.name not in call.receivers:
            return
        if self._dense is not None:
            if self._dense.attempt >= call.job:
                return  # a repeated or older call
            self._drop_dense(out)
        if not self._m.can_fire(_X.DENSE_REFIT):
            out.append(
                cmd.Notify(
                    message=msg.AttemptFailed(
                        attempt=call.job,
                        endpoint=self.name,
                        check="busy",
                        message=f"receiver is {self.phase.value}",
                    )
                )
            )
            return
        info = AttemptInfo(
            attempt=call.job,
            candidate=call.record.candidate,
            base=call.record,
            mode=Mode.OVERWRITE,
            sync=True,
            coordinator=self._epoch,
            owners=call.owners,
            receivers=frozenset({self.name}),
        )
        self._dense = _Ingest(info=info, dense=True, apply_open=True)

    def _drop_dense(self, out: list[cmd.ReceiverCommand]) -> None:
        d = self._dense
        if d is None:
            return
        self._dense = None
        self._discard_parked(lambda key: key.attempt == d.attempt, "released", out)
        out.append(cmd.Release(attempt=d.attempt))

    def _restored(self, record: CommitRecord, out: list[cmd.ReceiverCommand]) -> None:
        """The storage holds ``record`` exactly (a dense refit finished)."""
        if self._dense is not None:
            out.append(cmd.Release(attempt=self._dense.attempt))
            self._dense = None
        self._m.fire(_X.DENSE_REFIT)
        self._held = record
        self._dirty = False
        self._acked = None
        self._ingest = None
        self._gate_open = False
        out.append(cmd.Notify(message=msg.ReceiverReady(receiver=self.name, record=record)))

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
