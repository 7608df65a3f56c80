"""``dcr coordinator``: the long-lived coordinator process of a fleet (and its standbys).

One process is active at a time: it holds a lease in the commit store and renews it; a
standby claims the next epoch once the lease has lapsed (its process died or stalled) and
takes over the transition in flight (paper App. B.2, failover).  The active process:

* keeps a table of endpoints from their status reports (what each holds, which incarnation);
* restores every joining receiver -- started, restarted, or behind the committed record -- by
  a dense refit that the owners send over the transport (:class:`~dcr.protocol.messages.
  DenseRefit`), so a receiver never needs a shared filesystem or a state dict, and reopens
  its request gate at the restored record (a restarted rollout engine serves again at once);
* runs one transition (:class:`~dcr.engine.coordinator.CoordinatorService`) each time every
  owner has staged the next version, with the receivers that hold the committed record as
  the required ones, and takes over a transition a replaced coordinator left unfinished;
* is the supervisor of its runs: an endpoint that reappears with a new incarnation was
  restarted, so its old process is confirmed gone (``Retired``);
* lets a receiver depart (:class:`~dcr.protocol.events.Departed`) once its control
  connection has been gone for ``[coordinator] depart_after_s`` (or when :meth:`depart` is
  told that it was lost with its node): it is no longer required nor waited for, and the
  transition in flight goes on without it; it rejoins when it reports again;
* binds, at each mixed-mode prepare, what the owners may encode relative to the old bits:
  the union of the required receivers' refused sets (``xor_refused`` of their status
  reports, the names their loader does not preserve bit for bit), so that no owner needs to
  know the serving side's loaders; the ``transition`` event says how many tensors go
  relative (``relative``, ``None`` when a member has not reported: the integration setup's
  ``xor_names`` decide) and which are refused by whom (``refused``, name -> receivers);
* proves the base version at prepare (``[proof]``, on by default): a seeded sample of stored
  bits at every prepare, the complete fingerprint at the first transition a receiver takes
  part in after this process first saw it (whatever version it claims), after it restarted
  and after it was restored; a receiver that fails is told so
  (``Disproved``), leaves the transition and is restored by dense refit (``disproved``
  event).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import anyio
from anyio.abc import TaskGroup

from dcr.adapters.commit.base import CommitStore
from dcr.adapters.control.base import ControlChannel, CoordinatorLink
from dcr.adapters.security import COORDINATOR
from dcr.adapters.transport.base import Transport
from dcr.engine.coordinator import CoordinatorService
from dcr.engine.integration import attempt_from_json
from dcr.errors import CommitConflict, CommitStoreError, ConfigError, DcrError, TransportError
from dcr.fleet.config import FleetConfig
from dcr.fleet.eventlog import NAMES_SHOWN, EventLog, FaultPoints, install_metrics
from dcr.fleet.model import FleetModel
from dcr.fleet.runtime import make_control, make_store, make_transport
from dcr.protocol import commands as cmd
from dcr.protocol import messages as msg
from dcr.protocol.coordinator import bound_refused
from dcr.protocol.events import Departed
from dcr.protocol.membership import (
    CheckArrival,
    DenseAsked,
    Depart,
    MembershipCommand,
    MembershipConfig,
    MembershipCore,
    ReleaseJob,
    ReopenGate,
    Retire,
    RunTransition,
    Say,
    StartDense,
    Tick,
    TransitionDone,
)
from dcr.protocol.types import CommitRecord, Mode

__all__ = ["SILENT_S", "STALL_S", "FleetCoordinator", "run_coordinator"]

SILENT_S = 30.0
"""How long the active coordinator waits for a member that never reported before it says so
(and again every as long while it stays silent)."""
_TICK_S = 0.1
"""How long the membership tick waits for a report before it looks at the time again."""
STALL_S = 5.0
"""A tick this much later than asked is said (``stalled`` event, and on stderr)."""

T = TypeVar("T")


@dataclass(slots=True)
class FleetCoordinator:
    """The active-or-standby coordinator of a fleet; :meth:`serve` runs until cancelled.

    What happens between transitions is decided by the sans-IO membership core
    (:class:`~dcr.protocol.membership.MembershipCore`); this process holds the lease, feeds
    the core the endpoints' reports and the commit store's state, and executes its commands:
    transitions, dense-refit jobs, arrival checks, cleanups and gate reopenings.
    """

    owners: tuple[str, ...]
    receivers: tuple[str, ...]
    store: CommitStore
    control: ControlChannel
    transport: Transport
    config: FleetConfig
    log: EventLog
    name: str = "coordinator"
    faults: FaultPoints | None = None
    epoch: int = 0
    transitions: int = 0
    membership: MembershipCore | None = None
    _link: CoordinatorLink | None = None
    _service: CoordinatorService | None = None
    _wake: anyio.Event = field(default_factory=anyio.Event)
    _tg: TaskGroup | None = None
    _catalog_names: tuple[frozenset[str] | None] | None = None
    _early: list[msg.Reply] = field(default_factory=list)
    """Reports that arrived before the lease was won (fed to the core once it exists)."""
    _connected: dict[str, float] = field(default_factory=dict)
    """Receiver -> when the control link last showed it connected (known receivers only)."""
    _lost: set[str] = field(default_factory=set)
    """Receivers a supervisor reported lost for good that have not departed yet: kept also
    by a standby, which may become the active coordinator of an attempt that binds them."""

    @property
    def statuses(self) -> dict[str, msg.EndpointStatus]:
        """Endpoint -> its last status report."""
        return self.membership.statuses if self.membership is not None else {}

    async def serve(self) -> None:
        """Wait to become active (lease), then coordinate until cancelled."""
        link = self._link = await self.control.coordinator()
        lease = self.config.coordinator.lease_s
        try:
            self.log.emit("standby", address=link.address)
            while True:
                epoch = await self._store_op(self.store.claim_if_lapsed, address=link.address,
                                             lease_s=lease)  # fmt: skip
                if epoch is not None:
                    break
                await anyio.sleep(lease / 4)
            self.epoch = epoch
            self.membership = self._core(epoch)
            self.log.emit(
                "active", epoch=epoch, address=link.address, keyed=self.config.keys is not None
            )
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(self._dispatch, link)
                tg.start_soon(self._renew)
                await self._tick()
        finally:
            with anyio.CancelScope(shield=True):
                await link.aclose()

    def _core(self, epoch: int) -> MembershipCore:
        c = self.config.coordinator
        proof = self.config.proof
        return MembershipCore(
            MembershipConfig(
                owners=self.owners,
                receivers=self.receivers,
                join_wait_s=c.join_wait_s,
                dense_timeout_s=c.dense_timeout_s,
                settle_s=c.timeouts.stop_s,
                silent_s=SILENT_S,
                fingerprint_on_join=proof is not None and proof.fingerprint_on_join,
            ),
            epoch=epoch,
        )

    # -- the membership core's clock and commands --------------------------------------------

    async def _tick(self) -> None:
        """Feed the core the time and the commit record, about every 100 ms (at once when a
        report arrives), and execute what it asks for."""
        core = self.membership
        assert core is not None
        while True:
            state = await self._store_op(self.store.read)
            info = None
            if state.info:
                with contextlib.suppress(ConfigError):
                    info = attempt_from_json(state.info)
            now = anyio.current_time()
            await self._execute(core.handle(Tick(now=now, record=state.record, attempt=info)))
            await self._depart_gone(now)
            slept = anyio.current_time()
            with anyio.move_on_after(_TICK_S):
                await self._wake.wait()
            self._wake = anyio.Event()
            self._check_stall(anyio.current_time() - slept)

    def _check_stall(self, waited: float) -> None:
        """A wait of at most ``_TICK_S`` that took ``waited`` seconds means the event loop was
        starved or the process paused: that time does not count towards ``depart_after_s``
        (it was not watching), and a long one is said."""
        late = waited - _TICK_S
        if late < 1.0:
            return
        for r in self._connected:
            self._connected[r] += late
        if late < STALL_S:
            return
        self.log.emit("stalled", seconds=round(late, 3))
        print(f"dcr coordinator: this process did not run for {late:.1f} s (a starved or "
              "paused process; its peers' silence does not count that time)",
              file=sys.stderr, flush=True)  # fmt: skip

    def _unreachable(self, now: float) -> list[str]:
        """Known receivers whose control connection has been gone for longer than
        ``[coordinator] depart_after_s``: they depart.  Only a link that says who is
        connected (``endpoints()``, as the ZeroMQ channel's does) lets receivers depart so."""
        core = self.membership
        bound = self.config.coordinator.depart_after_s
        endpoints = getattr(self._link, "endpoints", None)
        if core is None or bound <= 0 or not callable(endpoints):
            return []
        connected = endpoints()
        known = core.departable()
        gone = []
        for r in self.receivers:
            if r not in known:
                self._connected.pop(r, None)  # never heard from, or departed already
            elif r in connected:
                self._connected[r] = now
            elif now - self._connected.setdefault(r, now) > bound:
                del self._connected[r]
                gone.append(r)
        return gone

    async def _depart_gone(self, now: float) -> None:
        """Receivers unreachable past the bound, and those reported lost, depart."""
        assert self.membership is not None
        for name in [*self._unreachable(now), *self._reported_lost()]:
            await self._execute(self.membership.handle(Departed(endpoint=name)))

    def _reported_lost(self) -> list[str]:
        """The receivers reported lost that the membership would now let depart (it knows
        them: they reported, or an attempt taken over binds them)."""
        core = self.membership
        if core is None or not self._lost:
            return []
        gone = sorted(self._lost & core.departable())
        self._lost.difference_update(gone)
        return gone

    def depart(self, receivers: Iterable[str]) -> None:
        """A supervisor reports these receivers lost for good (their node is gone): they
        depart at the next tick, without waiting for ``depart_after_s``.  A standby keeps
        the report: once active, it lets them depart as soon as it knows them (an attempt
        of its predecessor that it takes over binds them, say).  A receiver that reports
        again before that stays."""
        self._lost.update(r for r in receivers if r in self.receivers)
        self._wake.set()

    async def _execute(self, commands: list[MembershipCommand]) -> None:
        for c in commands:
            match c:
                case RunTransition():
                    if c.not_waiting:
                        self.log.emit("not-waiting", receivers=list(c.not_waiting))
                    self._spawn(partial(self._transition, c))
                case StartDense(job=job, receiver=receiver, record=record):
                    call = msg.DenseRefit(
                        job=job, record=record, owners=self.owners, receivers=frozenset({receiver})
                    )
                    # The receiver first: its payloads may still overtake the call (it holds
                    # them until the call arrives), but seldom.
                    self._spawn(partial(self._dense, (receiver, *self.owners), call))
                case CheckArrival(job=job, receiver=receiver, expected=expected):
                    arrival = msg.CheckArrival(attempt=job, expected=expected)
                    self._spawn(partial(self._call, receiver, arrival))
                case ReleaseJob(job=job):
                    self._spawn(partial(self._cleanup, job))
                case ReopenGate(job=job, receiver=receiver, record=record):
                    reopen = msg.ReopenGate(attempt=job, epoch=self._current_epoch(), record=record)
                    self._spawn(partial(self._call, receiver, reopen))
                case Retire(endpoint=endpoint):
                    service = self._service
                    info = service.core.attempt if service is not None and service.core else None
                    if service is not None and info is not None:
                        await service.report(msg.Retired(attempt=info.attempt, endpoint=endpoint))
                case Depart(endpoint=endpoint):
                    # Also before the run's first attempt: the run goes on without it.
                    if self._service is not None:
                        await self._service.depart(endpoint)
                case Say(kind="waiting", fields=fields):
                    self._say_silent(fields)
                case Say(kind=kind, fields=fields):
                    self.log.emit(kind, **fields)

    def _say_silent(self, fields: dict[str, object]) -> None:
        """Say which members of the fleet file never reported (a trainer with fewer ranks
        than ``[trainer]`` names, a receiver never started): a fleet waiting on a member that
        does not exist waits forever otherwise, without a word."""
        owners, receivers = fields["owners"], fields["receivers"]
        parts = []
        if owners:
            parts.append(
                f"owners {owners} (the fleet file names {len(self.owners)} trainer ranks "
                f"{', '.join(self.owners)}: [trainer] ranks, or tp * ep * dp of the synthetic "
                "trainer; is every rank started and joined with this fleet file?)"
            )
        if receivers:
            parts.append(f"receivers {receivers} (started with this fleet file?)")
        message = "waiting for members that never reported: " + "; ".join(parts)
        self.log.emit("waiting", owners=owners, receivers=receivers, message=message)
        print(f"dcr coordinator: {message}", file=sys.stderr, flush=True)

    # -- transitions ------------------------------------------------------------------------

    def refused_reports(self) -> dict[str, frozenset[str]]:
        """Receiver -> the names its last status report says its loader does not preserve
        bit for bit (receivers that reported a classification)."""
        return {
            r: s.xor_refused
            for r in self.receivers
            if (s := self.statuses.get(r)) is not None and s.xor_refused is not None
        }

    def _catalog(self) -> frozenset[str] | None:
        """The canonical names the fleet serves, when the fleet file says which (a checkpoint,
        or the synthetic trainer's model); ``None`` for a trainer that brings its own."""
        if self._catalog_names is None:
            names = None
            # A trainer of another kind trains a model that [model] need not describe.
            if self.config.model.checkpoint is not None or self.config.trainer.synthetic:
                with contextlib.suppress(DcrError, OSError, KeyError, TypeError, ValueError):
                    names = frozenset(FleetModel(self.config).wire_catalog)
            self._catalog_names = (names,)
        return self._catalog_names[0]

    def classification(
        self, members: tuple[str, ...], reports: dict[str, frozenset[str]]
    ) -> dict[str, object]:
        """What a mixed-mode prepare of ``members`` binds, for the ``transition`` event:
        ``relative`` (how many catalog tensors may travel relative; ``None`` when no set is
        bound or the catalog is unknown here), ``refused_count`` and ``refused`` (the first
        refused names -> the members refusing each), and ``unreported`` members."""
        bound = bound_refused(reports, members)
        catalog = self._catalog()
        union = sorted(set().union(*(reports.get(r, frozenset()) for r in members)))
        return {
            "relative": None if bound is None or catalog is None else len(catalog - bound),
            "refused_count": len(union),
            "refused": {n: [r for r in members if n in reports.get(r, ())]
                        for n in union[:NAMES_SHOWN]},
            "unreported": [r for r in members if r not in reports],
        }  # fmt: skip

    def members(self, record: CommitRecord) -> tuple[str, ...]:
        """Receivers whose last report says they hold ``record`` exactly: the required ones."""
        return self.membership.members(record) if self.membership is not None else ()

    async def _transition(self, run: RunTransition) -> None:
        assert self._link is not None and self.membership is not None
        c = self.config.coordinator
        base, old = run.base, run.take_over
        # Members that departed since the core started the run are not required.
        members = tuple(r for r in run.members if r not in self.membership.gone())
        reports = self.refused_reports()
        service = CoordinatorService(
            owners=self.owners,
            receivers=members,
            store=self.store,
            control=self.control,
            transport=self.transport,
            sync=c.sync,
            timeouts=c.timeouts,
            mode=Mode.MIXED,
            proof=self.config.proof,
            fingerprint=run.fingerprint,
            join_wait_s=c.join_wait_s,
            xor_refused=reports,
            supervisor=self,
            link=self._link,
            reads_replies=False,
            lease_s=c.lease_s,
        )
        self._service = service
        for r in self.membership.gone():
            await service.depart(r)  # (a receiver of an attempt taken over, say)
        self.transitions += 1
        self.log.emit("transition", base=base.version, take_over=old is not None,
                      required=list(service.receivers),
                      **self.classification(members, reports))  # fmt: skip
        t0 = anyio.current_time()
        try:
            ended = await service.run(take_over=old is not None)
        finally:
            self._service = None
        self.epoch = max(self.epoch, service.epoch)
        verdicts = service.core.verdicts if service.core is not None else ()
        for verdict in verdicts:
            self.log.emit(
                "proved",
                base=base.version,
                sampled=verdict.sampled,
                fingerprinted=verdict.fingerprinted,
                failed=sorted(verdict.failed),
            )
            if verdict.failed:
                self.log.emit("disproved", base=base.version, receivers=sorted(verdict.failed),
                              reasons=dict(verdict.failed))  # fmt: skip
        bound = {
            c.message.info.attempt: c.message.xor_refused
            for c in service.commands
            if isinstance(c, cmd.Call) and isinstance(c.message, msg.Prepare)
        }
        attempts = [
            {"attempt": c.info.attempt, "mode": c.info.mode.value,
             "receivers": sorted(c.info.receivers),
             "refused": None if (b := bound.get(c.info.attempt)) is None else len(b)}
            for c in service.commands
            if isinstance(c, cmd.RegisterAttempt)
        ]  # fmt: skip
        now = (await self._store_op(self.store.read)).record
        self.log.emit(
            "ended",
            outcome=ended.outcome.value,
            record=now.version,
            candidate=now.candidate,
            base=base.version,
            committed_by=ended.committed_by,
            reason=ended.reason,
            attempts=attempts,
            epoch=service.epoch,
            seconds=anyio.current_time() - t0,
        )
        # Replaced: this process stands down (its lease renewal fails next).
        replaced = ended.outcome.value == "conflict" and ended.committed_by is None and now == base
        done = TransitionDone(
            record=now,
            epoch=service.epoch,
            replaced=replaced,
            disproved=frozenset(verdicts[0].failed) if verdicts else None,
        )
        await self._execute(self.membership.handle(done))
        self._wake.set()

    # -- the supervisor of a run (dcr.engine.coordinator.Supervisor) ------------------------

    def retired(self) -> tuple[str, ...]:
        """Endpoints restarted or departed since the transition began: their old process is
        gone, or out of reach (no stop waits for it)."""
        return self.membership.restarted() if self.membership is not None else ()

    async def dense_refit(self, record: CommitRecord, receivers: frozenset[str]) -> None:
        """An aborted transition asks for these receivers to be restored (paper App. B.2)."""
        assert self.membership is not None
        await self._execute(self.membership.handle(DenseAsked(record=record, receivers=receivers)))

    # -- replies -----------------------------------------------------------------------------

    async def _dispatch(self, link: CoordinatorLink) -> None:
        async for reply in link.replies():
            core = self.membership
            if core is None:
                continue  # not active yet: every endpoint reports again to the active one
            if isinstance(reply, msg.EndpointStatus | msg.ReceiverReady):
                self._lost.discard(reply.endpoint if isinstance(reply, msg.EndpointStatus)
                                   else reply.receiver)  # fmt: skip
                await self._execute(core.handle(reply))
            elif isinstance(reply, msg.AttemptFailed | msg.SendsDone):
                job = core.job_of(reply.attempt) is not None
                await self._execute(core.handle(reply))
                if job and isinstance(reply, msg.SendsDone):
                    continue
            service = self._service
            info = service.core.attempt if service is not None and service.core else None
            replied = isinstance(reply, msg.GateClosed | msg.Acked)
            if info is not None and replied and self.faults is not None:
                self.faults.reached("replied", info.base.version + 1, role="coordinator")
            if service is not None and not isinstance(reply, msg.EndpointStatus):
                await service.report(reply)
            self._wake.set()

    async def _dense(self, names: tuple[str, ...], call: msg.DenseRefit) -> None:
        for name in names:
            await self._call(name, call)

    async def _call(self, endpoint: str, call: msg.Call) -> None:
        assert self._link is not None
        await self._link.call(endpoint, call, epoch=self._current_epoch())

    async def _cleanup(self, job: int) -> None:
        """A dense job that ended or was replaced: the transport releases what it holds of
        it (on object storage, its payloads; paper App. B.2, cleanup)."""
        with (
            anyio.move_on_after(self.config.coordinator.timeouts.stop_s),
            contextlib.suppress(TransportError),
        ):
            await self.transport.cleanup(job)

    def _current_epoch(self) -> int:
        service = self._service
        return max(self.epoch, service.epoch if service is not None else 0)

    def _spawn(self, fn: Callable[[], Coroutine[Any, Any, None]]) -> None:
        assert self._tg is not None
        self._tg.start_soon(fn)

    # -- lease -------------------------------------------------------------------------------

    async def _renew(self) -> None:
        """Keep the lease while no run renews it; losing it ends this process's tenure."""
        lease = self.config.coordinator.lease_s
        while True:
            await anyio.sleep(lease / 4)
            if self._service is not None:
                continue  # the run renews it (and learns of a replacement)
            epoch = self._current_epoch()
            try:
                await self.store.renew(epoch=epoch, lease_s=lease)
            except CommitConflict:
                if self._service is not None or self._current_epoch() != epoch:
                    # A run of this process claimed the newer epoch while the renewal was
                    # in flight: not a replacement (the run renews its own lease).
                    continue
                self.log.emit("replaced")
                raise SystemExit(3) from None
            except CommitStoreError:
                continue

    async def _store_op(self, fn: Callable[..., Awaitable[T]], **kwargs: Any) -> T:
        while True:
            try:
                return await fn(**kwargs)
            except CommitStoreError as exc:
                if not exc.retryable:
                    raise
                await anyio.sleep(0.2)


async def run_coordinator(
    cfg: FleetConfig,
    name: str = "coordinator",
    *,
    started: Callable[[FleetCoordinator], None] | None = None,
) -> None:
    """Serve as the fleet's coordinator (or its standby) until cancelled.  ``started`` is
    given the coordinator before it serves (a supervisor that reports lost receivers to it
    through :meth:`FleetCoordinator.depart`)."""
    log = EventLog(cfg.events_dir, name)
    install_metrics(cfg, "coordinator", name)  # [metrics]: its events as metrics
    store = make_store(cfg)
    control = make_control(cfg, store)
    transport = make_transport(cfg, identity=COORDINATOR)
    coordinator = FleetCoordinator(
        owners=cfg.owners,
        receivers=tuple(r.name for r in cfg.receivers),
        store=store,
        control=control,
        transport=transport,
        config=cfg,
        log=log,
        name=name,
        faults=FaultPoints(cfg.run_dir / "faults.json", name, log),
    )
    if started is not None:
        started(coordinator)
    try:
        await coordinator.serve()
    finally:
        with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
            await transport.aclose()
            await control.aclose()
            await store.close()
        log.close()
