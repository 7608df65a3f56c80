"""``dcr receiver``: one serving rank of a rollout engine, as its own process.

It starts empty, restores the committed version by a dense refit the owners send over the
transport (nothing is read from a shared filesystem) -- or, with ``[model] preloaded`` in a
fresh fleet, loads version 0 itself as an engine started from the first checkpoint would --,
joins at the next prepare, and then takes every refit in place through its native loader.
Each time its storage holds a committed record exactly it reports digests of every
parameter's bits (``holds`` events), which the launcher compares with a dense load of that
version.  On object storage it reports each payload fetch (``fetched``, for the refit
benchmark).  A planned ``flip`` fault
flips one stored bit right after such a report (silent memory corruption), which the proof
of the base version must catch at the next prepare.

The same function runs a receiver hosted by a serving engine (a vLLM worker, see
:mod:`dcr.integrations.vllm`): the engine passes its own prewarmed receiver, the request-gate
hooks of its scheduler and, when the engine was started from the committed version's
checkpoint, the record it holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Literal

import anyio
import torch

from dcr.adapters.loaders.reference import ShardedReferenceLoader, ShardedReferenceModel
from dcr.apply.proof import receiver_proof
from dcr.apply.receiver import Receiver
from dcr.engine.receiver import ReceiverHooks, ReceiverService
from dcr.fleet.checks import holds_request, proof_to_json
from dcr.fleet.config import FleetConfig
from dcr.fleet.events import EventLog, FaultPoints
from dcr.fleet.model import FleetModel, digests
from dcr.fleet.runtime import make_control, make_store, make_transport
from dcr.fleet.timing import time_fetches
from dcr.protocol.types import CommitRecord, PayloadKey

__all__ = ["run_receiver"]


async def _preload(
    cfg: FleetConfig, model: FleetModel, rank: ShardedReferenceModel
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
    loader = ShardedReferenceLoader(rank)
    run = model.run
    await anyio.to_thread.run_sync(
        lambda: loader.load_weights((n, run.tensor(n, 0)) for n in model.catalog)
    )
    return record


async def run_receiver(
    cfg: FleetConfig,
    name: str,
    *,
    receiver: Receiver | None = None,
    hooks: ReceiverHooks | None = None,
    held: CommitRecord | None = None,
    report: Literal["digests", "fingerprint", "none"] = "digests",
    started: Callable[[ReceiverService], None] | None = None,
) -> None:
    """Serve receiver ``name`` until cancelled.

    By default the rank is the fleet's sharded reference model, empty, restored by dense
    refit.  An engine that hosts the rank passes ``receiver`` (prewarmed, around its own
    loader), its request-gate ``hooks`` (the fleet adds its ``holds`` report to theirs) and
    ``held``, the committed record its storage already holds (``None``: restore it by dense
    refit first).  ``report`` is what ``holds`` events carry for the launcher's check:
    ``digests`` of every parameter (a reference rank), the ``fingerprint`` of the version as
    the storage holds it (any loader's layout, :mod:`dcr.fleet.checks`), or nothing (no
    launcher checks; hashing keeps the gate closed longer).  ``started`` is told the service
    once it serves.
    """
    spec = cfg.receiver(name)
    model = FleetModel(cfg)
    log = EventLog(cfg.events_dir, name)
    preloaded = None
    if receiver is None:
        rank = model.receiver_model(spec)
        if cfg.model.preloaded and held is None:
            held = preloaded = await _preload(cfg, model, rank)
        receiver = Receiver(ShardedReferenceLoader(rank), model.catalog)
        await anyio.to_thread.run_sync(receiver.prewarm)
    module = receiver.loader.module
    engine_hooks = hooks if hooks is not None else ReceiverHooks()
    store = make_store(cfg)
    control = make_control(cfg, store)
    transport = make_transport(cfg, node=cfg.node_of(name).name)
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

    service = ReceiverService(
        name=name,
        receiver=receiver,
        integration=model.integration(),
        control=control,
        transport=transport,
        held=held,
        queue=cfg.queue,
        hooks=replace(engine_hooks, holds=holds),
        on_applied=applied,
    )
    log.emit(
        "started", role="receiver", tp=spec.tp, rank=spec.rank, incarnation=service.incarnation
    )
    if preloaded is not None:
        await holds(preloaded)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(service.serve)
            if started is not None:
                started(service)
    finally:
        with anyio.CancelScope(shield=True):
            await transport.aclose()
            await control.aclose()
            await store.close()
        log.close()
