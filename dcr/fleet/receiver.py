"""``dcr receiver``: one serving rank of a rollout engine, as its own process.

What holds the rank's weights is its ``runtime`` (``[[rollout]]`` receivers): ``sharded``
(dcr's sharded serving model of the synthetic ``[model]``), ``torch`` (a torch module a
factory of yours builds, :func:`torch_runtime`), a runtime another package registered
(entry point group ``dcr.receivers``) or ``"package.module:function"`` returning a
:class:`~dcr.apply.loader.Loader` (:class:`ReceiverContext` is its argument).  An engine's
workers (runtime ``vllm``) run the same function inside the engine instead.

It starts empty, restores the committed version by a dense refit the owners send over the
transport (nothing is read from a shared filesystem) -- or, with ``[model] preloaded`` in a
fresh fleet, a sharded rank loads version 0 itself as an engine started from the first
checkpoint would --, serves it, joins at the next prepare, and then takes every refit in
place through its native loader.  Each time its storage holds a committed record exactly it
reports it (``holds`` events): digests of every parameter's bits for a sharded rank, the
fingerprint of its stored bits for other runtimes, which the launcher checks against the
versions of the synthetic trainer.  On object storage it reports each payload fetch
(``fetched``, for the refit benchmark).  A planned ``flip`` fault flips one stored bit right
after such a report (silent memory corruption), which the proof of the base version must
catch at the next prepare.

The same function runs a receiver hosted by a serving engine (a vLLM worker, see
:mod:`dcr.integrations.vllm`): the engine passes its own prewarmed receiver, the request-gate
hooks of its scheduler and, when the engine was started from the committed version's
checkpoint, the record it holds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

import anyio
import torch

from dcr.adapters.loaders.sharded import ShardedServingLoader, ShardedServingModel
from dcr.adapters.loaders.torch_module import TorchModuleLoader
from dcr.adapters.security import Identity
from dcr.apply.applier import Applier
from dcr.apply.loader import Loader
from dcr.apply.proof import receiver_proof
from dcr.catalog import read_catalog
from dcr.engine.integration import Integration
from dcr.engine.receiver import ReceiverHooks, ReceiverService
from dcr.errors import ConfigError
from dcr.fleet.checks import holds_request, proof_to_json
from dcr.fleet.config import FleetConfig, fleet_secret_of
from dcr.fleet.eventlog import NAMES_SHOWN, EventLog, FaultPoints, gate_events, install_metrics
from dcr.fleet.model import FleetModel, digests
from dcr.fleet.runtime import make_control, make_store, make_transport
from dcr.fleet.sections import ReceiverSpec
from dcr.fleet.timing import report_subscription, time_fetches
from dcr.protocol.types import CommitRecord, PayloadKey
from dcr.tensors.records import TensorSpec

__all__ = [
    "ReceiverContext",
    "sharded_runtime",
    "run_receiver",
    "runtime_receiver",
    "torch_runtime",
]


async def _preload(
    cfg: FleetConfig, model: FleetModel, rank: ShardedServingModel
) -> CommitRecord | None:
    """``[model] preloaded``: load version 0 into the empty rank through its own native loader,
    one canonical tensor at a time, while the commit record is still at version 0 (a receiver
    started later restores the committed version by dense refit); returns the record."""
    store = make_store(cfg)
    try:
        record = (await store.read()).record
    finally:
        await store.close()
    if record.version != 0:
        return None
    loader = ShardedServingLoader(rank)
    run = model.run
    await anyio.to_thread.run_sync(
        lambda: loader.load_weights(
            pair for n in model.catalog for pair in model.rollout({n: run.tensor(n, 0)}).items()
        )
    )
    return record


@dataclass(frozen=True, slots=True, kw_only=True)
class ReceiverContext:
    """What a receiver runtime (``runtime`` of a ``[[rollout]]`` receiver) is given to build
    the serving rank of receiver ``spec.name``."""

    fleet: FleetConfig
    spec: ReceiverSpec

    @property
    def options(self) -> Mapping[str, Any]:
        """The receiver's ``options`` table."""
        return self.spec.options


