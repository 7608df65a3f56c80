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
import math
import sys
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, TypeVar

import anyio
from anyio.abc import TaskGroup

from dcr.adapters.commit.base import CommitState, CommitStore
from dcr.adapters.control.base import ControlChannel, CoordinatorLink
from dcr.adapters.transport.base import Transport
from dcr.engine.coordinator import CoordinatorService
from dcr.engine.integration import attempt_from_json
from dcr.errors import CommitConflict, CommitStoreError, ConfigError, DcrError, TransportError
from dcr.fleet.config import FleetConfig
from dcr.fleet.eventlog import NAMES_SHOWN, EventLog, FaultPoints
from dcr.fleet.model import FleetModel
from dcr.fleet.runtime import make_control, make_store, make_transport
from dcr.protocol import commands as cmd
from dcr.protocol import messages as msg
from dcr.protocol.coordinator import bound_refused
from dcr.protocol.types import AttemptInfo, CommitRecord, Mode

__all__ = ["SILENT_S", "FleetCoordinator", "run_coordinator"]

SILENT_S = 30.0
"""How long the active coordinator waits for a member that never reported before it says so
(and again every as long while it stays silent)."""

T = TypeVar("T")


@dataclass(slots=True)
class _Job:
    """A dense refit of one receiver in flight."""

    job: int
    record: CommitRecord
    deadline: float
    sent: dict[str, int] = field(default_factory=dict)
    """Owner -> payloads it sent (its :class:`~dcr.protocol.messages.SendsDone`)."""


