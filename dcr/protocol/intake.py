"""A receiver's payload path: from a delivery the transport hands over to applied storage writes.

The engine reports each payload the transport hands over
(:class:`~dcr.protocol.events.PayloadReceived`); the :class:`Intake` either asks for its
reception checks (:class:`~dcr.protocol.commands.CheckPayload`, which also sends the
transport's queueing ACK) or keeps it parked, unread and unacknowledged, while its bounded
queue back-pressures ingestion -- except the one payload the declared order needs next
(:mod:`dcr.protocol.parking`).  Checked payloads come back as ``PayloadArrived``; the intake
then deduplicates, stages, decodes, applies in declared order or discards them, and runs the
arrival check of flush with a deadline of its own (paper App. B.1).  A payload or peer that
breaks the protocol fails the attempt, or the dense-refit job, that it belongs to.

It serves the current attempt and the dense-refit job in progress, each an
:class:`~dcr.protocol.ingest.Ingest`; the receiver core (:mod:`dcr.protocol.receiver`) starts
and ends them and decides when the receiver acknowledges, stops or reopens its gate.
"""

from __future__ import annotations

from collections import deque

from dcr.protocol import commands as cmd
from dcr.protocol import events as ev
from dcr.protocol import messages as msg
from dcr.protocol.ingest import Ingest, QueueConfig, missing_message
from dcr.protocol.lifecycle import ReceiverPhase, Trigger
from dcr.protocol.machine import StateMachine
from dcr.protocol.parking import Parking
from dcr.protocol.storage import Storage
from dcr.protocol.types import PayloadKey, Stage

__all__ = ["RUNNING", "Intake"]

_R = ReceiverPhase
_X = Trigger
RUNNING = frozenset({_R.PREPARED, _R.GATED, _R.APPLYING, _R.FLUSHING})
"""Receiver phases in which the current attempt runs (its payloads are taken)."""