def sharded_runtime(ctx: ReceiverContext) -> Loader:
    """Receiver runtime ``sharded``: dcr's sharded serving rank of the synthetic trainer's
    ``[model]`` (vLLM-like fused and padded layouts), empty until restored; for benchmarks
    and tests."""
    model = FleetModel(ctx.fleet)
    return ShardedServingLoader(model.receiver_model(ctx.spec))


def torch_runtime(ctx: ReceiverContext) -> Loader:
    """Receiver runtime ``torch``: a torch module of yours, built by ``options.factory =
    "package.module:function"`` (called with the :class:`ReceiverContext`), loaded by name like
    ``load_state_dict`` (:class:`~dcr.adapters.loaders.torch_module.TorchModuleLoader`)."""
    factory = ctx.options.get("factory")
    if not isinstance(factory, str) or ":" not in factory:
        raise ConfigError(
            f"receiver {ctx.spec.name!r}: runtime 'torch' needs options.factory = "
            f"'package.module:function' returning a torch.nn.Module, got {factory!r}",
            check="runtime",
        )
    from dcr.adapters.registry import load_factory

    module = load_factory("receiver", factory)(ctx)
    if not isinstance(module, torch.nn.Module):
        raise ConfigError(
            f"receiver {ctx.spec.name!r}: {factory} returned a {type(module).__name__}, not a "
            "torch.nn.Module",
            check="runtime",
        )
    return TorchModuleLoader(module)


def runtime_receiver(cfg: FleetConfig, spec: ReceiverSpec) -> Applier:
    """The prewarmed receiver of ``spec`` built by its ``runtime``: a function of
    :class:`ReceiverContext` returning the rank's native :class:`~dcr.apply.loader.Loader`.

    The catalog is the ``[model] checkpoint``'s when the fleet names one, else the loader
    module's own parameters and buffers (a torch module's names are its checkpoint names)."""
    from dcr.adapters.registry import load_factory

    try:
        build = load_factory("receiver", spec.kind)
    except ConfigError as exc:
        raise ConfigError(f"receiver {spec.name!r}: runtime = {spec.kind!r}: {exc}") from exc
    loader = build(ReceiverContext(fleet=cfg, spec=spec))
    if not isinstance(loader, Loader):
        raise ConfigError(
            f"receiver {spec.name!r}: runtime {spec.kind!r} returned a "
            f"{type(loader).__name__}, not a dcr Loader",
            check="runtime",
        )
    if cfg.model.checkpoint is not None:
        catalog = read_catalog(cfg.model.checkpoint)
    else:
        module = loader.module
        catalog = {
            n: TensorSpec.of(n, t.detach())
            for n, t in [*module.named_parameters(), *module.named_buffers()]
        }
    receiver = Applier(loader, catalog)
    receiver.prewarm()
    return receiver