@dataclass(slots=True)
class FleetCoordinator:
    """The active-or-standby coordinator of a fleet; :meth:`serve` runs until cancelled."""

    owners: tuple[str, ...]
    receivers: tuple[str, ...]
    store: CommitStore
    control: ControlChannel
    transport: Transport
    config: FleetConfig
    log: EventLog
    name: str = "coordinator"
    faults: FaultPoints | None = None
    statuses: dict[str, msg.EndpointStatus] = field(default_factory=dict)
    epoch: int = 0
    transitions: int = 0
    _link: CoordinatorLink | None = None
    _service: CoordinatorService | None = None
    _restarted: set[str] = field(default_factory=set)
    _unverified: set[str] = field(default_factory=set)
    """Receivers started, restarted or restored since a complete fingerprint checked them."""
    _jobs: dict[str, _Job] = field(default_factory=dict)
    _engaged: frozenset[str] = frozenset()
    """Receivers the running (or just finished) transition requires: not dense-refitted."""
    _counter: int = 0
    _wake: anyio.Event = field(default_factory=anyio.Event)
    _tg: TaskGroup | None = None
    _catalog_names: tuple[frozenset[str] | None] | None = None

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
            self.log.emit("active", epoch=epoch, address=link.address)
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(self._dispatch, link)
                tg.start_soon(self._renew)
                tg.start_soon(self._refit_joiners)
                await self._coordinate(link, tg)
        finally:
            with anyio.CancelScope(shield=True):
                await link.aclose()

    # -- transitions ------------------------------------------------------------------------

    async def _coordinate(self, link: CoordinatorLink, tg: TaskGroup) -> None:
        staged_since: float | None = None
        active_since = anyio.current_time()
        said = -math.inf
        while True:
            now = anyio.current_time()
            if now - active_since >= SILENT_S and now - said >= SILENT_S:
                said = now if self._say_silent() else said
            state = await self._store_op(self.store.read)
            old = self._unfinished(state)
            staged = self._owners_staged(state.record)
            if staged and staged_since is None:
                staged_since = anyio.current_time()
            waited = anyio.current_time() - (staged_since or 0.0)
            joining = self._joining(state.record)
            if old is not None or (
                staged and (not joining or waited >= self.config.coordinator.join_wait_s)
            ):
                if joining and old is None:
                    self.log.emit("not-waiting", receivers=sorted(joining))
                staged_since = None
                await self._transition(link, state, old)
            else:
                with anyio.move_on_after(0.1):
                    await self._wake.wait()
                self._wake = anyio.Event()

    def _say_silent(self) -> bool:
        """Say which members of the fleet file never reported (a trainer with fewer ranks
        than ``[trainer]`` names, a receiver never started): a fleet waiting on a member that
        does not exist waits forever otherwise, without a word.  True when it said so."""
        owners = sorted(o for o in self.owners if o not in self.statuses)
        receivers = sorted(r for r in self.receivers if r not in self.statuses)
        if not owners and not receivers:
            return False
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
        return True

    def _joining(self, record: CommitRecord) -> set[str]:
        """Receivers not (yet) holding ``record``: starting, restoring or behind."""
        return {
            r for r in self.receivers if (s := self.statuses.get(r)) is None or s.record != record
        }

    def _unfinished(self, state: CommitState) -> AttemptInfo | None:
        """An attempt a replaced coordinator registered whose transition is not finished:
        not committed while owners still hold its candidate, or committed while some owner
        has not moved its baseline yet."""
        if not state.info:
            return None
        try:
            info = attempt_from_json(state.info)
        except ConfigError:
            return None
        if info.coordinator >= self.epoch:
            return None
        owners = [self.statuses.get(o) for o in self.owners]
        if any(s is None for s in owners):
            return None  # wait until every owner has said where it stands
        if state.record == info.base and all(s.candidate for s in owners if s is not None):
            return info
        if state.record == info.target and any(
            s.record == info.base for s in owners if s is not None
        ):
            return info
        return None

    def _owners_staged(self, record: CommitRecord) -> bool:
        return all(
            (s := self.statuses.get(o)) is not None and s.record == record and s.candidate
            for o in self.owners
        )

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
                    names = frozenset(FleetModel(self.config).catalog)
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
        return tuple(
            sorted(
                r
                for r in self.receivers
                if (s := self.statuses.get(r)) is not None and s.record == record
            )
        )

    async def _transition(
        self, link: CoordinatorLink, state: CommitState, old: AttemptInfo | None
    ) -> None:
        c = self.config.coordinator
        base = old.base if old is not None else state.record
        members = self.members(base)
        proof = self.config.proof
        unverified = bool(self._unverified & set(members))
        fingerprint = proof is not None and proof.fingerprint_on_join and unverified
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
            fingerprint=fingerprint,
            join_wait_s=c.join_wait_s,
            xor_refused=reports,
            supervisor=self,
            link=link,
            reads_replies=False,
            lease_s=c.lease_s,
        )
        self._service = service
        self._engaged = frozenset(service.receivers)
        self._restarted.clear()
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
        if fingerprint and verdicts:
            # The first prepare fingerprinted every member; those that failed are restored
            # by dense refit and become unverified again when they report ready.
            self._unverified -= set(members) - set(verdicts[0].failed)
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
        if ended.outcome.value == "conflict" and ended.committed_by is None and now == base:
            self._engaged = frozenset()
            return  # replaced: this process stands down (its lease renewal fails next)
        await self._settle(now, self._engaged)
        self._engaged = frozenset()

    async def _settle(self, record: CommitRecord, required: frozenset[str]) -> None:
        """Wait (bounded) until the receivers that took part report the committed record, so
        that the next transition requires them (paper App. B.2: membership is read between
        transitions)."""
        with anyio.move_on_after(self.config.coordinator.timeouts.stop_s):
            while not all(
                (s := self.statuses.get(r)) is not None
                and (s.record == record or s.record is None or r in self._restarted)
                for r in required
            ):
                await anyio.sleep(0.05)

    # -- the supervisor of a run (dcr.engine.coordinator.Supervisor) ------------------------

    def retired(self) -> tuple[str, ...]:
        """Endpoints restarted since the transition began: their old process is gone."""
        return tuple(sorted(self._restarted))

    async def dense_refit(self, record: CommitRecord, receivers: frozenset[str]) -> None:
        """An aborted transition asks for these receivers to be restored (paper App. B.2)."""
        for r in receivers:
            self._start_job(r, record)

    # -- replies -----------------------------------------------------------------------------

    async def _dispatch(self, link: CoordinatorLink) -> None:
        async for reply in link.replies():
            if isinstance(reply, msg.EndpointStatus):
                await self._on_status(reply)
            elif isinstance(reply, msg.ReceiverReady):
                self._unverified.add(reply.receiver)
                status = self.statuses.get(reply.receiver)
                if status is not None:  # its status report follows; do not refit it again
                    self.statuses[reply.receiver] = replace(status, record=reply.record)
                job = self._jobs.get(reply.receiver)
                if job is not None and job.record == reply.record:
                    self._release(self._jobs.pop(reply.receiver))
                    self.log.emit("restored", receiver=reply.receiver, version=reply.record.version)
                    # It holds the committed version exactly: it serves again now (a rollout
                    # engine that restarted must not wait for the next transition, which may
                    # need its rollouts), and joins at the next prepare.
                    reopen = msg.ReopenGate(
                        attempt=job.job, epoch=self._current_epoch(), record=reply.record
                    )
                    self._spawn(partial(self._call, reply.receiver, reopen))
            elif isinstance(reply, msg.AttemptFailed):
                self._on_job_failed(reply)
            elif isinstance(reply, msg.SendsDone) and self._on_job_sent(reply):
                continue
            service = self._service
            info = service.core.attempt if service is not None and service.core else None
            replied = isinstance(reply, msg.GateClosed | msg.Acked)
            if info is not None and replied and self.faults is not None:
                self.faults.reached("replied", info.base.version + 1, role="coordinator")
            if service is not None and not isinstance(reply, msg.EndpointStatus):
                await service.report(reply)
            self._wake.set()

    async def _on_status(self, status: msg.EndpointStatus) -> None:
        before = self.statuses.get(status.endpoint)
        self.statuses[status.endpoint] = status
        if before is None and status.endpoint in self.receivers:
            # Seen for the first time: whatever version it claims (an engine started from a
            # checkpoint, a preloaded rank, a receiver of a replaced coordinator's fleet), its
            # storage is fingerprinted completely before the first transition it takes part in.
            self._unverified.add(status.endpoint)
        if before is not None and before.incarnation != status.incarnation:
            # A new process of that name: the old one is gone for good.
            self._restarted.add(status.endpoint)
            self._unverified.add(status.endpoint)
            self._release(self._jobs.pop(status.endpoint, None))
            self.log.emit("restarted", endpoint=status.endpoint)
            service = self._service
            info = service.core.attempt if service is not None and service.core else None
            if service is not None and info is not None:
                await service.report(msg.Retired(attempt=info.attempt, endpoint=status.endpoint))

    def _on_job_failed(self, failure: msg.AttemptFailed) -> None:
        for receiver, job in list(self._jobs.items()):
            if job.job == failure.attempt:
                # Retry soon (a baseline update in progress, a damaged payload, ...).
                job.deadline = min(job.deadline, anyio.current_time() + 1.0)
                self.log.emit("dense-failed", receiver=receiver, job=job.job,
                              endpoint=failure.endpoint, check=failure.check,
                              message=failure.message)  # fmt: skip

    def _on_job_sent(self, done: msg.SendsDone) -> bool:
        """An owner sent its last payload of a dense job; once every owner has, the receiver
        checks arrival against their sent lists (a payload lost with a relay node fails the
        job within the transport's arrival grace instead of at ``dense_timeout_s``)."""
        for receiver, job in self._jobs.items():
            if job.job == done.attempt:
                job.sent[done.owner] = done.payload_count
                if set(job.sent) >= set(self.owners):
                    call = msg.CheckArrival(attempt=job.job, expected=tuple(job.sent.items()))
                    self._spawn(partial(self._call, receiver, call))
                return True
        return False

    async def _call(self, endpoint: str, call: msg.Call) -> None:
        assert self._link is not None
        await self._link.call(endpoint, call, epoch=self._current_epoch())

    # -- dense refits of joining receivers --------------------------------------------------

    async def _refit_joiners(self) -> None:
        while True:
            record = (await self._store_op(self.store.read)).record
            now = anyio.current_time()
            for r in self.receivers:
                s = self.statuses.get(r)
                if s is not None and s.record == record:
                    self._release(self._jobs.pop(r, None))
                if s is None or s.record == record:
                    continue
                job = self._jobs.get(r)
                if r in self._engaged and (job is None or job.record != record):
                    # Part of the running transition: restored only when it asks (a failed
                    # proof), and then sent again below when that job failed or lapsed.
                    continue
                if job is None or job.record != record or now >= job.deadline:
                    self._start_job(r, record)
            await anyio.sleep(0.1)

    def _start_job(self, receiver: str, record: CommitRecord) -> None:
        """Ask the owners to send ``record`` to ``receiver`` as a fresh dense-refit job."""
        self._release(self._jobs.get(receiver))
        self._counter += 1
        job = (self.epoch << 32) | (1 << 31) | self._counter  # above every attempt of epoch
        self._jobs[receiver] = _Job(
            job=job,
            record=record,
            deadline=anyio.current_time() + self.config.coordinator.dense_timeout_s,
        )
        self.log.emit("dense", receiver=receiver, job=job, version=record.version)
        call = msg.DenseRefit(
            job=job, record=record, owners=self.owners, receivers=frozenset({receiver})
        )

        async def send() -> None:
            for name in (*self.owners, receiver):
                await self._call(name, call)

        self._spawn(send)

    def _release(self, job: _Job | None) -> None:
        """A dense job that ended or was replaced: the transport releases what it holds of
        it (on object storage, its payloads; paper App. B.2, cleanup)."""
        if job is not None:
            self._spawn(partial(self._cleanup, job.job))

    async def _cleanup(self, job: int) -> None:
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


async def run_coordinator(cfg: FleetConfig, name: str = "coordinator") -> None:
    """Serve as the fleet's coordinator (or its standby) until cancelled."""
    log = EventLog(cfg.events_dir, name)
    store = make_store(cfg)
    control = make_control(cfg, store)
    transport = make_transport(cfg)
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
    try:
        await coordinator.serve()
    finally:
        with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
            await transport.aclose()
            await control.aclose()
            await store.close()
        log.close()
