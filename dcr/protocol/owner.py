"""The owner core: per attempt, build and stream buckets; after commit, update the baseline.

An owner keeps its candidate shards and its committed baseline ``B^v`` until it reads a commit
record naming ``(v+1, g)`` for a candidate it holds; then it updates trackers and residual
baseline in place (paper §6.3, App. B.2).  The update writes absolute values derived from the
fixed candidate, so repeating it after a coordinator failover is safe.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dcr.errors import ConfigError, RemoteProtocolError
from dcr.protocol import commands as cmd
from dcr.protocol import events as ev
from dcr.protocol import messages as msg
from dcr.protocol.lifecycle import OwnerPhase, Trigger
from dcr.protocol.machine import StateMachine
from dcr.protocol.proof import Proof
from dcr.protocol.types import AttemptInfo, CommitRecord

__all__ = ["OwnerCore"]

_O = OwnerPhase
_X = Trigger
_STREAMING = frozenset({_O.PREPARED, _O.SENDING, _O.SENT})


@dataclass(slots=True)
class _Stream:
    """One attempt's pipeline: bucket ``l+1`` is built while payload ``l`` is sent (§7.2)."""

    info: AttemptInfo
    proof: Proof | None = None
    """This owner's proof of the base version, sent with its acceptance."""
    building: int | None = None
    built: list[int] = field(default_factory=list)
    sending: set[int] = field(default_factory=set)
    sent: set[int] = field(default_factory=set)
    final: int | None = None
    next_id: int = 0
    done: bool = False
    stopping: bool = False

    @property
    def busy(self) -> bool:
        return self.building is not None or bool(self.sending)


