"""The receiver core: one rollout rank's side of the refit protocol (paper App. B.1, B.2).

The core never touches bytes or tensors; it decides.  It admits attempts (prepare, with the
storage safety rules of :mod:`dcr.protocol.storage`), closes and reopens the request gate,
and decides when the receiver may acknowledge, stop or clean up an attempt.  The payloads of
an attempt go through its payload path (:mod:`dcr.protocol.intake`): reception checks,
deduplication, the bounded queue (:mod:`dcr.protocol.ingest`) with back-pressure
(:mod:`dcr.protocol.parking`), declared-order application and the arrival check of flush.

A receiver that starts, restarts or falls behind restores the committed version by a dense
refit: a :class:`~dcr.protocol.messages.DenseRefit` job whose payloads (every element,
overwrite) go through the same ingestion and apply path, after which it reports
``ReceiverReady`` and joins at the next prepare.
"""

from __future__ import annotations

from dcr.errors import ConfigError
from dcr.protocol import commands as cmd
from dcr.protocol import events as ev
from dcr.protocol import messages as msg
from dcr.protocol.ingest import Ingest, QueueConfig
from dcr.protocol.intake import RUNNING, Intake
from dcr.protocol.lifecycle import ReceiverPhase, Trigger
from dcr.protocol.machine import StateMachine
from dcr.protocol.proof import Proof
from dcr.protocol.storage import Storage
from dcr.protocol.types import AttemptInfo, CommitRecord, Mode, Stage

__all__ = ["QueueConfig", "ReceiverCore"]