class Intake:
    """The payload path of receiver ``name``, whose lifecycle is ``machine`` and whose storage
    ``storage`` its writes change."""

    def __init__(
        self,
        name: str,
        *,
        machine: StateMachine[ReceiverPhase],
        storage: Storage,
        queue: QueueConfig,
        arrival_grace_s: float,
        window: int | None,
    ) -> None:
        self.name = name
        self.queue = queue
        self.arrival_grace_s = arrival_grace_s
        self.parked = Parking(window)
        self.ingest: Ingest | None = None
        """The current attempt's ingestion."""
        self.dense: Ingest | None = None
        """The dense-refit job in progress (its ``info.base`` is the record it restores)."""
        self.ended: deque[int] = deque(maxlen=64)
        """The latest dense-refit jobs that ended here: their late payloads are stale."""
        self._m = machine
        self._storage = storage

    # -- ingestion (back-pressure, reception checks, deduplication; App. B.1) --------------

    def stream_of(self, attempt: int) -> Ingest | None:
        """The ingestion a payload of ``attempt`` belongs to: the dense job or the attempt."""
        if self.dense is not None and self.dense.attempt == attempt:
            return self.dense
        s = self.ingest
        if s is not None and s.attempt == attempt and self._m.phase in RUNNING and not s.failed:
            return s
        return None

    def on_received(
        self,
        delivery: int,
        key: PayloadKey,
        out: list[cmd.ReceiverCommand],
        *,
        early: bool = False,
    ) -> None:
        """A delivery the transport handed over; ``early``: its attempt (or dense job) may
        not have started yet, so it is held until it does rather than discarded."""
        s = self.stream_of(key.attempt)
        if s is None:
            if early:
                self.parked.hold_early(delivery, key, out)
            else:
                out.append(cmd.Discard(delivery=delivery, reason="not the active attempt"))
            return
        s.received.add(key)
        before = PayloadKey(attempt=key.attempt, owner=key.owner, payload_id=key.payload_id - 1)
        if s.dense and key.payload_id > 0 and before not in s.received:
            # An owner sends its dense payloads one at a time, each once the last was handed
            # over, and transports keep each owner's order: the earlier one was lost (a relay
            # node that died with it).  Waiting for it would hold the later ones unread.
            message = (
                f"dense payload {key.owner}/{before.payload_id} never arrived, yet "
                f"{key.owner}/{key.payload_id} did: it was lost on the way"
            )
            self.fail(s, "missing", message, out)
            out.append(cmd.Discard(delivery=delivery, reason="missing"))
            return
        if s.paused and key != s.want:
            self.parked.park(delivery, key, out)
            return
        s.checking.add(delivery)
        out.append(cmd.CheckPayload(delivery=delivery))
        self.pump(s, out)

    def adopt(self, s: Ingest, out: list[cmd.ReceiverCommand]) -> None:
        """``s`` has just started: its early deliveries go through as if they had just
        arrived (the dense job's payloads may overtake its call)."""
        taken = self.parked.adopt(s.attempt)
        if not taken:
            return
        s.received.update(key for _, key in taken)
        if not s.info.sync:
            for delivery, _ in taken:
                self.parked.take(delivery)
                s.checking.add(delivery)
                out.append(cmd.CheckPayload(delivery=delivery))
        self.pump(s, out)  # a synchronous one lets them through as its queue has room

    def on_arrived(self, e: ev.PayloadArrived, out: list[cmd.ReceiverCommand]) -> None:
        key = e.key
        s = self.stream_of(key.attempt)
        if s is None or e.delivery not in s.checking:
            out.append(cmd.Discard(delivery=e.delivery, reason="not the active attempt"))
            return
        s.checking.discard(e.delivery)
        if key.owner not in s.info.owners:
            self.fail(s, "schema", f"payload from unknown owner {key.owner!r}", out)
            out.append(cmd.Discard(delivery=e.delivery, reason="schema"))
            return
        if e.rejection is not None:
            message = f"payload {key.owner}/{key.payload_id} failed {e.rejection}"
            if e.detail:
                message += f": {e.detail}"
            self.fail(s, e.rejection, message, out)
            out.append(cmd.Discard(delivery=e.delivery, reason=e.rejection))
            return
        previous = s.seen.get((key.owner, key.payload_id))
        if previous is not None:
            if previous != e.digest:
                message = f"payload {key.owner}/{key.payload_id} arrived twice with other bytes"
                self.fail(s, "conflicting-duplicate", message, out)
            out.append(cmd.Discard(delivery=e.delivery, reason="duplicate"))
            self.pump(s, out)
            return
        problem = s.order_problem(key, e.final)
        if problem is not None:
            self.fail(s, "declared-order", problem, out)
            out.append(cmd.Discard(delivery=e.delivery, reason="declared-order"))
            return
        s.record(key, e.digest, e.final)
        if not s.dense:
            self._m.fire(_X.INGEST)
        keep = s.keeps(self.queue.capacity)
        s.stage(key, kept=keep)
        out.append(cmd.StagePayload(key=key, delivery=e.delivery, keep_decoded=keep))
        self.pump(s, out)

    # -- the bounded queue and declared-order application ----------------------------------

    def pump(self, s: Ingest, out: list[cmd.ReceiverCommand]) -> None:
        """Decode into free queue slots, apply the next group, report arrival and drain."""
        if s.failed or (not s.dense and (s is not self.ingest or self._m.phase not in RUNNING)):
            return
        tau = s.attempt
        nxt = s.next_key()
        s.fill(self.queue.capacity, nxt, out)
        if s.apply_open and not s.applying:
            group = s.next_group(self.queue.group_size)
            if group:
                s.applying = group
                self._storage.dirty = True
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
        finishing = s.dense or self._m.phase is _R.FLUSHING
        if finishing and not s.synchronizing and s.complete():
            s.synchronizing = True
            out.append(cmd.Synchronize(attempt=tau))

    def _backpressure(
        self, s: Ingest, nxt: PayloadKey | None, out: list[cmd.ReceiverCommand]
    ) -> None:
        """Pause ingestion while the queue is full, letting only the next payload through."""
        s.pause_if_full(self.queue.capacity, nxt)
        if self.parked:
            self.parked.release(s, self.queue.capacity, out)

    def on_decoded(
        self, key: PayloadKey, failure: str | None, out: list[cmd.ReceiverCommand]
    ) -> None:
        s = self.stream_of(key.attempt)
        if s is None or key not in s.decoding:
            return
        s.decoding.discard(key)
        if failure is not None:
            self.fail(s, failure, f"payload {key.owner}/{key.payload_id} failed to decode", out)
            return
        s.decoded.add(key)
        self.pump(s, out)

    def on_applied(self, e: ev.PayloadsApplied, out: list[cmd.ReceiverCommand]) -> None:
        s = self.dense if self.dense and self.dense.attempt == e.attempt else self.ingest
        if s is None or not s.applying or e.keys != s.applying or e.attempt != s.attempt:
            return
        s.applying = ()
        if e.failure is not None:
            self.fail(s, e.failure, f"applying {len(e.keys)} payloads failed: {e.failure}", out)
        else:
            s.applied_group(e.keys, e.post_apply_checked)
            self.pump(s, out)
        self.reply_stopped_if_drained(out)

    # -- the arrival check (App. B.1) ------------------------------------------------------

    def declare(self, s: Ingest, expected: dict[str, int], out: list[cmd.ReceiverCommand]) -> bool:
        """Take the owners' declared sent lists; arm the arrival deadline for missing ones.

        Returns False (after failing the attempt) when what arrived contradicts them.
        """
        problem = s.declare(expected)
        if problem is not None:
            self.fail(s, "arrival", problem, out)
            return False
        missing = s.missing()
        if missing and not s.arrival_armed:
            if self.arrival_grace_s <= 0:
                self.fail(s, "missing", missing_message(missing), out)
                return False
            s.arrival_armed = True
            out.append(
                cmd.ArmDeadline(
                    attempt=s.attempt, stage=Stage.ARRIVAL, seconds=self.arrival_grace_s
                )
            )
        return True

    def is_dense(self, tau: int) -> bool:
        return self.dense is not None and self.dense.attempt == tau and not self.dense.failed

    def on_arrival_deadline(self, tau: int, out: list[cmd.ReceiverCommand]) -> None:
        s = self.dense if self.is_dense(tau) else self.ingest
        if s is None or s.attempt != tau or s.failed:
            return
        if not s.dense and self._m.phase not in RUNNING:
            return
        missing = s.missing()
        if missing:
            self.fail(s, "missing", missing_message(missing), out)

    # -- failure and the stop path (App. B.2) ----------------------------------------------

    def fail(self, s: Ingest, check: str, message: str, out: list[cmd.ReceiverCommand]) -> None:
        """A peer or payload broke the protocol: the attempt (or dense job) fails; nothing
        more of it is applied."""
        if s.failed:
            return
        s.failed = True
        if not s.dense and self._m.phase not in RUNNING:
            return  # the attempt is already being stopped: nothing more of it is applied
        if s.dense:
            # The coordinator retries the dense refit with a fresh job.
            self.drop_dense(out)
        else:
            self._m.fire(_X.FAIL)
        out.append(
            cmd.Notify(
                message=msg.AttemptFailed(
                    attempt=s.attempt, endpoint=self.name, check=check, message=message
                )
            )
        )

    def reply_stopped_if_drained(self, out: list[cmd.ReceiverCommand]) -> None:
        """A stop waits until no write of the attempt can land: reply once its group applied."""
        s = self.ingest
        if s is not None and s.stop_pending and not s.applying:
            s.stop_pending = False
            out.append(
                cmd.Notify(
                    message=msg.Stopped(
                        attempt=s.attempt, endpoint=self.name, dirty=self._storage.dirty
                    )
                )
            )

    def drop_dense(self, out: list[cmd.ReceiverCommand]) -> None:
        """Give up the dense-refit job in progress: its deliveries are released."""
        d = self.dense
        if d is None:
            return
        self.dense = None
        self.ended.append(d.attempt)
        self.parked.discard(lambda key: key.attempt == d.attempt, "released", out)
        out.append(cmd.Release(attempt=d.attempt))