class OwnerCore:
    """One owner; :meth:`handle` takes an event and returns commands.

    ``staged``: whether the trainer has staged a candidate on the baseline.  A prepare that
    arrives while none is staged is held until :class:`~dcr.protocol.events.CandidateStaged`;
    a baseline update consumes the candidate (the next version must be staged again).
    """

    def __init__(
        self,
        name: str,
        *,
        baseline: CommitRecord,
        sends_in_flight: int = 1,
        staged: bool = True,
    ) -> None:
        if sends_in_flight < 1:
            raise ConfigError(f"sends_in_flight must be at least 1, got {sends_in_flight}")
        self.name = name
        self._baseline = baseline
        self._sends_in_flight = sends_in_flight
        self._candidates: set[str] = set()
        self._updated_to: CommitRecord | None = None
        self._stream: _Stream | None = None
        self._stop_pending: int | None = None
        self._epoch = 0
        """Highest coordinator epoch seen; prepares of replaced coordinators are refused."""
        self._latest = 0
        """Highest attempt id seen; a prepare that arrives after its attempt was stopped is
        refused (attempt ids increase, see :class:`~dcr.protocol.types.IdSource`)."""
        self.baseline_failure: str | None = None
        """Why the last baseline update failed (the operator must reinitialize the owner)."""
        self._dense: set[int] = set()
        """Dense-refit jobs whose payloads are being built from the baseline."""
        self._updating: CommitRecord | None = None
        """A baseline update asked for but not written yet (it waits for dense jobs)."""
        self._staged = staged
        """The trainer staged a candidate that no baseline update consumed yet."""
        self._held: msg.Prepare | ev.PrepareChecked | None = None
        """The latest prepare that arrived while no candidate was staged."""
        self._m = StateMachine(OwnerPhase, name=f"owner {name}")

    @property
    def phase(self) -> OwnerPhase:
        return self._m.phase

    @property
    def baseline(self) -> CommitRecord:
        """The committed record that trackers and residual baseline hold."""
        return self._baseline

    @property
    def staged(self) -> bool:
        """A candidate is staged and its baseline update has not happened yet."""
        return self._staged

    @property
    def holding(self) -> bool:
        """A prepare waits for the trainer to stage its candidate."""
        return self._held is not None

    @property
    def attempt(self) -> AttemptInfo | None:
        return self._stream.info if self._stream else None

    @property
    def sent(self) -> frozenset[int]:
        return frozenset(self._stream.sent) if self._stream else frozenset()

    def handle(self, event: ev.OwnerEvent) -> list[cmd.OwnerCommand]:
        """Apply one event; return the commands to execute, in order."""
        out: list[cmd.OwnerCommand] = []
        match event:
            case msg.Prepare(info=info) | ev.PrepareChecked(info=info) if (
                not self._staged and not self._is_active(info.attempt)
            ):
                self._held = event  # handled once the candidate is staged (the latest wins)
            case ev.CandidateStaged(staged=staged):
                self._staged = staged
                held, self._held = self._held, None
                if staged and held is not None:
                    out.extend(self.handle(held))
                else:
                    self._held = held
            case msg.Prepare(info=info) | ev.PrepareChecked(info=info):
                rejection = event.rejection if isinstance(event, ev.PrepareChecked) else None
                proof = event.proof if isinstance(event, ev.PrepareChecked) else None
                self._on_prepare(info, rejection, proof, out)
            case msg.StartStreaming(attempt=tau):
                if self._is_active(tau) and self.phase is _O.PREPARED:
                    self._m.fire(_X.SEND)
                    self._pump(out)
            case ev.BucketBuilt():
                self._on_built(event, out)
            case ev.PayloadSent():
                self._on_sent(event, out)
            case msg.Flush(attempt=tau):
                s = self._stream
                if self._is_active(tau) and self.phase is _O.SENDING and s is not None and s.done:
                    self._m.fire(_X.FLUSH)
            case msg.MarkObsolete(attempt=tau, epoch=epoch):
                self._see(tau, epoch)
                if self._is_active(tau):
                    self._mark_obsolete(out)
            case msg.StopAndWait(attempt=tau, epoch=epoch):
                self._see(tau, epoch)
                self._on_stop(tau, out)
            case msg.Cleanup(attempt=tau):
                if self._is_active(tau) and self._m.can_fire(_X.CLEANUP):
                    self._m.fire(_X.CLEANUP)
                    self._stream = None
                    out.append(cmd.Release(attempt=tau))
            case msg.ReadRecord():
                out.append(cmd.FetchRecord())
            case ev.CommitRecordRead(record=record):
                self._on_record(record, out)
            case ev.BaselineWritten(record=record, failure=failure):
                self._on_baseline_written(record, failure, out)
            case msg.DenseRefit():
                self._on_dense_refit(event, out)
            case ev.DenseSent(job=job, payloads=payloads, failure=failure):
                self._on_dense_sent(job, payloads, failure, out)
            case _:
                pass  # calls meant for receivers
        return out

    # -- admission and streaming -----------------------------------------------------------

    def _on_prepare(
        self,
        info: AttemptInfo,
        rejection: str | None,
        proof: Proof | None,
        out: list[cmd.OwnerCommand],
    ) -> None:
        if self._is_active(info.attempt):
            # A repeated call (the engine retries control calls): answer it again.
            if self.phase in _STREAMING:
                assert self._stream is not None
                out.append(
                    cmd.Notify(
                        message=msg.PrepareAccepted(
                            attempt=info.attempt, endpoint=self.name, proof=self._stream.proof
                        )
                    )
                )
            return
        if self.phase is _O.UPDATED or (self.phase is _O.STOPPED and self._stop_pending is None):
            # A stopped attempt has nothing in flight; a lost cleanup must not block the retry.
            if self._stream is not None:
                out.append(cmd.Release(attempt=self._stream.info.attempt))
                self._stream = None
            self._m.fire(_X.CLEANUP)
        if rejection is not None:
            # The engine's metadata check failed: reject.
            out.append(
                cmd.Notify(
                    message=msg.PrepareRejected(
                        attempt=info.attempt, endpoint=self.name, check=rejection
                    )
                )
            )
            return
        problem = None
        if info.coordinator < self._epoch:
            problem = "epoch"  # a replaced coordinator's late prepare
        elif info.attempt <= self._latest:
            problem = "stale"  # the attempt was stopped before its prepare arrived
        elif info.base != self._baseline:
            problem = "version"
        elif self.phase is not _O.IDLE:
            problem = "busy"
        if problem is not None:
            # Not a failed check but a state that cannot take the attempt: a failure.
            out.append(
                cmd.Notify(
                    message=msg.AttemptFailed(
                        attempt=info.attempt,
                        endpoint=self.name,
                        check=problem,
                        message=f"owner {self.name} is {self.phase.value} at {self._baseline}",
                    )
                )
            )
            return
        self._see(info.attempt, info.coordinator)
        self._m.fire(_X.PREPARE)
        self._stream = _Stream(info=info, proof=proof)
        self._candidates.add(info.candidate)
        out.append(
            cmd.Notify(
                message=msg.PrepareAccepted(attempt=info.attempt, endpoint=self.name, proof=proof)
            )
        )
        # Construction starts now, while the coordinator collects the other acceptances and
        # judges the proofs; nothing is sent before StartStreaming.
        self._pump(out)

    def _pump(self, out: list[cmd.OwnerCommand]) -> None:
        """Send built payloads (once streaming) and build the next bucket while the pipeline
        has room (from the acceptance of the prepare on: admission overlaps construction)."""
        s = self._stream
        assert s is not None
        if self.phase not in (_O.PREPARED, _O.SENDING) or s.stopping:
            return
        tau = s.info.attempt
        while self.phase is _O.SENDING and s.built and len(s.sending) < self._sends_in_flight:
            pid = s.built.pop(0)
            s.sending.add(pid)
            out.append(cmd.SendPayload(attempt=tau, payload_id=pid, final=pid == s.final))
        if (
            s.building is None
            and s.final is None
            and len(s.built) + len(s.sending) <= self._sends_in_flight
        ):
            s.building = s.next_id
            s.next_id += 1
            out.append(cmd.BuildBucket(attempt=tau, payload_id=s.building, mode=s.info.mode))

    def _on_built(self, event: ev.BucketBuilt, out: list[cmd.OwnerCommand]) -> None:
        s = self._stream
        if s is None or s.info.attempt != event.attempt or s.building != event.payload_id:
            return
        s.building = None
        if event.failure is not None:
            self._report_failure("encode", event.failure, out)
        elif self.phase in (_O.PREPARED, _O.SENDING) and not s.stopping:
            if self.phase is _O.SENDING:
                self._m.fire(_X.SEND)
            s.built.append(event.payload_id)
            if event.final:
                s.final = event.payload_id
            self._pump(out)
        self._reply_stopped_if_idle(out)

    def _on_sent(self, event: ev.PayloadSent, out: list[cmd.OwnerCommand]) -> None:
        s = self._stream
        if s is None or s.info.attempt != event.attempt or event.payload_id not in s.sending:
            return
        s.sending.discard(event.payload_id)
        if event.failure is not None:
            self._report_failure("transport", event.failure, out)
        elif not s.stopping:
            s.sent.add(event.payload_id)
            if s.final is not None and len(s.sent) == s.final + 1 and not s.done:
                s.done = True
                out.append(
                    cmd.Notify(
                        message=msg.SendsDone(
                            attempt=s.info.attempt, owner=self.name, payload_count=s.final + 1
                        )
                    )
                )
            self._pump(out)
        self._reply_stopped_if_idle(out)

    def _report_failure(self, check: str, message: str, out: list[cmd.OwnerCommand]) -> None:
        s = self._stream
        assert s is not None
        if s.stopping:
            return
        s.stopping = True
        out.append(cmd.StopStreaming(attempt=s.info.attempt))
        out.append(
            cmd.Notify(
                message=msg.AttemptFailed(
                    attempt=s.info.attempt, endpoint=self.name, check=check, message=message
                )
            )
        )

    # -- stop path -------------------------------------------------------------------------

    def _mark_obsolete(self, out: list[cmd.OwnerCommand]) -> None:
        s = self._stream
        if s is None or self.phase not in _STREAMING:
            return
        self._m.fire(_X.MARK_OBSOLETE)
        if not s.stopping:
            s.stopping = True
            out.append(cmd.StopStreaming(attempt=s.info.attempt))

    def _on_stop(self, tau: int, out: list[cmd.OwnerCommand]) -> None:
        """stop_and_wait: acknowledge once no build or send of the attempt is in flight.

        A stop for an attempt this owner does not run (replaced, already stopped) returns at
        once (paper App. B, failure model).
        """
        if self._is_active(tau):
            self._mark_obsolete(out)
            if self.phase is _O.OBSOLETE:
                self._m.fire(_X.STOP_AND_WAIT)
            s = self._stream
            if s is not None and s.busy:
                self._stop_pending = tau
                return
        out.append(cmd.Notify(message=msg.Stopped(attempt=tau, endpoint=self.name)))

    def _reply_stopped_if_idle(self, out: list[cmd.OwnerCommand]) -> None:
        s = self._stream
        if self._stop_pending is not None and (s is None or not s.busy):
            out.append(
                cmd.Notify(message=msg.Stopped(attempt=self._stop_pending, endpoint=self.name))
            )
            self._stop_pending = None

    # -- baseline update (paper §6.3, App. B.2) --------------------------------------------

    def _on_record(self, record: CommitRecord, out: list[cmd.OwnerCommand]) -> None:
        repeat = record == self._updated_to
        if record == self._baseline and not repeat:
            # The baseline already holds the committed record (this process started after
            # the commit, at the committed version): report it, nothing to write.
            out.append(cmd.Notify(message=msg.BaselineUpdated(owner=self.name, record=record)))
            return
        if not repeat and (
            record.version != self._baseline.version + 1 or record.candidate not in self._candidates
        ):
            raise RemoteProtocolError(
                f"owner {self.name} holds no candidate for commit record {record} "
                f"(baseline {self._baseline}); its baseline must be reinitialized",
                check="baseline",
            )
        # A record naming (v+1, g) makes any attempt this owner still runs obsolete.
        self._mark_obsolete(out)
        self._m.fire(_X.BASELINE_UPDATE)
        self.baseline_failure = None
        self._updating = record
        if not self._dense:
            out.append(cmd.UpdateBaseline(record=record))

    def _on_baseline_written(
        self, record: CommitRecord, failure: str | None, out: list[cmd.OwnerCommand]
    ) -> None:
        self._updating = None
        if failure is not None:
            self.baseline_failure = failure
            return
        self._baseline = record
        self._updated_to = record
        self._candidates.clear()
        self._staged = False  # the candidate became the baseline
        out.append(cmd.Notify(message=msg.BaselineUpdated(owner=self.name, record=record)))

    # -- dense refit of joining receivers (paper App. B.2) --------------------------------

    def _on_dense_refit(self, call: msg.DenseRefit, out: list[cmd.OwnerCommand]) -> None:
        """Send every owned element at the committed baseline to the joining receivers.

        Refused while the baseline is being updated: the payloads would mix two versions.
        """
        if self.name not in call.owners or call.job in self._dense:
            return
        problem = None
        if call.record != self._baseline:
            problem = f"owner {self.name} holds {self._baseline}, not {call.record}"
        elif self._updating is not None:
            problem = f"owner {self.name} is updating its baseline to {self._updating}"
        if problem is not None:
            out.append(
                cmd.Notify(
                    message=msg.AttemptFailed(
                        attempt=call.job, endpoint=self.name, check="version", message=problem
                    )
                )
            )
            return
        self._dense.add(call.job)
        out.append(cmd.SendDense(job=call.job, record=call.record, to=call.receivers))

    def _on_dense_sent(
        self, job: int, payloads: int, failure: str | None, out: list[cmd.OwnerCommand]
    ) -> None:
        """Report the job's sent list (the receiver's arrival check) or its failure."""
        if job not in self._dense:
            return
        self._dense.discard(job)
        message: msg.Reply
        if failure is not None:
            message = msg.AttemptFailed(
                attempt=job, endpoint=self.name, check="dense", message=failure
            )
        else:
            message = msg.SendsDone(attempt=job, owner=self.name, payload_count=payloads)
        out.append(cmd.Notify(message=message))
        if not self._dense and self._updating is not None:
            out.append(cmd.UpdateBaseline(record=self._updating))

    def _is_active(self, tau: int) -> bool:
        return self._stream is not None and self._stream.info.attempt == tau

    def _see(self, tau: int, epoch: int) -> None:
        self._latest = max(self._latest, tau)
        self._epoch = max(self._epoch, epoch)
