"""An in-memory world that runs the real protocol cores with explicit messages in flight.

The world plays every part the engine and the adapters will play: it executes the cores'
commands, turns them into messages (payloads, control calls, replies, control-plane requests,
completions of local work), and delivers them only when asked -- in any order, twice, or not
at all.  Receiver storage is abstract: each range (one payload's destinations) records which
version's bits it holds (see :mod:`dcr.testing.spec.state`), so after every step the world can
be projected into a specification :class:`~dcr.testing.spec.state.State` and checked against
the same invariants as the model.

Assumptions the world shares with the engine contract (``docs/protocol.md``): control-plane
requests and replies are not lost (except a commit reply, which becomes ``UNKNOWN``), local
work (decode, apply, send) always completes, and cleanup, gate reopening and baseline calls
are retried until they arrive.  Everything else may be lost, duplicated or reordered.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dcr.protocol import commands as cmd
from dcr.protocol import events as ev
from dcr.protocol import messages as msg
from dcr.protocol.coordinator import CoordinatorConfig, CoordinatorCore
from dcr.protocol.lifecycle import ReceiverPhase
from dcr.protocol.owner import OwnerCore
from dcr.protocol.receiver import QueueConfig, ReceiverCore
from dcr.protocol.types import (
    AttemptInfo,
    CommitOutcome,
    CommitRecord,
    CounterIds,
    Mode,
    PayloadKey,
    Stage,
    Timeouts,
    TransitionOutcome,
)
from dcr.testing.spec.state import (
    EMPTY,
    LOST,
    NONE,
    V0,
    V1,
    Cas,
    Encoding,
    Reply,
    State,
    apply_entry,
)
from dcr.testing.world_control_plane import serve
from dcr.testing.world_messages import ApplyDone, Body, Kind, Message, Wire
from dcr.testing.world_projection import project

__all__ = ["World"]


@dataclass(slots=True)
class _Receiver:
    core: ReceiverCore
    inc: int = 0
    storage: dict[tuple[str, int], int] = field(default_factory=dict)
    gate_open: bool = True
    kv: int = V0
    bodies: dict[PayloadKey, Body] = field(default_factory=dict)
    deliveries: dict[int, tuple[Wire, Body | None]] = field(default_factory=dict)
    """Payloads handed to the engine and not yet checked (parked ones included)."""
    count: int = 0


@dataclass(slots=True)
class _Owner:
    core: OwnerCore
    baseline: int = V0
    alive: bool = True


class World:
    """Owners, receivers, coordinators, a control plane and the messages between them."""

    def __init__(
        self,
        *,
        owners: Iterable[str] = ("o0", "o1"),
        receivers: Iterable[str] = ("r0", "r1", "r2"),
        payloads: int | dict[str, int] = 2,
        sync: bool = True,
        queue: QueueConfig | None = None,
        xor_refused: Mapping[str, frozenset[str]] | None = None,
    ) -> None:
        self.owner_names = tuple(owners)
        self.receiver_names = tuple(receivers)
        self.sync = sync
        self.xor_refused = xor_refused
        """The receivers' reported loader classifications every coordinator is given."""
        self.base = CommitRecord(version=0, candidate="g0")
        counts = (
            payloads if isinstance(payloads, dict) else dict.fromkeys(self.owner_names, payloads)
        )
        self.payload_counts = {o: counts[o] for o in self.owner_names}
        self.ranges = tuple(
            (o, pid) for o in self.owner_names for pid in range(self.payload_counts[o])
        )
        self.queue = queue or QueueConfig(groups=1, group_size=1)
        self.messages: list[Message] = []
        self.timers: list[tuple[int, int, Stage]] = []
        """Coordinators' deadlines: ``(epoch, attempt, stage)``."""
        self.arrival_timers: list[tuple[str, int, int]] = []
        """Receivers' arrival-check deadlines: ``(receiver, incarnation, attempt)``."""
        self._seq = 0
        # control plane
        self.record = self.base
        self.epoch = 1
        self.registered: AttemptInfo | None = None
        self.obsolete: set[int] = set()
        self.expired: set[int] = set()
        self.commit_epoch = NONE
        # history for the projection
        self.infos: dict[int, AttemptInfo] = {}
        self.required: dict[int, frozenset[tuple[int, int]]] = {}
        self.acks: dict[int, set[tuple[int, int]]] = {}
        self.cas: dict[int, Cas] = {}
        self.replies: dict[int, Reply] = {}
        self.outcomes: dict[int, cmd.TransitionEnded] = {}
        self.refit_requested: set[str] = set()
        self.abort_reason: str | None = None
        self.log: list[tuple[str, object]] = []
        """Every command executed, with the process that issued it."""
        self.problems: list[str] = []
        """World-level violations (e.g. a read_commit that a commit could still change)."""
        self.steps = 0
        # processes
        self.coordinators: dict[int, CoordinatorCore] = {}
        self.alive_coordinators: set[int] = set()
        # Every trainer rank staged the candidate of the transition (``CandidateStaged``).
        self.owners = {
            o: _Owner(core=OwnerCore(o, baseline=self.base, staged=True)) for o in self.owner_names
        }
        self.receivers = {
            r: _Receiver(
                core=ReceiverCore(r, held=self.base, queue=self.queue, arrival_grace_s=1.0),
                storage=dict.fromkeys(self.ranges, V0),
            )
            for r in self.receiver_names
        }
        self._built: dict[PayloadKey, Body] = {}

    # -- starting and replacing coordinators ---------------------------------------------

    def start(self) -> None:
        """Coordinator 1 starts the transition."""
        self._new_coordinator(1)
        self._handle_coordinator(1, ev.StartTransition())

    def take_over(self, *, kill_old: bool) -> int:
        """A new coordinator replaces the active one (which may keep running)."""
        old = self.epoch
        if kill_old:
            self.alive_coordinators.discard(old)
        self.epoch = old + 1
        self._new_coordinator(self.epoch)
        self._handle_coordinator(self.epoch, ev.TakeOver(old=self.registered))
        if self.abort_reason is not None:
            self._handle_coordinator(self.epoch, ev.OperatorAbort(reason=self.abort_reason))
        return self.epoch

    def _new_coordinator(self, epoch: int) -> None:
        self.coordinators[epoch] = CoordinatorCore(
            CoordinatorConfig(
                base=self.base,
                owners=self.owner_names,
                receivers=self.receiver_names,
                epoch=epoch,
                sync=self.sync,
                timeouts=Timeouts(),
                xor_refused=self.xor_refused,
            ),
            CounterIds(first=100 * epoch, prefix=f"g{epoch}."),
        )
        self.alive_coordinators.add(epoch)

    # -- environment actions -------------------------------------------------------------

    def deliver(self, index: int) -> Message:
        """Deliver the message at ``index`` (any order: reordering is the default)."""
        m = self.messages.pop(index)
        self._deliver(m)
        return m

    def duplicate(self, index: int) -> Message:
        """Deliver a copy of a payload or control call; the original stays in flight."""
        m = self.messages[index]
        self._deliver(m)
        return m

    def reject_prepare(self, index: int, check: str) -> Message:
        """Deliver a prepare call whose metadata/loader check fails at the endpoint."""
        m = self.messages.pop(index)
        assert isinstance(m.event, msg.Prepare)
        self._deliver(
            Message(seq=m.seq, kind=m.kind, to=m.to, inc=m.inc,
                    event=ev.PrepareChecked(info=m.event.info, rejection=check))
        )  # fmt: skip
        return m

    def drop(self, index: int) -> Message:
        return self.messages.pop(index)

    def corrupt(self, index: int, *, conflicting: bool) -> Message:
        """Deliver a damaged copy of a payload: a bad digest, or same id with other bytes."""
        m = self.messages[index]
        assert m.kind is Kind.PAYLOAD and isinstance(m.event, Wire)
        e = m.event
        bad = (
            Wire(key=e.key, digest=e.digest + b"!", final=e.final)
            if conflicting
            else Wire(key=e.key, digest=e.digest, final=e.final, rejection="digest")
        )
        # A conflicting copy holds the same entries in other bytes (re-encoded, say).
        self._deliver(Message(seq=m.seq, kind=m.kind, to=m.to, event=bad, inc=m.inc, body=m.body))
        return m

    def expire(self, index: int) -> tuple[int, int, Stage]:
        """A timer fires; an expired commit deadline also closes the control plane to it."""
        epoch, tau, stage = self.timers.pop(index)
        if stage is Stage.COMMIT:
            self.expired.add(tau)
        if epoch in self.alive_coordinators:
            self._handle_coordinator(epoch, ev.DeadlineExpired(attempt=tau, stage=stage))
        return epoch, tau, stage

    def expire_arrival(self, index: int) -> None:
        """A receiver's arrival-check deadline fires (missing payloads fail the attempt)."""
        name, inc, tau = self.arrival_timers.pop(index)
        rx = self.receivers[name]
        if inc == rx.inc:
            self._run_receiver(
                name, rx.core.handle(ev.DeadlineExpired(attempt=tau, stage=Stage.ARRIVAL))
            )

    def lose_commit_reply(self, index: int) -> None:
        """The control plane's reply to a compare-and-set is lost: the outcome is unknown."""
        m = self.messages.pop(index)
        assert isinstance(m.event, ev.CommitReplied)
        self.replies[m.event.attempt] = Reply.LOST
        self._post(
            Kind.STORE_REPLY,
            m.to,
            ev.CommitReplied(attempt=m.event.attempt, outcome=CommitOutcome.UNKNOWN),
        )

    def crash_receiver(self, name: str) -> None:
        """The process dies; a fresh one starts JOINING.  The supervisor retires the old one."""
        rx = self.receivers[name]
        rx.inc += 1
        rx.core = ReceiverCore(name, held=None, queue=self.queue, arrival_grace_s=1.0)
        rx.storage = dict.fromkeys(self.ranges, LOST)
        rx.gate_open = False
        rx.kv = EMPTY
        rx.bodies.clear()
        rx.deliveries.clear()
        r = self.receiver_names.index(name)
        for tau, required in self.required.items():
            if any(x == r for x, _ in required):
                self._post_reply(msg.Retired(attempt=tau, endpoint=name))

    def crash_owner(self, name: str) -> None:
        """The owner loses its candidate and baseline: only an operator abort helps.

        The supervisor confirms the process cannot resume, so stop_and_wait can finish.
        """
        self.owners[name].alive = False
        for tau in self.required:
            self._post_reply(msg.Retired(attempt=tau, endpoint=name))

    def depart(self, name: str) -> None:
        """Receiver ``name`` departs (out of reach past the coordinators' bound): every live
        coordinator is told at once.  Its process stays as it is; messages to it stay in
        flight for a test to hold or deliver later (it came back)."""
        for epoch in sorted(self.alive_coordinators):
            self._handle_coordinator(epoch, ev.Departed(endpoint=name))

    def dense_refit(self, name: str) -> None:
        """The engine restores the committed record by a dense load and prewarm."""
        rx = self.receivers[name]
        version = V0 if self.record == self.base else V1
        rx.storage = dict.fromkeys(self.ranges, version)
        rx.gate_open = False
        rx.kv = EMPTY
        rx.bodies.clear()
        self._run_receiver(name, rx.core.handle(ev.DenseRefitDone(record=self.record)))

    def can_dense_refit(self, name: str) -> bool:
        core = self.receivers[name].core
        return (
            core.phase is ReceiverPhase.JOINING
            or (core.phase is ReceiverPhase.REFITTED and core.held != self.record)
            or (core.phase is ReceiverPhase.CLEANED and name in self.refit_requested)
        )

    def operator_abort(self, reason: str = "operator") -> None:
        """The operator aborts the transition; coordinators that take over later see it too."""
        self.abort_reason = reason
        if self.epoch in self.alive_coordinators:
            self._handle_coordinator(self.epoch, ev.OperatorAbort(reason=reason))

    # -- delivery ------------------------------------------------------------------------

    def _deliver(self, m: Message) -> None:
        self.steps += 1
        if m.kind is Kind.STORE:
            self._store(m)
        elif m.to.startswith("c"):
            epoch = int(m.to[1:])
            if epoch in self.alive_coordinators:
                self._handle_coordinator(epoch, m.event)  # type: ignore[arg-type]
        elif m.to in self.owners:
            self._deliver_owner(m)
        else:
            self._deliver_receiver(m)

    def _deliver_owner(self, m: Message) -> None:
        owner = self.owners[m.to]
        if not owner.alive:
            return
        self._run_owner(m.to, owner.core.handle(m.event))  # type: ignore[arg-type]

    def _deliver_receiver(self, m: Message) -> None:
        rx = self.receivers[m.to]
        if m.inc != rx.inc:
            return  # addressed to a process that no longer exists
        event = m.event
        if isinstance(event, ApplyDone):
            event = self._land_writes(m.to, event)
        elif isinstance(event, Wire):
            # The engine numbers the delivery; the core decides when its bytes are checked.
            rx.count += 1
            rx.deliveries[rx.count] = (event, m.body)
            event = ev.PayloadReceived(delivery=rx.count, key=event.key)
        self._run_receiver(m.to, rx.core.handle(event))  # type: ignore[arg-type]

    def _land_writes(self, name: str, done: ApplyDone) -> ev.PayloadsApplied:
        rx = self.receivers[name]
        keys = done.keys if done.fail_after is None else done.keys[: done.fail_after]
        for key in keys:
            body = rx.bodies[key]
            rng = (key.owner, key.payload_id)
            rx.storage[rng] = apply_entry(rx.storage[rng], body.encoding)
        return ev.PayloadsApplied(
            attempt=done.keys[0].attempt,
            keys=done.keys,
            failure=None if done.fail_after is None else "apply",
            post_apply_checked=True,
        )

    def _store(self, m: Message) -> None:
        serve(self, m)

    # -- executing commands --------------------------------------------------------------

    def _handle_coordinator(self, epoch: int, event: ev.CoordinatorEvent) -> None:
        for c in self.coordinators[epoch].handle(event):
            self._run_coordinator(epoch, c)

    def _run_coordinator(self, epoch: int, c: cmd.CoordinatorCommand) -> None:
        self.log.append((f"c{epoch}", c))
        match c:
            case cmd.RegisterAttempt(info=info):
                self.infos[info.attempt] = info
                self.required[info.attempt] = frozenset()
                self.acks.setdefault(info.attempt, set())
                self._post(Kind.STORE, "store", c, epoch=epoch)
            case cmd.Call(to=to, message=message):
                if isinstance(message, msg.Prepare):
                    # The attempt binds the receiver processes that its prepare reaches.
                    info = message.info
                    self.required[info.attempt] = frozenset(
                        (self.receiver_names.index(r), self.receivers[r].inc)
                        for r in info.receivers
                    )
                for name in to:
                    inc = self.receivers[name].inc if name in self.receivers else 0
                    self._post(Kind.CALL, name, message, inc=inc)
            case cmd.CompareAndSet(attempt=tau):
                self.cas[tau] = Cas.IN_FLIGHT
                self.timers.append((epoch, tau, Stage.COMMIT))
                self._post(Kind.STORE, "store", c, epoch=epoch)
            case cmd.ReadCommit() | cmd.RecordObsolete():
                self._post(Kind.STORE, "store", c, epoch=epoch)
            case cmd.CheckRetired(attempt=tau, endpoints=endpoints):
                self._retire_dead(tau, [e for e in endpoints if e in self.receivers])
            case cmd.RequestDenseRefit(receivers=receivers):
                self.refit_requested |= receivers
            case cmd.ArmDeadline(attempt=tau, stage=stage):
                self.timers.append((epoch, tau, stage))
            case cmd.TransitionEnded():
                self.outcomes[epoch] = c
            case cmd.StopDelivery() | cmd.ReleaseDelivery():
                pass  # payloads in flight stay in flight: receivers drop stale ones

    def _retire_dead(self, tau: int, receivers: Iterable[str]) -> None:
        """The supervisor confirms that restarted processes cannot resume the attempt."""
        required = dict(self.required.get(tau, frozenset()))
        for o in self.owner_names:
            if not self.owners[o].alive:
                self._post_reply(msg.Retired(attempt=tau, endpoint=o))
        for r in receivers:
            idx = self.receiver_names.index(r)
            if idx in required and self.receivers[r].inc != required[idx]:
                self._post_reply(msg.Retired(attempt=tau, endpoint=r))

    def _run_owner(self, name: str, commands: list[cmd.OwnerCommand]) -> None:
        owner = self.owners[name]
        for c in commands:
            self.log.append((name, c))
            match c:
                case cmd.Notify(message=reply):
                    self._post_reply(reply)
                case cmd.BuildBucket(attempt=tau, payload_id=pid, mode=mode):
                    final = pid == self.payload_counts[name] - 1
                    self._post(
                        Kind.LOCAL, name, ev.BucketBuilt(attempt=tau, payload_id=pid, final=final)
                    )
                    if mode is Mode.OVERWRITE:
                        encoding = Encoding.OVERWRITE
                    else:
                        encoding = Encoding.XOR_V0 if owner.baseline == V0 else Encoding.XOR_V1
                    key = PayloadKey(attempt=tau, owner=name, payload_id=pid)
                    self._built[key] = Body(
                        key=key,
                        encoding=encoding,
                        final=final,
                        digest=f"{tau}/{name}/{pid}/{encoding.name}".encode(),
                    )
                case cmd.SendPayload(attempt=tau, payload_id=pid):
                    body = self._built[PayloadKey(attempt=tau, owner=name, payload_id=pid)]
                    wire = Wire(key=body.key, digest=body.digest, final=body.final)
                    for r in sorted(self.infos[tau].receivers):
                        self._post(Kind.PAYLOAD, r, wire, inc=self.receivers[r].inc, body=body)
                    self._post(Kind.LOCAL, name, ev.PayloadSent(attempt=tau, payload_id=pid))
                case cmd.UpdateBaseline(record=record):
                    if record.version == self.base.version + 1:
                        owner.baseline = V1
                    self._post(Kind.LOCAL, name, ev.BaselineWritten(record=record))
                case cmd.FetchRecord():
                    # The owner reads the commit record as it is when the call arrives.
                    self._run_owner(
                        name, owner.core.handle(ev.CommitRecordRead(record=self.record))
                    )
                case cmd.StopStreaming() | cmd.Release() | cmd.SendDense():
                    pass

    def _run_receiver(self, name: str, commands: list[cmd.ReceiverCommand]) -> None:
        rx = self.receivers[name]
        for c in commands:
            self.log.append((name, c))
            match c:
                case cmd.Notify(message=reply):
                    if isinstance(reply, msg.Acked):
                        r = self.receiver_names.index(name)
                        self.acks.setdefault(reply.attempt, set()).add((r, rx.inc))
                    self._post_reply(reply)
                case cmd.CheckPayload(delivery=delivery):
                    # Reception checks complete at once; the body travels with the delivery.
                    wire, _ = rx.deliveries[delivery]
                    arrived = ev.PayloadArrived(
                        delivery=delivery,
                        key=wire.key,
                        digest=wire.digest,
                        final=wire.final,
                        rejection=wire.rejection,
                    )
                    self._run_receiver(name, rx.core.handle(arrived))
                case cmd.StagePayload(key=key, delivery=delivery):
                    _, body = rx.deliveries.pop(delivery)
                    assert body is not None and body.key == key
                    rx.bodies[key] = body
                case cmd.Discard(delivery=delivery):
                    rx.deliveries.pop(delivery, None)
                case cmd.Acknowledge():
                    pass
                case cmd.ArmDeadline(attempt=tau, stage=Stage.ARRIVAL):
                    self.arrival_timers.append((name, rx.inc, tau))
                case cmd.Decode(key=key):
                    self._post(Kind.LOCAL, name, ev.PayloadDecoded(key=key), inc=rx.inc)
                case cmd.Apply(keys=keys):
                    self._post(Kind.LOCAL, name, ApplyDone(keys=keys), inc=rx.inc)
                case cmd.CloseGate(attempt=tau):
                    rx.gate_open = False
                    self._post(Kind.LOCAL, name, ev.RequestsDrained(attempt=tau), inc=rx.inc)
                case cmd.Synchronize(attempt=tau):
                    self._post(Kind.LOCAL, name, ev.Synchronized(attempt=tau), inc=rx.inc)
                case cmd.InvalidateKvCache():
                    rx.kv = EMPTY
                case cmd.OpenGate():
                    rx.gate_open = True
                case cmd.Release(attempt=tau):
                    for key in [k for k in rx.bodies if k.attempt == tau]:
                        del rx.bodies[key]
                case cmd.ArmDeadline():
                    pass

    def _post_reply(self, event: ev.CoordinatorEvent) -> None:
        """Endpoint replies go to every live coordinator; each ignores other attempts."""
        for epoch in sorted(self.alive_coordinators):
            self._post(Kind.REPLY, f"c{epoch}", event)

    def _post(
        self,
        kind: Kind,
        to: str,
        event: object,
        *,
        epoch: int = 0,
        inc: int = 0,
        body: Body | None = None,
    ) -> None:
        self._seq += 1
        self.messages.append(
            Message(seq=self._seq, kind=kind, to=to, event=event, epoch=epoch, inc=inc, body=body)
        )

    # -- driving -------------------------------------------------------------------------

    def run(
        self,
        *,
        until: Callable[[World], bool] | None = None,
        hold: Callable[[Message], bool] | None = None,
        max_steps: int = 10_000,
    ) -> None:
        """Deliver messages first-in first-out until ``until`` holds or none is left.

        Messages for which ``hold`` is true stay in flight (delayed, to be delivered later).
        """
        for _ in range(max_steps):
            if until is not None and until(self):
                return
            ready = [i for i, m in enumerate(self.messages) if hold is None or not hold(m)]
            if not ready:
                return
            self.deliver(ready[0])
        raise AssertionError(f"no quiescence after {max_steps} deliveries")

    def commands(self, kind: type, origin: str | None = None) -> list[Any]:
        """Executed commands of ``kind`` (optionally only those ``origin`` issued)."""
        return [c for o, c in self.log if isinstance(c, kind) and origin in (None, o)]

    def calls(self, kind: type, origin: str | None = None) -> list[Any]:
        """Messages of ``kind`` that coordinators called endpoints with (optionally only
        coordinator ``origin``, e.g. ``"c1"``)."""
        return [c.message for c in self.commands(cmd.Call, origin) if isinstance(c.message, kind)]

    def indices(self, predicate: Callable[[Message], bool]) -> list[int]:
        """Positions of the messages in flight that ``predicate`` selects."""
        return [i for i, m in enumerate(self.messages) if predicate(m)]

    # -- projection into the specification -----------------------------------------------

    def project(self) -> State:
        """The specification state this world is in (for the shared invariants)."""
        return project(self)

    # -- convenience for tests -----------------------------------------------------------

    def outcome(self, epoch: int = 1) -> TransitionOutcome | None:
        ended = self.outcomes.get(epoch)
        return ended.outcome if ended else None
