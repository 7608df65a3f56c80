"""Every role of a refit in one process: owners, receivers and coordinators on real adapters.

:class:`LocalCluster` starts one owner engine per training rank and one receiver engine per
receiver, all talking through a control channel, a transport and a commit store (in-memory by
default), and runs each transition with a fresh coordinator.  It is also the *supervisor*:
it confirms dead endpoints (``Retired``), restarts them (a receiver restores the committed
version by dense refit and rejoins at the next prepare; an owner reinitializes its baseline
from the committed version), and plays the fault plan of :mod:`dcr.adapters.faulty`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch
from anyio.abc import TaskGroup

from dcr.adapters.commit.base import CommitStore
from dcr.adapters.control.base import ControlChannel
from dcr.adapters.faulty import FaultLog, Faults, FaultyCommitStore, FaultyTransport
from dcr.adapters.transport.base import Transport
from dcr.apply.applier import Applier
from dcr.delta.build import BuildStats
from dcr.delta.group import LocalTrainingGroup
from dcr.engine.coordinator import CoordinatorService
from dcr.engine.integration import Integration, default_limiter
from dcr.engine.owner import OwnerService, TrainingSide
from dcr.engine.receiver import ReceiverHooks, ReceiverService
from dcr.errors import ConfigError
from dcr.protocol import commands as cmd
from dcr.protocol import membership as ms
from dcr.protocol import messages as msg
from dcr.protocol.lifecycle import ReceiverPhase
from dcr.protocol.membership import MembershipConfig, MembershipCore
from dcr.protocol.proof import ProofConfig, Verdict
from dcr.protocol.receiver import QueueConfig
from dcr.protocol.types import CommitRecord, Mode, PayloadKey, Timeouts, TransitionOutcome
from dcr.wire.seal import payload_key

__all__ = ["AttemptSummary", "LocalCluster", "TransitionResult"]


@dataclass(frozen=True, slots=True, kw_only=True)
class AttemptSummary:
    """One attempt of a transition as the coordinators ran it."""

    attempt: int
    mode: Mode
    receivers: tuple[str, ...]
    coordinator: int


@dataclass(frozen=True, slots=True, kw_only=True)
class TransitionResult:
    """How a transition ended, and what it took."""

    outcome: TransitionOutcome
    record: CommitRecord
    """The commit record when the transition ended."""
    attempts: tuple[AttemptSummary, ...]
    stats: BuildStats
    """Construction counters of the first attempt (the changed set is the same in all)."""
    payload_bytes: int
    """Payload bytes the transport accepted, over all attempts."""
    num_payloads: int
    faults: FaultLog
    reason: str = ""
    committed_by: int | None = None
    """Epoch of the coordinator whose compare-and-set committed the record (a replaced one
    that kept running may commit first); ``None`` when nothing was committed."""
    verdicts: tuple[Verdict, ...] = ()
    """Proofs of the base version judged during the transition (see ``docs/protocol.md``)."""


@dataclass(slots=True)
class _Process:
    scope: anyio.CancelScope
    exited: anyio.Event = field(default_factory=anyio.Event)
    alive: bool = True


@dataclass(slots=True)
class LocalCluster:
    """Owners of ``group`` and the given receivers, driven through real protocol engines."""

    group: LocalTrainingGroup
    receivers: Mapping[str, Applier]
    integration: Integration
    store: CommitStore
    control: ControlChannel
    transport: Transport
    sync: bool = True
    timeouts: Timeouts = field(default_factory=Timeouts)
    queue: QueueConfig = field(default_factory=QueueConfig)
    hooks: Mapping[str, ReceiverHooks] = field(default_factory=dict)
    limiter: anyio.CapacityLimiter = field(default_factory=default_limiter)
    proof: ProofConfig | None = None
    """Proof of the base version at prepare (``None``: receivers are trusted to hold it)."""
    join_wait_s: float = 0.0
    """How long a retry waits for receivers a failed proof sent to a dense refit."""
    fleet_secret: bytes | None = field(default=None, repr=False)
    """The fleet's 32-byte secret: owners seal every payload with its payload key and
    receivers refuse any payload not sealed with it (:mod:`dcr.wire.seal`)."""
    owners: dict[str, OwnerService] = field(default_factory=dict)
    receiver_services: dict[str, ReceiverService] = field(default_factory=dict)
    versions: dict[CommitRecord, Mapping[str, torch.Tensor]] = field(default_factory=dict)
    """Shards of the committed version and of the candidate, for dense refits and restarts."""
    _transport: FaultyTransport = field(init=False)
    _store: FaultyCommitStore = field(init=False)
    _side: TrainingSide = field(init=False)
    _tg: TaskGroup | None = None
    _processes: dict[str, _Process] = field(default_factory=dict)
    _dead: set[str] = field(default_factory=set)
    _faults: Faults = field(default_factory=Faults)
    _log: FaultLog = field(default_factory=FaultLog)
    _coordinators: list[CoordinatorService] = field(default_factory=list)
    _applied_in_first: int = 0
    _sent_by_victim: int = 0
    _struck: set[str] = field(default_factory=set)
    _first_attempt: int | None = None
    _failover_due: anyio.Event | None = None
    progress: Callable[[str, int, int], None] | None = None
    """Called in the event loop as payloads are applied: ``("apply", applied, -1)``."""
    _applied: int = 0
    _membership: MembershipCore | None = None
    """Who each transition requires and fingerprints, and who is restored after it
    (:mod:`dcr.protocol.membership`, the rules the fleet's coordinator runs too)."""
    _refits: set[str] = field(default_factory=set)
    """Receivers whose dense refit runs in the cluster's task group."""

    def __post_init__(self) -> None:
        self._transport = FaultyTransport(self.transport, seal_key=payload_key(self.fleet_secret))
        self._store = FaultyCommitStore(self.store)
        self._side = TrainingSide(self.group, self.integration.xor_names)

    @property
    def side(self) -> TrainingSide:
        return self._side

    # -- processes ----------------------------------------------------------------------

    @property
    def owner_names(self) -> tuple[str, ...]:
        return tuple(self.integration.owner_ids)

    async def start(self, tg: TaskGroup, committed: CommitRecord) -> None:
        """Start every owner and receiver engine in ``tg``, all holding ``committed``."""
        self._tg = tg
        for name, rank in self.integration.owner_ids.items():
            await self._start_owner(name, rank, committed)
        for name in self.receivers:
            await self._start_receiver(name, committed)

    async def _spawn(self, name: str, serve: Callable[..., Awaitable[None]]) -> None:
        assert self._tg is not None
        proc = _Process(scope=anyio.CancelScope())

        async def run(*, task_status: anyio.abc.TaskStatus[None]) -> None:
            try:
                with proc.scope:
                    await serve(task_status=task_status)
            finally:
                proc.exited.set()

        self._processes[name] = proc
        await self._tg.start(run)

    async def _start_owner(self, name: str, rank: int, baseline: CommitRecord) -> None:
        service = OwnerService(
            name=name,
            rank=rank,
            side=self.side,
            integration=self.integration,
            control=self.control,
            transport=self._transport,
            store=self._store,
            baseline=baseline,
            limiter=self.limiter,
            on_sent=self._on_sent,
            fleet_secret=self.fleet_secret,
        )
        self.owners[name] = service
        await self._spawn(name, service.serve)

    async def _start_receiver(self, name: str, held: CommitRecord | None) -> None:
        service = ReceiverService(
            name=name,
            receiver=self.receivers[name],
            integration=self.integration,
            control=self.control,
            transport=self._transport,
            held=held,
            queue=self.queue,
            hooks=self.hooks.get(name, ReceiverHooks()),
            limiter=self.limiter,
            on_applied=self._on_applied,
            fleet_secret=self.fleet_secret,
        )
        self.receiver_services[name] = service
        await self._spawn(name, service.serve)

    async def kill(self, name: str) -> None:
        """The endpoint's process dies now; returns once its pending writes have finished."""
        proc = self._processes.get(name)
        if proc is None or not proc.alive:
            return
        proc.alive = False
        svc = self.receiver_services.get(name)
        info = svc.core.attempt if svc is not None else self.owners[name].core.attempt
        proc.scope.cancel()
        await proc.exited.wait()
        self._dead.add(name)
        self._log.killed.append(name)
        if info is not None:
            # The supervisor confirms the process cannot resume the attempt (paper App. B.2).
            for coordinator in list(self._coordinators):
                await coordinator.report(msg.Retired(attempt=info.attempt, endpoint=name))

    # -- supervisor ---------------------------------------------------------------------

    def retired(self) -> Iterable[str]:
        return tuple(self._dead)

    async def dense_refit(self, record: CommitRecord, receivers: frozenset[str]) -> None:
        """Restore ``receivers`` to ``record`` by dense refit (operator request or rejoin).

        Runs in the cluster's task group, so it outlives the coordinator that asked; each
        restore waits until the receiver may take it (a disproved receiver first finishes
        the stop and cleanup of its failed attempt).
        """
        assert self._tg is not None
        state = self.canonical(record)
        for name in sorted(receivers):
            if name not in self._refits:
                self._refits.add(name)
                self._tg.start_soon(self._refit_when_ready, name, state, record)

    async def _refit_when_ready(
        self, name: str, state: Mapping[str, torch.Tensor], record: CommitRecord
    ) -> None:
        takes = (ReceiverPhase.JOINING, ReceiverPhase.REFITTED, ReceiverPhase.CLEANED)
        try:
            with anyio.move_on_after(self.timeouts.stop_s):
                while True:
                    svc = self.receiver_services.get(name)
                    if svc is None or name in self._dead:
                        return
                    if svc.core.phase in takes:
                        await svc.dense_refit(state, record)
                        self._restored(name, record)
                        return
                    await anyio.sleep(0.005)
        finally:
            self._refits.discard(name)

    def canonical(self, record: CommitRecord) -> dict[str, torch.Tensor]:
        """The canonical tensors of ``record``, exported from its shards.

        ``record`` is the committed version, or the staged candidate's once it committed.
        """
        shards = self.versions.get(record, self.group.staged)
        if shards is None:
            raise ConfigError(f"no shards of version {record} are kept for a dense refit")
        return self.group.export(shards)

    async def _restart(self, name: str) -> None:
        """Restart a killed endpoint at the committed version (paper App. B.2, joining)."""
        record = (await self._store.read()).record
        self._dead.discard(name)
        self._log.restarted.append(name)
        if name in self.receivers:
            await self._start_receiver(name, None)
            await self.receiver_services[name].dense_refit(self.canonical(record), record)
            self._restored(name, record)
        else:
            rank = self.integration.owner_ids[name]
            self.group.restart(rank, self.versions[record])
            await self._start_owner(name, rank, record)

    async def _settle(self) -> None:
        """Wait (bounded by the stop timeout) until every live receiver has taken the commit
        notification: it holds the committed record with its gate open, or it is joining and
        is restored below.  The next transition's required receivers are read from here."""
        record = (await self._store.read()).record

        def settled() -> bool:
            return all(
                self._holds(name, record) and svc.core.gate_open
                for name, svc in self.receiver_services.items()
                if name not in self._dead
                and svc.core.phase not in (ReceiverPhase.JOINING, ReceiverPhase.REFITTED)
            )

        with anyio.move_on_after(self.timeouts.stop_s):
            while self._refits or not settled():
                await anyio.sleep(0.005)

    # -- membership (dcr.protocol.membership) ----------------------------------------------

    @property
    def membership(self) -> MembershipCore:
        if self._membership is None:
            self._membership = MembershipCore(
                MembershipConfig(
                    owners=self.owner_names,
                    receivers=tuple(sorted(self.receivers)),
                    settle_s=0.0,  # transition() waits for its members itself (_settle)
                    dense_timeout_s=0.0,  # every transition restores who is still behind
                    fingerprint_on_join=self.proof is not None,
                ),
                epoch=0,
            )
        return self._membership

    def _observe(self, staged: bool) -> None:
        """Report every endpoint's state to the membership core, as endpoints report theirs
        to a fleet coordinator: a live receiver holds its record unless its storage is dirty,
        a dead one must be restored; the owners say whether the trainer asked for a
        transition (``staged``)."""
        core = self.membership
        for name, svc in sorted(self.owners.items()):
            core.handle(msg.EndpointStatus(endpoint=name, role="owner", incarnation=svc.incarnation,
                                           record=svc.core.baseline, candidate=staged))  # fmt: skip
        for name, rx in sorted(self.receiver_services.items()):
            c = rx.core
            held = None if name in self._dead or c.dirty else c.held
            core.handle(msg.EndpointStatus(endpoint=name, role="receiver",
                                           incarnation=rx.incarnation, record=held))  # fmt: skip

    def _restored(self, name: str, record: CommitRecord) -> None:
        """A receiver restored ``record`` by dense refit: fingerprinted before it takes part."""
        self.membership.handle(msg.ReceiverReady(receiver=name, record=record))

    async def _tick(self, record: CommitRecord, *, staged: bool) -> ms.RunTransition | None:
        """Feed the core this moment; restore the receivers it asks for (receivers that
        restored an older version than the one now committed, or missed a commit, catch up
        before they join, App. B.2); return the transition it starts, if any."""
        self._observe(staged)
        run = None
        tick = ms.Tick(now=anyio.current_time(), record=record)
        for c in self.membership.handle(tick):
            if isinstance(c, ms.RunTransition):
                run = c
            elif isinstance(c, ms.StartDense):
                await self.dense_refit(c.record, frozenset({c.receiver}))
        return run

    # -- fault triggers -------------------------------------------------------------------

    def _on_applied(self, key: PayloadKey) -> None:
        """Runs in the apply worker thread: hand the count to the event loop."""
        anyio.from_thread.run_sync(self._count_applied, key)

    def _count_applied(self, key: PayloadKey) -> None:
        self._applied += 1
        if self.progress is not None:
            self.progress("apply", self._applied, -1)
        if key.attempt == self._first_attempt:
            self._applied_in_first += 1
            self._strike()

    def _on_sent(self, key: PayloadKey, size: int) -> None:
        if self._first_attempt is None:
            self._first_attempt = key.attempt
        f = self._faults
        if key.attempt == self._first_attempt and key.owner == f.kill_owner:
            self._sent_by_victim += 1
        self._strike()

    def _strike(self) -> None:
        """Play the fault plan: each kill (and the failover) strikes once its count is reached."""
        f = self._faults
        if self._first_attempt is None:
            return
        if (
            f.kill_receiver is not None
            and "receiver" not in self._struck
            and self._applied_in_first >= f.kill_receiver_after
        ):
            self._struck.add("receiver")
            self._schedule(self._kill_and_restart, f.kill_receiver)
        if (
            f.kill_owner is not None
            and "owner" not in self._struck
            and self._sent_by_victim >= f.kill_owner_after
        ):
            self._struck.add("owner")
            self._schedule(self._kill_and_restart, f.kill_owner)
        if (
            f.failover
            and "failover" not in self._struck
            and self._failover_due is not None
            and self._applied_in_first >= f.failover_after
        ):
            self._struck.add("failover")
            self._failover_due.set()

    def _schedule(self, fn: Callable[[str], Coroutine[Any, Any, None]], name: str) -> None:
        assert self._tg is not None
        self._tg.start_soon(fn, name)

    async def _kill_and_restart(self, name: str) -> None:
        await self.kill(name)
        await self._restart(name)

    # -- transitions ----------------------------------------------------------------------

    def members(self, committed: CommitRecord) -> tuple[str, ...]:
        """Receivers that hold ``committed`` exactly now: the required receivers."""
        self._observe(staged=False)
        return self.membership.members(committed)

    def _holds(self, name: str, record: CommitRecord) -> bool:
        """Receiver ``name`` is alive and its storage holds exactly ``record``."""
        core = self.receiver_services[name].core
        return name not in self._dead and core.held == record and not core.dirty

    async def transition(
        self, faults: Faults | None = None, mode: Mode = Mode.MIXED
    ) -> TransitionResult:
        """Run one transition (the candidate must be staged) with a fresh coordinator whose
        first attempt uses ``mode``."""
        faults = faults or Faults()
        state = await self._store.read()
        committed = state.record
        self._faults, self._log = faults, FaultLog()
        self._transport.arm(faults, self._log)
        self._store.arm(faults, self._log)
        self._applied_in_first, self._first_attempt, self._applied = 0, None, 0
        self._sent_by_victim, self._struck = 0, set()
        sent_before = (self._bytes_sent(), self._payloads_sent())
        coordinators: list[CoordinatorService] = []
        self._coordinators = coordinators
        run = await self._tick(committed, staged=True)
        if run is None:
            raise ConfigError(
                "no transition can start: an owner does not hold the committed record"
            )
        members, fingerprint = run.members, run.fingerprint

        def coordinator() -> CoordinatorService:
            c = CoordinatorService(
                owners=self.owner_names,
                receivers=members,
                store=self._store,
                control=self.control,
                transport=self._transport,
                sync=self.sync,
                timeouts=self.timeouts,
                supervisor=self,
                mode=mode,
                proof=self.proof,
                fingerprint=fingerprint,
                join_wait_s=self.join_wait_s,
            )
            coordinators.append(c)
            return c

        ended: cmd.TransitionEnded
        if faults.failover:
            ended = await self._with_failover(coordinator, faults)
        else:
            ended = await coordinator().run()
        verdicts = tuple(v for co in coordinators if co.core for v in co.core.verdicts)
        for name in sorted(self._dead):
            await self._restart(name)
        await self._settle()
        now = (await self._store.read()).record
        self.membership.handle(
            ms.TransitionDone(
                record=now,
                epoch=max((co.epoch for co in coordinators), default=0),
                disproved=frozenset(dict(verdicts[0].failed)) if verdicts else None,
            )
        )
        await self._tick(now, staged=False)
        await self._settle()
        infos = [
            c.info for co in coordinators for c in co.commands if isinstance(c, cmd.RegisterAttempt)
        ]
        attempts = tuple(
            AttemptSummary(
                attempt=i.attempt,
                mode=i.mode,
                receivers=tuple(sorted(i.receivers)),
                coordinator=i.coordinator,
            )
            for i in infos
        )
        first_attempt = attempts[0].attempt if attempts else -1
        stats = self.side.stats(first_attempt)
        for a in attempts:
            self.side.release(a.attempt)
        # What the caller sees is what happened to the record: a replaced coordinator whose
        # commit landed first committed the transition as much as the active one would have.
        outcome, committed_by = ended.outcome, ended.committed_by
        if now.version == committed.version + 1:
            outcome = TransitionOutcome.COMMITTED
            committed_by = next((i.coordinator for i in infos if i.target == now), committed_by)
        return TransitionResult(
            outcome=outcome,
            record=now,
            committed_by=committed_by,
            attempts=attempts,
            stats=stats,
            payload_bytes=self._bytes_sent() - sent_before[0],
            num_payloads=self._payloads_sent() - sent_before[1],
            faults=self._log,
            reason=ended.reason,
            verdicts=verdicts,
        )

    async def _with_failover(
        self, coordinator: Callable[[], CoordinatorService], faults: Faults
    ) -> cmd.TransitionEnded:
        """Replace the coordinator once the trigger fires; the old one dies or keeps running."""
        due = self._failover_due = anyio.Event()
        first = coordinator()
        old_scope = anyio.CancelScope()
        results: dict[str, cmd.TransitionEnded] = {}
        try:
            async with anyio.create_task_group() as tg:

                async def run_old() -> None:
                    with old_scope:
                        results["old"] = await first.run()
                    if not due.is_set():  # it ended before the trigger: no failover
                        tg.cancel_scope.cancel()

                tg.start_soon(run_old)
                await due.wait()
                if not faults.old_keeps_running:
                    old_scope.cancel()  # the old coordinator dies
                self._log.failovers += 1
                results["new"] = await coordinator().run(take_over=True)
                if faults.old_keeps_running:
                    with anyio.move_on_after(self.timeouts.stop_s):
                        while "old" not in results:
                            await anyio.sleep(0.01)
                tg.cancel_scope.cancel()
        finally:
            self._failover_due = None
        if "old" in results and "new" in results:
            self._log.replaced_outcome = results["old"].outcome.value
        return results.get("new") or results["old"]

    def _bytes_sent(self) -> int:
        return self.transport.stats().cross_bytes

    def _payloads_sent(self) -> int:
        return self.transport.stats().payloads
