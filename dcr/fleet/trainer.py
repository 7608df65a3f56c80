"""The trainer side of a fleet: one call makes a trainer rank an owner of the fleet.

A trainer joins a running fleet the way a vLLM engine does (:func:`dcr.integrations.vllm.
join_fleet`): from the fleet file alone.  Every trainer rank, after building its model and
process group::

    source = FsdpSource(model, dtype=torch.bfloat16)        # collective, every rank
    async with dcr.join_trainer(source, "fleet.toml", version=0) as trainer:
        for step in range(1, steps + 1):
            ...                                              # forward, backward, optimizer
            record = await trainer.publish()                 # returns once committed

:func:`join_trainer` builds everything else from the fleet file and the commit record: the
commit store, the control channel to the coordinator, the transport (relay tree or object
storage), the rank's training group (its tracker of the committed version) and the owner
engine.  ``publish`` stages the rank's shards of the next version, and returns the commit
record once every required receiver applied it and this rank's baseline moved to it.

**Restarting a killed rank.**  A trainer process group whose rank died is broken: every rank
restarts (as torchrun's elastic restart does, and as ``dcr fleet`` does).  Each rank then
resumes from the trainer's own checkpoint of the *committed* version -- the commit record
says which (:func:`committed_version`) -- and joins with ``version=`` that version.  A rank
whose weights are another version is refused with a :class:`~dcr.errors.ConfigError` before
it serves anything: its baseline is what joining receivers are restored from, so it must
hold exactly the committed bits.  The step that was in flight when the rank died is
recomputed and published again; no committed step is lost or applied twice.

**Owners outlive training.**  A receiver that starts or restarts is restored by a dense
refit that the owners send, so keep the ranks inside the ``async with`` block (serving) as
long as rollout engines may restart, not only until the last step committed.

Trainers that ``dcr fleet`` starts (``[trainer] kind``) get a :class:`TrainerContext`: the
fleet, the rank, the process group's rendezvous and the options of ``[trainer.options]``.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio

from dcr.adapters.commit.base import CommitStore
from dcr.adapters.security import Identity
from dcr.adapters.sources.base import Source
from dcr.adapters.transport.base import Transport
from dcr.delta.build import BuildConfig
from dcr.delta.group import LocalTrainingGroup, TrainingGroup
from dcr.engine.integration import Integration
from dcr.engine.owner import OwnerService, TrainingSide, open_owner
from dcr.errors import ConfigError
from dcr.fleet.config import FleetConfig, fleet_secret_of, load_fleet
from dcr.fleet.eventlog import EventLog, FaultPoints, install_metrics
from dcr.fleet.runtime import make_control, make_store, make_transport
from dcr.protocol.types import CommitRecord, PayloadKey
from dcr.tensors.fp8 import Fp8Scheme

__all__ = [
    "PublishReport",
    "TrainerContext",
    "TrainerRank",
    "committed_version",
    "join_trainer",
    "rendezvous_store",
    "run_trainer",
    "trainer_kind",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class PublishReport:
    """What one :meth:`TrainerRank.publish` did on this rank."""

    record: CommitRecord
    """The commit record it returned."""
    seconds: float
    """From the call until the commit and this rank's baseline update."""
    attempts: tuple[int, ...]
    """Attempts of the transition this rank built payloads for (more than one: retries)."""
    payloads: int
    payload_bytes: int
    """Payloads this rank's owner sent, over every attempt of the transition."""
    changed_elements: int
    """Canonical elements whose stored bits changed among those this rank owns."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "version": self.record.version,
            "candidate": self.record.candidate,
            "seconds": round(self.seconds, 4),
            "attempts": list(self.attempts),
            "payloads": self.payloads,
            "payload_bytes": self.payload_bytes,
            "changed_elements": self.changed_elements,
        }


class _Traffic:
    """Payloads an owner sent since :meth:`reset`, and the attempts it built for."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.payloads = 0
        self.bytes = 0
        self.attempts: list[int] = []

    def sent(self, key: PayloadKey, size: int) -> None:
        self.payloads += 1
        self.bytes += size
        if key.attempt not in self.attempts:
            self.attempts.append(key.attempt)


