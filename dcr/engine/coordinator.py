"""The coordinator engine: runs :class:`~dcr.protocol.coordinator.CoordinatorCore` on anyio.

It claims an epoch at the commit store, feeds the core ``StartTransition`` (or ``TakeOver``
after a failover), and executes the core's commands: control-plane operations on the commit
store, control calls to the endpoints, transport ``stop_and_wait``/``cleanup``, and timers that
come back as ``DeadlineExpired``.  Replies from endpoints, the store and timers all arrive in
the coordinator's inbox on the control channel, one event at a time.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectSendStream

from dcr.adapters.commit.base import CommitStore
from dcr.adapters.control.base import ControlChannel, CoordinatorLink
from dcr.adapters.transport.base import Transport
from dcr.engine.integration import attempt_from_json, attempt_to_json
from dcr.errors import CommitConflict, CommitStoreError, TransportError
from dcr.protocol import commands as cmd
from dcr.protocol import events as ev
from dcr.protocol import messages as msg
from dcr.protocol.coordinator import CoordinatorConfig, CoordinatorCore
from dcr.protocol.proof import ProofConfig
from dcr.protocol.types import AttemptInfo, CommitRecord, EpochIds, Mode, Stage, Timeouts

__all__ = ["CoordinatorService", "Supervisor", "open_coordinator"]

T = TypeVar("T")


class Supervisor(Protocol):
    """What the engine asks of whoever manages the endpoint processes.

    ``retired`` names endpoints whose process is confirmed gone (so ``stop_and_wait`` need not
    wait for them); ``dense_refit`` restores receivers to ``record`` by a full load, after
    which their engines report ``ReceiverReady``.
    """

    def retired(self) -> Iterable[str]: ...

    async def dense_refit(self, record: CommitRecord, receivers: frozenset[str]) -> None: ...


class _NoSupervisor:
    def retired(self) -> Iterable[str]:
        return ()

    async def dense_refit(self, record: CommitRecord, receivers: frozenset[str]) -> None:
        return None


@dataclass(slots=True)
class CoordinatorService:
    """One coordinator run per transition.

    ``owners`` and ``receivers`` name the endpoints (``receivers``: those holding the
    committed version now).  Store operations that fail with a retryable error are retried
    every ``retry_s`` seconds (the paper assumes an available control plane).  ``link`` is the
    process's coordinator link (one is opened for the run when it is ``None``); ``lease_s``
    keeps a lease in the commit store that standbys wait out before they take over.
    """

    owners: tuple[str, ...]
    receivers: tuple[str, ...]
    store: CommitStore
    control: ControlChannel
    transport: Transport
    sync: bool = True
    timeouts: Timeouts = field(default_factory=Timeouts)
    require_post_apply: bool = False
    mode: Mode = Mode.MIXED
    """Mode of the first attempt (``OVERWRITE`` sends absolute values only)."""
    proof: ProofConfig | None = None
    """Proof of the base version at prepare (see :class:`~dcr.protocol.proof.ProofConfig`)."""
    fingerprint: bool = False
    """Request the complete fingerprint at the first prepare (fresh or restored receivers)."""
    join_wait_s: float = 0.0
    """How long a retry waits for receivers a failed proof sent to a dense refit (see
    :attr:`~dcr.protocol.coordinator.CoordinatorConfig.join_wait_s`)."""
    xor_refused: Mapping[str, frozenset[str]] | None = None
    """The receivers' loader classifications from their status reports (receiver -> the
    names its loader does not preserve bit for bit); each mixed-mode prepare binds the union
    over its required receivers (see
    :attr:`~dcr.protocol.coordinator.CoordinatorConfig.xor_refused`).  ``None``: prepares
    bind none and the integration setup's ``xor_names`` decide."""
    supervisor: Supervisor = field(default_factory=_NoSupervisor)
    link: CoordinatorLink | None = None
    reads_replies: bool = True
    """Whether the run reads ``link.replies()`` itself; a long-lived coordinator process that
    also watches endpoints reads them once and hands them over with :meth:`report`."""
    lease_s: float | None = None
    retry_s: float = 0.2
    epoch_check_s: float = 1.0
    """How often the coordinator checks that the store still names its epoch (and renews its
    lease); a replaced coordinator learns of the conflict this way even while it waits for
    nothing else."""
    epoch: int = 0
    core: CoordinatorCore | None = None
    commands: list[cmd.CoordinatorCommand] = field(default_factory=list)
    """Every command executed, in order (for reports and tests)."""
    _deadlines: dict[int, float] = field(default_factory=dict)
    _events: MemoryObjectSendStream[ev.CoordinatorEvent] | None = None
    _abort: str | None = None
    _departed: set[str] = field(default_factory=set)

    async def run(self, *, take_over: bool = False) -> cmd.TransitionEnded:
        """Drive the transition to its end and return this coordinator's outcome.

        ``take_over``: this coordinator replaces one that may have admitted an attempt; it
        resumes from the attempt the store has registered (paper App. B.2, failover).
        """
        link = self.link or await self.control.coordinator()
        try:
            self.epoch = await self._store_op(
                self.store.claim, address=link.address, lease_s=self.lease_s
            )
            state = await self._store_op(self.store.read)
            old = attempt_from_json(state.info) if take_over and state.info else None
            return await self._run(link, state.record, old, take_over)
        finally:
            if self.link is None:
                with anyio.CancelScope(shield=True):
                    await link.aclose()

    async def _run(
        self,
        link: CoordinatorLink,
        record: CommitRecord,
        old: AttemptInfo | None,
        take_over: bool,
    ) -> cmd.TransitionEnded:
        self.core = CoordinatorCore(
            CoordinatorConfig(
                base=old.base if old is not None else record,
                owners=self.owners,
                receivers=self.receivers,
                epoch=self.epoch,
                sync=self.sync,
                timeouts=self.timeouts,
                require_post_apply=self.require_post_apply,
                mode=self.mode,
                proof=self.proof,
                fingerprint=self.fingerprint,
                join_wait_s=self.join_wait_s,
                xor_refused=self.xor_refused,
            ),
            EpochIds(self.epoch).attempts(),
        )
        send, recv = anyio.create_memory_object_stream[ev.CoordinatorEvent](math.inf)
        self._events = send
        first: ev.CoordinatorEvent = ev.TakeOver(old=old) if take_over else ev.StartTransition()
        with send, recv:
            if self._abort is not None:
                # An abort asked for before the run claimed its epoch is not lost.
                send.send_nowait(ev.OperatorAbort(reason=self._abort))
            for name in sorted(self._departed):
                # Nor is a departure.
                send.send_nowait(ev.Departed(endpoint=name))
            async with anyio.create_task_group() as tg:
                if self.reads_replies:
                    tg.start_soon(self._forward, link.replies(), send)
                tg.start_soon(self._watch_epoch)
                ended = await self._loop(first, recv, link, tg)
                tg.cancel_scope.cancel()
        self._events = None
        return ended

    async def abort(self, reason: str) -> None:
        """The operator aborts the transition (delivered like any other event, also when the
        run has not started yet)."""
        self._abort = reason
        if self._events is not None:
            await self._post(ev.OperatorAbort(reason=reason))

    async def depart(self, endpoint: str) -> None:
        """Receiver ``endpoint`` left the fleet (:class:`~dcr.protocol.events.Departed`): the
        transition goes on without it (delivered also when the run has not started yet)."""
        self._departed.add(endpoint)
        if self._events is not None:
            await self._post(ev.Departed(endpoint=endpoint))

    async def report(self, reply: msg.Reply) -> None:
        """A reply for this coordinator from outside its own link reader: a supervisor's
        ``Retired`` (a process is gone), or any reply when ``reads_replies`` is off."""
        await self._post(reply)

    @staticmethod
    async def _forward(
        replies: AsyncIterator[msg.Reply], send: MemoryObjectSendStream[ev.CoordinatorEvent]
    ) -> None:
        async for reply in replies:
            await send.send(reply)

    async def _loop(
        self,
        first: ev.CoordinatorEvent,
        inbox: AsyncIterator[ev.CoordinatorEvent],
        link: CoordinatorLink,
        tg: TaskGroup,
    ) -> cmd.TransitionEnded:
        assert self.core is not None
        event = first
        while True:
            for c in self.core.handle(event):
                self.commands.append(c)
                if isinstance(c, cmd.TransitionEnded):
                    return c
                await self._execute(c, link, tg)
            event = await inbox.__anext__()

    async def _post(self, event: ev.CoordinatorEvent) -> None:
        if self._events is not None:
            with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
                await self._events.send(event)

    async def _store_op(self, fn: Callable[..., Awaitable[T]], **kwargs: Any) -> T:
        """Call a store operation, retrying retryable errors (the control plane is assumed
        available; a lasting outage is an operator matter)."""
        while True:
            try:
                return await fn(**kwargs)
            except CommitStoreError as exc:
                if not exc.retryable:
                    raise
                await anyio.sleep(self.retry_s)

    async def _execute(
        self, c: cmd.CoordinatorCommand, link: CoordinatorLink, tg: TaskGroup
    ) -> None:
        match c:
            case cmd.Call(to=to, message=message):
                for name in to:
                    await link.call(name, message, epoch=self.epoch)
            case cmd.RegisterAttempt(info=info):
                tg.start_soon(self._register, info.attempt, info.base, attempt_to_json(info))
            case cmd.CompareAndSet():
                deadline = self.store.clock() + c.deadline_s
                self._deadlines[c.attempt] = deadline
                tg.start_soon(self._compare_and_set, c, deadline)
                tg.start_soon(self._timer, c.attempt, Stage.COMMIT, c.deadline_s)
            case cmd.ReadCommit(attempt=tau):
                tg.start_soon(self._read_commit, tau)
            case cmd.RecordObsolete(attempt=tau):
                tg.start_soon(self._mark_obsolete, tau)
            case cmd.StopDelivery(attempt=tau):
                tg.start_soon(self._transport_op, self.transport.stop_and_wait, tau)
            case cmd.ReleaseDelivery(attempt=tau):
                tg.start_soon(self._transport_op, self.transport.cleanup, tau)
            case cmd.CheckRetired(attempt=tau, endpoints=endpoints):
                dead = set(self.supervisor.retired())
                for name in endpoints:
                    if name in dead:
                        await self._post(msg.Retired(attempt=tau, endpoint=name))
            case cmd.RequestDenseRefit(record=record, receivers=receivers):
                tg.start_soon(self.supervisor.dense_refit, record, receivers)
            case cmd.ArmDeadline(attempt=tau, stage=stage, seconds=seconds):
                tg.start_soon(self._timer, tau, stage, seconds)

    async def _transport_op(self, fn: Callable[[int], Awaitable[None]], attempt: int) -> None:
        """``stop_and_wait`` / ``cleanup``: bounded by the stop timeout; a transport that
        cannot answer does not hold the protocol (receivers ignore stale payloads anyway)."""
        with anyio.move_on_after(self.timeouts.stop_s):
            with contextlib.suppress(TransportError):
                await fn(attempt)

    async def _watch_epoch(self) -> None:
        while True:
            await anyio.sleep(self.epoch_check_s)
            try:
                if self.lease_s is not None:
                    await self.store.renew(epoch=self.epoch, lease_s=self.lease_s)
                state = await self.store.read()
            except CommitConflict:
                await self._post(ev.Conflict(attempt=None))
                return
            except CommitStoreError:
                continue
            if state.epoch != self.epoch:
                await self._post(ev.Conflict(attempt=None))
                return

    async def _register(self, attempt: int, base: CommitRecord, info: str) -> None:
        try:
            await self._store_op(
                self.store.register, epoch=self.epoch, attempt=attempt, base=base, info=info
            )
        except CommitConflict:
            await self._post(ev.Conflict(attempt=attempt))
            return
        await self._post(ev.Registered(attempt=attempt))

    async def _compare_and_set(self, c: cmd.CompareAndSet, deadline: float) -> None:
        outcome = await self.store.compare_and_set(
            epoch=c.epoch, attempt=c.attempt, expected=c.expected, new=c.new, deadline=deadline
        )
        await self._post(ev.CommitReplied(attempt=c.attempt, outcome=outcome))

    async def _read_commit(self, attempt: int) -> None:
        deadline = self._deadlines.get(attempt, self.store.clock())
        record = await self._store_op(self.store.read_commit, attempt=attempt, deadline=deadline)
        await self._post(ev.CommitRead(attempt=attempt, record=record))

    async def _mark_obsolete(self, attempt: int) -> None:
        await self._store_op(self.store.mark_obsolete, attempt=attempt)
        await self._post(ev.ObsoleteMarked(attempt=attempt))

    async def _timer(self, attempt: int, stage: Stage, seconds: float) -> None:
        await anyio.sleep(seconds)
        await self._post(ev.DeadlineExpired(attempt=attempt, stage=stage))


