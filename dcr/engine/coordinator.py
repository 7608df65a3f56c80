"""The coordinator engine: runs :class:`~dcr.protocol.coordinator.CoordinatorCore` on anyio.

It claims an epoch at the commit store, feeds the core ``StartTransition`` (or ``TakeOver``
after a failover), and executes the core's commands: control-plane operations on the commit
store, control calls to the endpoints, transport ``stop_and_wait``/``cleanup``, and timers that
come back as ``DeadlineExpired``.  Replies from endpoints, the store and timers all arrive in
the coordinator's inbox on the control channel, one event at a time.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import anyio
from anyio.abc import TaskGroup

from dcr.adapters.commit.base import CommitStore
from dcr.adapters.control.base import ControlChannel, ReadCommitRecord
from dcr.adapters.transport.base import Transport
from dcr.engine.setup import attempt_from_json, attempt_to_json
from dcr.errors import CommitConflict, CommitStoreError
from dcr.protocol import commands as cmd
from dcr.protocol import events as ev
from dcr.protocol.coordinator import CoordinatorConfig, CoordinatorCore
from dcr.protocol.types import CommitRecord, CounterIds, Mode, Stage, Timeouts

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
    """One coordinator process for one transition.

    ``owners`` and ``receivers`` name the endpoints (``receivers``: those holding the
    committed version now).  Store operations that fail with a retryable error are retried
    every ``retry_s`` seconds (the paper assumes an available control plane).
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
    supervisor: Supervisor = field(default_factory=_NoSupervisor)
    retry_s: float = 0.2
    epoch_check_s: float = 1.0
    """How often the coordinator checks that the store still names its epoch; a replaced
    coordinator learns of the conflict this way even while it waits for nothing else."""
    epoch: int = 0
    core: CoordinatorCore | None = None
    commands: list[cmd.CoordinatorCommand] = field(default_factory=list)
    """Every command executed, in order (for reports and tests)."""
    _deadlines: dict[int, float] = field(default_factory=dict)

    async def run(self, *, take_over: bool = False) -> cmd.TransitionEnded:
        """Drive the transition to its end and return this coordinator's outcome.

        ``take_over``: this coordinator replaces one that may have admitted an attempt; it
        resumes from the attempt the store has registered (paper App. B.2, failover).
        """
        self.epoch = await self._store_op(self.store.claim)
        state = await self._store_op(self.store.read)
        old = attempt_from_json(state.info) if take_over and state.info else None
        base = old.base if old is not None else state.record
        self.core = CoordinatorCore(
            CoordinatorConfig(
                base=base,
                owners=self.owners,
                receivers=self.receivers,
                epoch=self.epoch,
                sync=self.sync,
                timeouts=self.timeouts,
                require_post_apply=self.require_post_apply,
                mode=self.mode,
            ),
            CounterIds(first=self.epoch << 32, prefix=f"g{self.epoch}."),
        )
        inbox = self.control.coordinator_inbox(self.epoch)
        first: ev.CoordinatorEvent = ev.TakeOver(old=old) if take_over else ev.StartTransition()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch_epoch)
                ended = await self._loop(first, inbox, tg)
                tg.cancel_scope.cancel()
            return ended
        finally:
            self.control.close_coordinator(self.epoch)

    async def abort(self, reason: str) -> None:
        """The operator aborts the transition (delivered like any other event)."""
        await self.control.post(self.epoch, ev.OperatorAbort(reason=reason))

    async def _loop(
        self,
        first: ev.CoordinatorEvent,
        inbox: AsyncIterator[ev.CoordinatorEvent],
        tg: TaskGroup,
    ) -> cmd.TransitionEnded:
        assert self.core is not None
        event = first
        while True:
            for c in self.core.handle(event):
                self.commands.append(c)
                if isinstance(c, cmd.TransitionEnded):
                    return c
                await self._execute(c, tg)
            event = await inbox.__anext__()

    async def _post(self, event: ev.CoordinatorEvent) -> None:
        await self.control.post(self.epoch, event)

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

    async def _calls(self, endpoints: Iterable[str], message: object) -> None:
        for name in endpoints:
            await self.control.call(name, message)

    async def _execute(self, c: cmd.CoordinatorCommand, tg: TaskGroup) -> None:
        match c:
            case cmd.RegisterAttempt(info=info):
                tg.start_soon(self._register, info.attempt, info.base, attempt_to_json(info))
            case cmd.Prepare(info=info):
                await self._calls(
                    (*info.owners, *sorted(info.receivers)), ev.PrepareRequested(info=info)
                )
            case cmd.StartStreaming(attempt=tau, owners=owners):
                await self._calls(owners, ev.StreamingRequested(attempt=tau))
            case cmd.WaitForRequests(attempt=tau, epoch=epoch, receivers=receivers):
                await self._calls(
                    sorted(receivers), ev.WaitForRequestsRequested(attempt=tau, epoch=epoch)
                )
            case cmd.OpenApply(attempt=tau, epoch=epoch, receivers=receivers):
                await self._calls(
                    sorted(receivers), ev.OpenApplyRequested(attempt=tau, epoch=epoch)
                )
            case cmd.Flush(attempt=tau, owners=owners, receivers=receivers, expected=expected):
                await self._calls(
                    (*owners, *sorted(receivers)),
                    ev.FlushRequested(attempt=tau, expected=expected),
                )
            case cmd.CompareAndSet():
                deadline = self.store.clock() + c.deadline_s
                self._deadlines[c.attempt] = deadline
                tg.start_soon(self._compare_and_set, c, deadline)
                tg.start_soon(self._timer, c.attempt, Stage.COMMIT, c.deadline_s)
            case cmd.ReadCommit(attempt=tau):
                tg.start_soon(self._read_commit, tau)
            case cmd.MarkObsolete(attempt=tau, epoch=epoch, owners=owners, receivers=receivers):
                tg.start_soon(self._mark_obsolete, tau)
                await self._calls(
                    (*owners, *sorted(receivers)),
                    ev.MarkObsoleteRequested(attempt=tau, epoch=epoch),
                )
            case cmd.StopAndWait(attempt=tau, epoch=epoch, owners=owners, receivers=receivers):
                await self.transport.stop_and_wait(tau)
                endpoints = (*owners, *sorted(receivers))
                await self._calls(endpoints, ev.StopAndWaitRequested(attempt=tau, epoch=epoch))
                dead = set(self.supervisor.retired())
                for name in endpoints:
                    if name in dead:
                        await self._post(ev.Retired(attempt=tau, endpoint=name))
            case cmd.Cleanup(attempt=tau, owners=owners, receivers=receivers):
                await self.transport.cleanup(tau)
                await self._calls((*owners, *sorted(receivers)), ev.CleanupRequested(attempt=tau))
            case cmd.RequestBaselineUpdate(owners=owners):
                await self._calls(owners, ReadCommitRecord())
            case cmd.ReopenGate(attempt=tau, epoch=epoch, record=record, receivers=receivers):
                await self._calls(
                    sorted(receivers),
                    ev.ReopenGateRequested(attempt=tau, epoch=epoch, record=record),
                )
            case cmd.RequestDenseRefit(record=record, receivers=receivers):
                tg.start_soon(self.supervisor.dense_refit, record, receivers)
            case cmd.ArmDeadline(attempt=tau, stage=stage, seconds=seconds):
                tg.start_soon(self._timer, tau, stage, seconds)

    async def _watch_epoch(self) -> None:
        while True:
            await anyio.sleep(self.epoch_check_s)
            try:
                state = await self.store.read()
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
) -> AsyncIterator[CoordinatorService]:
    """A coordinator for one transition: ``result = await coord.run()`` inside the block."""
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
    )