@dataclass(slots=True)
class TrainerRank:
    """One trainer rank joined to a fleet: its owner, serving while the block runs."""

    fleet: FleetConfig
    source: Source | TrainingGroup
    service: OwnerService
    joined: CommitRecord
    """The committed record this rank joined at (its weights' version)."""
    log: EventLog
    last: PublishReport | None = None
    """What the last :meth:`publish` did."""
    _traffic: _Traffic = field(default_factory=_Traffic)

    @property
    def name(self) -> str:
        return self.service.name

    @property
    def rank(self) -> int:
        return self.service.rank

    @property
    def committed(self) -> CommitRecord:
        """The record of the version this rank's baseline holds."""
        return self.service.core.baseline

    @property
    def group(self) -> TrainingGroup:
        return self.service.side.group

    async def publish(self, candidate: Any = None, *, donate: bool = False) -> CommitRecord:
        """Hand the next version to the fleet after the optimizer step; the one call a
        trainer makes.  Every rank calls it at the same step (staging may be collective).

        ``candidate`` is what the source turns into this rank's shards: nothing for sources
        that read the trainer's parameters (``FsdpSource``, ``MegatronSource``), the new state
        dict for a ``StateDictSource``, the shard tensors themselves for a training group.
        Returns the commit record once the version is committed and this rank's baseline
        moved to it.  ``donate=True`` lets the owner keep the shards as its baseline instead
        of copying them; the trainer must not write them again (fresh tensors each step: a
        cast, a copy from a GPU -- never views of live CPU parameters).
        """
        if isinstance(self.source, Source):
            shards = await anyio.to_thread.run_sync(self.source.candidate_shards, candidate)
        else:
            if not isinstance(candidate, Mapping):
                raise ConfigError("publish(shards): a training group takes its shard tensors")
            shards = candidate
        version = self.committed.version + 1
        self._traffic.reset()
        self.log.emit("publish", version=version, rank=self.rank)
        start = time.monotonic()
        record = await self.service.publish(shards, donate=donate)
        attempts = tuple(self._traffic.attempts)
        stats = self.service.side.stats(attempts[-1]) if attempts else None
        self.last = PublishReport(
            record=record,
            seconds=time.monotonic() - start,
            attempts=attempts,
            payloads=self._traffic.payloads,
            payload_bytes=self._traffic.bytes,
            changed_elements=stats.changed_elements if stats is not None else 0,
        )
        exchange = getattr(self.group, "exchange", None)  # the residual steps of staging
        self.log.emit("committed", **self.last.as_dict(),
                      stage_s=getattr(exchange, "seconds", 0.0))  # fmt: skip
        return record

    async def finished(self) -> None:
        """Training ended at the committed version: report ``trained`` (``dcr fleet`` stops
        the fleet once every rank did and every receiver holds that version) and keep the
        owner serving -- dense refits of receivers that restart -- until the process is
        stopped.  Never returns."""
        self.log.emit("trained", version=self.committed.version)
        await anyio.sleep_forever()


async def committed_version(fleet: str | os.PathLike[str] | FleetConfig) -> CommitRecord:
    """The commit record of the fleet: the version a (re)starting trainer resumes from."""
    cfg = fleet if isinstance(fleet, FleetConfig) else load_fleet(Path(fleet))
    store = make_store(cfg)
    try:
        return (await store.read()).record
    finally:
        await store.close()