@asynccontextmanager
async def open_coordinator(
    *,
    owners: Iterable[str],
    receivers: Iterable[str],
    store: CommitStore,
    control: ControlChannel,
    transport: Transport,
    sync: bool = True,
    timeouts: Timeouts | None = None,
    supervisor: Supervisor | None = None,
    mode: Mode = Mode.MIXED,
    proof: ProofConfig | None = None,
    fingerprint: bool = False,
    join_wait_s: float = 0.0,
    xor_refused: Mapping[str, frozenset[str]] | None = None,
) -> AsyncIterator[CoordinatorService]:
    """A coordinator for one transition: ``result = await coord.run()`` inside the block.

    ``proof`` turns on the proof of the base version at prepare (receivers that fail it are
    handed to ``supervisor.dense_refit``); ``fingerprint`` requests the complete fingerprint
    at the first prepare; ``join_wait_s`` lets a retry wait for disproved receivers being
    restored; ``xor_refused`` (receiver -> the ``xor_refused`` of its status report) lets
    each mixed-mode prepare bind what may travel relative."""
    yield CoordinatorService(
        owners=tuple(owners),
        receivers=tuple(receivers),
        store=store,
        control=control,
        transport=transport,
        sync=sync,
        timeouts=timeouts or Timeouts(),
        supervisor=supervisor or _NoSupervisor(),
        mode=mode,
        proof=proof,
        fingerprint=fingerprint,
        join_wait_s=join_wait_s,
        xor_refused=xor_refused,
    )