async def run_receiver(
    cfg: FleetConfig,
    name: str,
    *,
    receiver: Applier | None = None,
    hooks: ReceiverHooks | None = None,
    held: CommitRecord | None = None,
    report: Literal["digests", "fingerprint", "none"] = "digests",
    started: Callable[[ReceiverService], None] | None = None,
    fleet_secret: bytes | None = None,
) -> None:
    """Serve receiver ``name`` until cancelled.

    By default the rank is the fleet's sharded serving model, empty, restored by dense
    refit.  An engine that hosts the rank passes ``receiver`` (prewarmed, around its own
    loader), its request-gate ``hooks`` (the fleet adds its ``holds`` report to theirs) and
    ``held``, the committed record its storage already holds (``None``: restore it by dense
    refit first).  ``report`` is what ``holds`` events carry for the launcher's check:
    ``digests`` of every parameter (a sharded rank), the ``fingerprint`` of the version as
    the storage holds it (any loader's layout, :mod:`dcr.fleet.checks`), or nothing (no
    launcher checks; hashing keeps the gate closed longer).  ``started`` is told the service
    once it serves.  ``fleet_secret`` (default: the fleet's key directory's, if it names one)
    makes the receiver refuse every payload without a valid keyed seal.
    """
    spec = cfg.receiver(name)
    model = FleetModel(cfg)
    log = EventLog(cfg.events_dir, name)
    install_metrics(cfg, "receiver", name)  # [metrics]: its events as metrics
    hooks = gate_events(log, hooks)  # reports its request gate (gate-closed seconds)
    preloaded = None
    if receiver is None and spec.kind == "sharded":
        rank = model.receiver_model(spec)
        if cfg.model.preloaded and held is None:
            held = preloaded = await _preload(cfg, model, rank)
        receiver = Applier(ShardedServingLoader(rank), model.wire_catalog)
        await anyio.to_thread.run_sync(receiver.prewarm)
    elif receiver is None:
        receiver = await anyio.to_thread.run_sync(runtime_receiver, cfg, spec)
        if report == "digests":
            report = "fingerprint"  # digests compare a sharded rank's own layout
    module = receiver.loader.module
    engine_hooks = hooks if hooks is not None else ReceiverHooks()
    store = make_store(cfg)
    control = make_control(cfg, store)
    transport = make_transport(
        cfg, node=cfg.node_of(name).name, identity=Identity("receiver", name)
    )
    time_fetches(transport, log)

    async def holds(record: CommitRecord) -> None:
        if report == "digests":
            found = await anyio.to_thread.run_sync(digests, module)
            log.emit("holds", version=record.version, candidate=record.candidate, digests=found)
        elif report == "fingerprint":
            request = holds_request(record.version)
            proof = await anyio.to_thread.run_sync(receiver_proof, receiver, request)
            log.emit("holds", version=record.version, candidate=record.candidate,
                     proof=proof_to_json(proof))  # fmt: skip
        else:
            log.emit("holds", version=record.version, candidate=record.candidate)
        await anyio.to_thread.run_sync(flip_if_planned, record.version)
        await engine_hooks.holds(record)

    def flip_if_planned(version: int) -> None:
        if not faults.planned("flip", version, role="receiver"):
            return
        with torch.no_grad():
            params = [(n, p) for n, p in module.named_parameters() if p.numel()]
            name_p, p = next(((n, p) for n, p in params if "proj" in n), params[0])
            p.view(-1).view(torch.uint8)[p.element_size() - 1] ^= 0x10
        log.emit("flipped", version=version, tensor=name_p)
        faults.reached("flip", version, role="receiver")

    faults = FaultPoints(cfg.run_dir / "faults.json", name, log)
    relay = f"relay-{cfg.node_of(name).name}"  # a planned fault may strike it meanwhile

    def applied(key: PayloadKey) -> None:  # runs in the apply worker thread
        log.emit("applied", attempt=key.attempt, owner=key.owner, payload=key.payload_id)
        info = service.core.attempt
        if info is not None and info.attempt == key.attempt:
            faults.reached("applied", info.base.version + 1, role="receiver", also=(relay,))
        restoring = service.core.restoring
        if restoring is not None and service.core.dense_job == key.attempt:
            faults.reached("dense", restoring.version, role="receiver", also=(relay,))

    # What this receiver admits: its own catalog (its checkpoint's, its module's, or the
    # synthetic model's), payloads of the fleet's owners.
    integration = Integration(
        catalog=receiver.catalog,
        xor_names=model.xor_names if cfg.trainer.synthetic else frozenset(),
        owner_ids=cfg.owner_ids,
    )
    service = ReceiverService(
        name=name,
        receiver=receiver,
        integration=integration,
        control=control,
        transport=transport,
        held=held,
        queue=cfg.queue,
        hooks=replace(engine_hooks, holds=holds),
        on_applied=applied,
        fleet_secret=fleet_secret if fleet_secret is not None else fleet_secret_of(cfg),
    )
    refused = service.refused()  # its loader classification: what must travel as overwrites
    log.emit(
        "started", role="receiver", tp=spec.tp, rank=spec.rank, incarnation=service.incarnation,
        relative=None if refused is None else len(receiver.catalog) - len(refused),
        refused=None if refused is None else sorted(refused)[:NAMES_SHOWN],
        sealed=service.fleet_secret is not None, keyed=cfg.keys is not None,
    )  # fmt: skip
    if preloaded is not None:
        await holds(preloaded)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(service.serve)
            tg.start_soon(report_subscription, transport, log, name)
            if started is not None:
                started(service)
    finally:
        with anyio.CancelScope(shield=True):
            await transport.aclose()
            await control.aclose()
            await store.close()
        log.close()