def _group(
    source: Source | TrainingGroup, cfg: FleetConfig, build: BuildConfig, timeout_s: float
) -> TrainingGroup:
    """This process's training group: one owner rank of the fleet's trainer; in an FP8
    fleet (``[model] rollout_dtype = "fp8"``) its plan quantizes for the receivers."""
    fp8 = cfg.model.fp8
    if isinstance(source, TrainingGroup):
        group = source
    elif callable(getattr(source, "training_group", None)):
        extra = {"fp8": fp8} if fp8 is not None else {}
        group = source.training_group(config=build, timeout_s=timeout_s, **extra)  # type: ignore[attr-defined]
    else:
        plan = source.plan.with_fp8(fp8)
        if plan.layout.world_size != 1:
            raise ConfigError(
                f"this source lays out {plan.layout.world_size} training ranks in one process; "
                "a trainer process joins as one rank: use a distributed source (FsdpSource, "
                "MegatronSource) or a one-rank layout",
                check="training-group",
            )
        group = LocalTrainingGroup(plan, source.base_shards(), config=build)
    if group.plan.fp8 != fp8:

        def said(s: Fp8Scheme | None) -> str:
            return "BF16" if s is None else f"FP8 with {s.describe()} scales"

        raise ConfigError(
            f"the fleet file {cfg.path} serves {said(fp8)} ([model] rollout_dtype), the "
            f"training group's plan {said(group.plan.fp8)}: build it with "
            "build_plan(..., fp8=cfg.model.fp8) or plan.with_fp8(cfg.model.fp8)",
            check="fp8",
        )
    if len(group.ranks) != 1:
        raise ConfigError(
            f"a trainer process joins as one rank; this group hosts ranks {list(group.ranks)}",
            check="training-group",
        )
    world = group.plan.layout.world_size
    if world != cfg.world_size:
        raise ConfigError(
            f"the trainer has {world} ranks, the fleet file {cfg.path} names "
            f"{cfg.world_size} owners ({', '.join(cfg.owners)}): set [trainer] ranks = {world}",
            check="training-group",
        )
    return group