_R = ReceiverPhase
_X = Trigger


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
        self.name = name
        self.queue = queue or QueueConfig()
        self.arrival_grace_s = arrival_grace_s
        self._storage = Storage(held)
        self._gate_open = held is not None
        self._epoch = 0
        self._latest = 0
        self._draining: int | None = None
        """The dense job that closed the gate while the requests in flight still drain."""
        """Highest attempt id seen; a prepare that arrives after its attempt was stopped is
        refused (attempt ids increase, see :class:`~dcr.protocol.types.IdSource`)."""
        self._m = StateMachine(
            ReceiverPhase,
            name=f"receiver {name}",
            initial=_R.READY if held is not None else _R.JOINING,
            guards={_X.ACK: self._drained, _X.REOPEN_GATE: self._storage.holds},
        )
        self._intake = Intake(
            name,
            machine=self._m,
            storage=self._storage,
            queue=self.queue,
            arrival_grace_s=arrival_grace_s,
            window=window,
        )

    # -- read-only views -------------------------------------------------------------------

    @property
    def window(self) -> int | None:
        """The transport's credit (deliveries handed over without acknowledgement)."""
        return self._intake.parked.window

    @property
    def phase(self) -> ReceiverPhase:
        return self._m.phase

    @property
    def held(self) -> CommitRecord | None:
        """The committed record the storage holds (exactly, unless :attr:`dirty`)."""
        return self._storage.held

    @property
    def dirty(self) -> bool:
        """Whether an attempt's writes may have landed since :attr:`held`."""
        return self._storage.dirty

    @property
    def gate_open(self) -> bool:
        return self._gate_open

    @property
    def attempt(self) -> AttemptInfo | None:
        return self._intake.ingest.info if self._intake.ingest else None

    @property
    def dense_job(self) -> int | None:
        """The dense-refit job in progress, if any."""
        return self._intake.dense.attempt if self._intake.dense else None

    @property
    def restoring(self) -> CommitRecord | None:
        """The committed record the dense-refit job in progress restores, if any."""
        return self._intake.dense.info.base if self._intake.dense else None

    @property
    def applied(self) -> tuple[tuple[str, int], ...]:
        return self._intake.ingest.counts() if self._intake.ingest else ()

    @property
    def reading(self) -> bool:
        """False while the bounded queue back-pressures ingestion."""
        return not (self._intake.ingest and self._intake.ingest.paused)

    @property
    def parked(self) -> int:
        """Deliveries held unread (and unacknowledged) by back-pressure."""
        return len(self._intake.parked)

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
            case ev.PayloadReceived(delivery=delivery, key=key, addressed=addressed):
                early = addressed and self._early(key.attempt)
                self._intake.on_received(delivery, key, out, early=early)
            case ev.PayloadArrived():
                self._intake.on_arrived(event, out)
            case ev.PayloadDecoded(key=key, failure=failure):
                self._intake.on_decoded(key, failure, out)
            case ev.PayloadsApplied():
                self._intake.on_applied(event, out)
            case msg.WaitForRequests(attempt=tau, epoch=epoch):
                if self._current(tau, epoch) and self.phase is _R.PREPARED:
                    self._m.fire(_X.WAIT_FOR_REQUESTS)
                    self._gate_open = False
                    out.append(cmd.CloseGate(attempt=tau))
            case ev.RequestsDrained(attempt=tau) if tau == self._draining:
                # The requests served before a dense job closed the gate finished: it writes.
                self._draining = None
                d = self._intake.dense
                if d is not None and not d.apply_open:
                    d.apply_open = True
                    self._intake.pump(d, out)
            case ev.RequestsDrained(attempt=tau):
                if self._current(tau, self._epoch) and self.phase in (_R.GATED, _R.APPLYING):
                    out.append(cmd.Notify(message=msg.GateClosed(attempt=tau, receiver=self.name)))
            case msg.OpenApply(attempt=tau, epoch=epoch):
                if self._current(tau, epoch) and self.phase is _R.GATED:
                    self._m.fire(_X.OPEN_APPLY)
                    s = self._intake.ingest
                    assert s is not None
                    s.apply_open = True
                    self._intake.pump(s, out)
            case msg.CheckArrival(attempt=tau, expected=expected) if self._intake.is_dense(tau):
                d = self._intake.dense
                assert d is not None
                if self._intake.declare(d, dict(expected), out):
                    self._intake.pump(d, out)
            case msg.CheckArrival(attempt=tau, expected=expected):
                s = self._intake.ingest
                if (
                    self._current(tau, self._epoch)
                    and s is not None
                    and not s.info.sync
                    and self.phase in RUNNING
                    and self._intake.declare(s, dict(expected), out)
                ):
                    self._intake.pump(s, out)
            case msg.Flush(attempt=tau, expected=expected):
                if self._current(tau, self._epoch) and self.phase is _R.APPLYING:
                    self._on_flush(dict(expected), out)
            case ev.Synchronized(attempt=tau):
                self._on_synchronized(tau, out)
            case ev.DeadlineExpired(attempt=tau, stage=Stage.ARRIVAL):
                self._intake.on_arrival_deadline(tau, out)
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
        s = self._intake.ingest
        if s is not None and s.info.attempt == info.attempt:
            # A repeated call (the engine retries control calls): answer it again.
            if self.phase in RUNNING:
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
        self._intake.ingest = Ingest(info=info, proof=proof)
        self._intake.parked.discard(lambda key: key.attempt != info.attempt, "obsolete", out)
        out.append(
            cmd.Notify(
                message=msg.PrepareAccepted(attempt=info.attempt, endpoint=self.name, proof=proof)
            )
        )
        self._intake.adopt(self._intake.ingest, out)

    def _on_disproved(self, tau: int, epoch: int, out: list[cmd.ReceiverCommand]) -> None:
        """The proof of the base version failed: the storage holds no committed record.

        The receiver stops serving, fails the attempt if it still runs, and waits for a dense
        refit (allowed once the attempt is cleaned up) before it joins again.
        """
        if epoch < self._epoch or not self._is_active(tau):
            return
        self._see_epoch(epoch)
        self._storage.held = None
        self._storage.acked = None
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
        if self._intake.dense is not None:
            return "joining", f"dense refit {self._intake.dense.attempt} is still running"
        if not self._m.can_fire(_X.PREPARE):
            return "busy", f"receiver is {self.phase.value}"
        if info.base != self._storage.held:
            return (
                "version",
                f"receiver holds {self._storage.held}, attempt starts from {info.base}",
            )
        if self._storage.dirty and info.mode is Mode.MIXED:
            # XOR masks assume the committed bits; a partial write needs an overwrite retry.
            return "mode", "storage may hold a partial write; mixed mode refused"
        return None

    # -- flush and acknowledgement (App. B.1) ----------------------------------------------

    def _on_flush(self, expected: dict[str, int], out: list[cmd.ReceiverCommand]) -> None:
        """Flush: check arrival against the owners' declared sent lists, then drain (App. B.1)."""
        s = self._intake.ingest
        assert s is not None
        self._m.fire(_X.FLUSH)
        if self._intake.declare(s, expected, out):
            self._intake.pump(s, out)

    def _on_synchronized(self, tau: int, out: list[cmd.ReceiverCommand]) -> None:
        d = self._intake.dense
        if d is not None and d.attempt == tau and d.synchronizing and not d.failed:
            self._restored(d.info.base, out, job=d.attempt)
            return
        s = self._intake.ingest
        if (
            s is None
            or not self._is_active(tau)
            or not s.synchronizing
            or self.phase is not _R.FLUSHING
        ):
            return
        self._m.fire(_X.ACK)
        self._storage.acked = s.info.target
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

    # -- the stop path (App. B.2) ----------------------------------------------------------

    def _mark_obsolete(self) -> None:
        if self._m.can_fire(_X.MARK_OBSOLETE):
            self._m.fire(_X.MARK_OBSOLETE)

    def _on_stop(self, tau: int, out: list[cmd.ReceiverCommand]) -> None:
        """Acknowledge once no write of the attempt can land; unknown attempts return at once."""
        if self._is_active(tau):
            self._mark_obsolete()
            if self.phase is _R.OBSOLETE:
                self._m.fire(_X.STOP_AND_WAIT)
            s = self._intake.ingest
            if s is not None and s.applying:
                s.stop_pending = True
                return
        out.append(
            cmd.Notify(
                message=msg.Stopped(attempt=tau, endpoint=self.name, dirty=self._storage.dirty)
            )
        )

    def _cleanup(self, out: list[cmd.ReceiverCommand]) -> None:
        s = self._intake.ingest
        assert s is not None
        self._m.fire(_X.CLEANUP)
        s.clear()
        self._intake.parked.discard(lambda key: key.attempt == s.attempt, "released", out)
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
        restoring = self._intake.dense is not None
        if restoring or not self._m.can_fire(_X.REOPEN_GATE, record=record):
            # A late reopening never opens the gate while a newer dense job writes storage.
            reason = (
                "a dense refit is restoring the storage"
                if restoring
                else self._storage.holds(record=record) or f"receiver is {self.phase.value}"
            )
            out.append(
                cmd.Notify(
                    message=msg.AttemptFailed(
                        attempt=tau, endpoint=self.name, check="gate-version", message=reason
                    )
                )
            )
            return
        self._m.fire(_X.REOPEN_GATE, record=record)
        self._storage.restored(record)
        self._intake.ingest = None
        self._gate_open = True
        # Paper App. B.2: KV caches are invalidated before the gate reopens.
        out.append(cmd.InvalidateKvCache())
        out.append(cmd.OpenGate())

    def _on_dense_call(self, call: msg.DenseRefit, out: list[cmd.ReceiverCommand]) -> None:
        """Start restoring ``call.record`` from the owners' dense payloads of ``call.job``.

        Allowed where the lifecycle allows a dense refit (joining, restored an older record,
        cleaned after a failed attempt, or serving an older record than the job's: left out of
        a transition that committed meanwhile); a newer job replaces one still running.
        """
        if self.name not in call.receivers:
            return
        if self._intake.dense is not None:
            if self._intake.dense.attempt >= call.job:
                return  # a repeated or older call
            self._intake.drop_dense(out)
        held = self._storage.held
        behind = held is None or held.version < call.record.version
        if (self.phase is _R.READY and not behind) or not self._m.can_fire(_X.DENSE_REFIT):
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
        # A dense job never writes under an open gate (a receiver cleaned up after an attempt
        # that failed before admission still serves its record): it closes the gate and
        # applies once the requests in flight drained.
        if self._gate_open:
            self._gate_open = False
            self._draining = call.job
            out.append(cmd.CloseGate(attempt=call.job))
        d = self._intake.dense = Ingest(info=info, dense=True, apply_open=self._draining is None)
        self._intake.parked.discard(
            lambda key: key.attempt != call.job and not self._is_active(key.attempt),
            "obsolete",
            out,
        )
        self._intake.adopt(d, out)

    def _restored(
        self, record: CommitRecord, out: list[cmd.ReceiverCommand], *, job: int | None = None
    ) -> None:
        """The storage holds ``record`` exactly (a dense refit finished: job ``job``)."""
        if self._intake.dense is not None:
            out.append(cmd.Release(attempt=self._intake.dense.attempt))
            self._intake.ended.append(self._intake.dense.attempt)
            self._intake.dense = None
        self._m.fire(_X.DENSE_REFIT)
        self._storage.restored(record)
        self._intake.ingest = None
        self._gate_open = False
        ready = msg.ReceiverReady(receiver=self.name, record=record, job=job)
        out.append(cmd.Notify(message=ready))

    # -- guards and helpers ----------------------------------------------------------------

    def _drained(self) -> str | None:
        s = self._intake.ingest
        if s is None or not s.complete():
            return "payloads are still missing or queued"
        return None

    def _early(self, tau: int) -> bool:
        """Whether a delivery of ``tau``, which no ingestion takes, may belong to a dense job
        (or attempt) that has not started here yet, rather than to one that ended.

        Only a dense job's payloads can overtake its call (an attempt's owners stream after
        every receiver accepted its prepare), and a dense job starts only while no attempt
        runs, so while one runs a delivery of another attempt is dropped at once.
        """
        if tau <= self._latest or tau in self._intake.ended or self.phase in RUNNING:
            return False
        d, s = self._intake.dense, self._intake.ingest
        return (d is None or tau > d.attempt) and (s is None or tau > s.attempt)

    def _see_epoch(self, epoch: int) -> None:
        self._epoch = max(self._epoch, epoch)

    def _is_active(self, tau: int) -> bool:
        return self._intake.ingest is not None and self._intake.ingest.info.attempt == tau

    def _current(self, tau: int, epoch: int) -> bool:
        """A call for the active attempt from a coordinator that was not replaced."""
        if epoch < self._epoch or not self._is_active(tau):
            return False
        self._see_epoch(epoch)
        return True