@asynccontextmanager
async def join_trainer(
    source: Source | TrainingGroup,
    fleet: str | os.PathLike[str] | FleetConfig,
    *,
    version: int,
    build: BuildConfig | None = None,
    side: Callable[[TrainingGroup, frozenset[str], EventLog], TrainingSide] | None = None,
    transport: Callable[[Transport], Transport] | None = None,
    on_sent: Callable[[PayloadKey, int], None] | None = None,
) -> AsyncIterator[TrainerRank]:
    """Make this trainer rank an owner of the fleet described by ``fleet`` for the block.

    ``source`` gives the rank's shards and their mapping metadata (``FsdpSource``,
    ``MegatronSource``, a one-rank ``StateDictSource``, a source of your own, or a training
    group); for a distributed source, building its training group is collective, so every
    rank joins at once.  ``version`` is the version the source's weights hold now: 0 for a
    fresh fleet (the checkpoint the rollout engines start from), else the committed version
    the trainer resumed from (:func:`committed_version`); a rank whose weights are not the
    committed version is refused with :class:`~dcr.errors.ConfigError`.

    Everything else comes from the fleet file: the owner's name (``o<rank>``), the commit
    store, the control channel, the transport and the construction settings of ``[trainer]``
    (``build`` overrides them).  Which tensors travel relative to their old bits is what the
    receivers' loaders prove at prewarm (bound into each attempt); the rest are overwrites.

    ``side`` and ``transport`` wrap the training side and the transport (the fleet's
    benchmark timing); ``on_sent`` is called with each payload the transport accepted.
    """
    cfg = fleet if isinstance(fleet, FleetConfig) else load_fleet(Path(fleet))
    config = build or cfg.trainer.build_config()
    async with AsyncExitStack() as stack:
        store: CommitStore = make_store(cfg)
        stack.push_async_callback(_shielded(store.close))
        record = (await store.read()).record
        if record.version != version:
            raise ConfigError(
                f"the trainer's weights are version {version}, but the fleet committed version "
                f"{record.version}: resume the trainer from its checkpoint of version "
                f"{record.version} and join with version={record.version}",
                check="version",
            )
        group = await anyio.to_thread.run_sync(
            lambda: _group(source, cfg, config, cfg.trainer.timeout_s)
        )
        (rank,) = group.ranks
        name = cfg.owners[rank]
        install_metrics(cfg, "owner", name)  # [metrics]: the rank's events as metrics
        log = EventLog(cfg.events_dir, name)
        stack.callback(log.close)
        control = make_control(cfg, store)
        stack.push_async_callback(_shielded(control.aclose))
        inner = make_transport(cfg, identity=Identity("owner", name))
        stack.push_async_callback(_shielded(inner.aclose))
        sends = transport(inner) if transport is not None else inner
        integration = Integration(
            catalog=group.catalog,
            xor_names=frozenset(),
            owner_ids=cfg.owner_ids,
        )
        traffic = _Traffic()
        # Planned faults of ``dcr fleet --faults``: the rank stops here so the launcher's
        # SIGKILL lands mid-refit (no faults file, no faults).
        faults = FaultPoints(cfg.run_dir / "faults.json", name, log)

        started = getattr(sends, "started", None)  # a timing wrapper knows when it began

        def sent(key: PayloadKey, size: int) -> None:
            traffic.sent(key, size)
            log.emit("sent", attempt=key.attempt, payload=key.payload_id, size=size,
                     start=started(key) if started is not None else None)  # fmt: skip
            if on_sent is not None:
                on_sent(key, size)
            info = service.core.attempt
            if info is not None and info.attempt == key.attempt:
                faults.reached("sent", info.base.version + 1, role="owner")

        training = (
            side(group, integration.xor_names, log)
            if side is not None
            else TrainingSide(group, integration.xor_names)
        )
        async with open_owner(
            name=name,
            rank=rank,
            side=training,
            integration=integration,
            control=control,
            transport=sends,
            store=store,
            baseline=record,
            sends_in_flight=cfg.trainer.sends_in_flight,
            on_sent=sent,
            fleet_secret=fleet_secret_of(cfg),
        ) as service:
            log.emit("started", role="owner", rank=rank, version=record.version,
                     incarnation=service.incarnation, sealed=service.fleet_secret is not None,
                     keyed=cfg.keys is not None)  # fmt: skip
            yield TrainerRank(
                fleet=cfg, source=source, service=service, joined=record, log=log,
                _traffic=traffic,
            )  # fmt: skip


def _shielded(close: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
    async def run() -> None:
        with anyio.CancelScope(shield=True):
            await close()

    return run


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerContext:
    """What ``dcr fleet`` hands a trainer rank it starts (``[trainer] kind``).

    A trainer kind is a function ``trainer(ctx)`` (or ``async def``) that trains until its
    last step, publishing each version through :func:`join_trainer`, and keeps serving
    (``await ctx.serve_forever()``) until the launcher stops it.
    """

    fleet: FleetConfig
    rank: int
    world_size: int
    options: Mapping[str, Any]
    """``[trainer.options]``: the trainer kind's own settings."""
    store_port: int | None = None
    """The launcher's rendezvous store (torch ``TCPStore``, listening on ``fleet.host``
    only: :func:`rendezvous_store`); ``None`` when the rank was started by hand
    (``MASTER_ADDR``/``MASTER_PORT`` then apply)."""

    @property
    def name(self) -> str:
        """The rank's owner name in the fleet (``o<rank>``)."""
        return self.fleet.owners[self.rank]

    @property
    def state_dir(self) -> Path:
        """Where this rank keeps its own checkpoints (``<run_dir>/trainer``)."""
        return self.fleet.run_dir / "trainer"

    def events(self) -> EventLog:
        """An event log of this rank's own (``<run_dir>/events/<name>-trainer.jsonl``)."""
        return EventLog(self.fleet.events_dir, f"{self.name}-trainer")

    def init_process_group(self, backend: str = "gloo") -> None:
        """Join the trainer's ``torch.distributed`` group: the launcher's rendezvous store
        when it started this rank, else the usual environment (``env://``)."""
        import torch.distributed as dist

        timeout = timedelta(seconds=self.fleet.trainer.timeout_s)
        if self.store_port is None:
            dist.init_process_group(
                backend, rank=self.rank, world_size=self.world_size, timeout=timeout
            )
            return
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        store = dist.TCPStore(  # type: ignore[attr-defined]
            self.fleet.host, self.store_port, self.world_size, is_master=False, timeout=timeout
        )
        dist.init_process_group(
            backend, store=store, rank=self.rank, world_size=self.world_size, timeout=timeout
        )

    async def committed(self) -> CommitRecord:
        """The fleet's commit record: the version this rank resumes from."""
        return await committed_version(self.fleet)

    @staticmethod
    async def serve_forever() -> None:
        """Keep the rank's owner serving (dense refits of restarted receivers) until the
        launcher stops the process."""
        await anyio.sleep_forever()


def rendezvous_store(host: str, world_size: int) -> Any:
    """A ``torch.distributed.TCPStore`` server (``world_size`` users, itself included) on a
    free port of ``host`` only; its ``port`` attribute is the port.

    torch's store server listens on every interface whatever its host argument; this one is
    handed a socket already bound to ``host`` (``master_listen_fd``), so on a one-host fleet
    (``127.0.0.1``) nothing outside the host can reach the trainer's rendezvous, and on
    several hosts only ``[fleet] host`` can.  Raises :class:`~dcr.errors.ConfigError` when
    ``host`` is not an address of this machine."""
    import socket

    import torch.distributed as dist

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    except OSError as exc:
        raise ConfigError(f"[fleet] host = {host!r} does not resolve: {exc}") from exc
    sock = socket.socket(family, kind, proto)
    try:
        try:
            sock.bind(address)
        except OSError as exc:
            raise ConfigError(
                f"cannot bind the trainer's rendezvous store on [fleet] host = {host!r}: {exc}; "
                "run the launcher on that host or set host to an address of this one",
                check="address",
            ) from exc
        sock.listen()
        store = dist.TCPStore(  # type: ignore[attr-defined]
            host, sock.getsockname()[1], world_size, is_master=True, wait_for_workers=False,
            master_listen_fd=sock.fileno(),
        )  # fmt: skip
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the listening socket now and closes it with itself
    return store


def trainer_kind(cfg: FleetConfig) -> Callable[[TrainerContext], Any]:
    """The function of ``[trainer] kind``: a registered trainer (``synthetic``, ``fsdp``, an
    entry point of group ``dcr.trainers``) or ``"package.module:function"``; raises
    :class:`~dcr.errors.ConfigError` naming the key and value when it cannot be loaded."""
    from dcr.adapters.registry import load_factory

    try:
        return load_factory("trainer", cfg.trainer.kind)
    except ConfigError as exc:
        raise ConfigError(f"{cfg.path}: [trainer] kind = {cfg.trainer.kind!r}: {exc}") from exc


async def run_trainer(cfg: FleetConfig, rank: int, store_port: int | None = None) -> None:
    """Run trainer rank ``rank`` of the fleet's ``[trainer] kind`` until it returns or is
    cancelled (what ``dcr owner`` runs)."""
    if not 0 <= rank < cfg.world_size:
        raise ConfigError(
            f"rank {rank} is outside the trainer's {cfg.world_size} ranks ([trainer] ranks)"
        )
    trainer = trainer_kind(cfg)
    ctx = TrainerContext(
        fleet=cfg,
        rank=rank,
        world_size=cfg.world_size,
        options=dict(cfg.trainer.options),
        store_port=store_port,
    )
    result = trainer(ctx)
    if isinstance(result, Awaitable):
        await result
