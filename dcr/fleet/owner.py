"""``dcr owner``: one trainer rank and its owner, as its own process.

The trainer ranks form a torch.distributed process group (gloo on CPU, rendezvous through a
TCP store the launcher holds); each holds only its own shards.  After each optimizer step the
rank hands the new version to its owner with one call (:meth:`OwnerService.publish`), which
returns once the version is committed and the owner's baseline moved to it.  The residual
change-flag OR-reduce and the residual gather run in the trainer's own group
(:class:`~dcr.delta.dist.DistTrainingGroup`).

The demo trainer is synthetic (:class:`~dcr.testing.synthetic.SyntheticRun`): step ``k``
updates about ``rate`` of the elements, deterministically, so a trainer restarted after a
crash resumes at the committed version exactly as a real one would from its checkpoint.
"""

from __future__ import annotations

import os
from datetime import timedelta

import anyio
import torch
import torch.distributed as dist

from dcr.delta.dist import DistTrainingGroup
from dcr.engine.owner import OwnerService, TrainingSide, open_owner
from dcr.fleet.config import FleetConfig
from dcr.fleet.events import EventLog, FaultPoints
from dcr.fleet.model import FleetModel
from dcr.fleet.runtime import make_control, make_store, make_transport
from dcr.protocol.types import PayloadKey

__all__ = ["run_owner"]


def _join_trainer(cfg: FleetConfig, rank: int, store_port: int) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    timeout = timedelta(seconds=cfg.trainer.timeout_s)
    store = dist.TCPStore(  # type: ignore[attr-defined]
        cfg.host, store_port, cfg.world_size, is_master=False, timeout=timeout
    )
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=cfg.world_size, timeout=timeout
    )


def _optimizer_step(model: FleetModel, weights: dict[str, torch.Tensor], step: int) -> None:
    """The synthetic trainer's step ``step``: updates about ``rate`` of its elements."""
    for key, t in weights.items():
        model.run.advance_shard(model.plan[key], t, step)


async def run_owner(cfg: FleetConfig, rank: int, store_port: int) -> None:
    """Run trainer rank ``rank`` and its owner: publish every step, then keep serving (dense
    refits of joining receivers) until cancelled."""
    torch.set_num_threads(1)
    name = f"o{rank}"
    log = EventLog(cfg.events_dir, name)
    model = FleetModel(cfg)
    store = make_store(cfg)
    control = make_control(cfg, store)
    transport = make_transport(cfg)
    try:
        await anyio.to_thread.run_sync(_join_trainer, cfg, rank, store_port)
        record = (await store.read()).record
        # The committed version is where a (re)started trainer resumes, as from a checkpoint.
        shards = await anyio.to_thread.run_sync(model.run.shards, model.plan, rank, record.version)
        group = await anyio.to_thread.run_sync(
            lambda: DistTrainingGroup(
                model.plan, rank, shards, config=model.build, timeout_s=cfg.trainer.timeout_s
            )
        )
        integration = model.integration()
        traffic = {"payloads": 0, "bytes": 0}
        faults = FaultPoints(cfg.run_dir / "faults.json", name, log)

        def on_sent(key: PayloadKey, size: int) -> None:
            traffic["payloads"] += 1
            traffic["bytes"] += size
            log.emit("sent", attempt=key.attempt, payload=key.payload_id, size=size)
            info = service.core.attempt
            if info is not None and info.attempt == key.attempt:
                faults.reached("sent", info.base.version + 1, role="owner")

        service = OwnerService(
            name=name,
            rank=rank,
            side=TrainingSide(group, integration.xor_names),
            integration=integration,
            control=control,
            transport=transport,
            store=store,
            baseline=record,
            sends_in_flight=cfg.trainer.sends_in_flight,
            on_sent=on_sent,
        )
        log.emit("started", role="owner", rank=rank, version=record.version,
                 incarnation=service.incarnation)  # fmt: skip
        async with open_owner(service):
            weights = {k: t.clone() for k, t in shards.items()}  # the trainer's own copy
            for step in range(record.version + 1, cfg.model.refits + 1):
                await anyio.to_thread.run_sync(_optimizer_step, model, weights, step)
                candidate = {k: t.clone() for k, t in weights.items()}
                traffic.update(payloads=0, bytes=0)
                committed = await service.publish(candidate)
                log.emit(
                    "committed",
                    version=committed.version,
                    candidate=committed.candidate,
                    payload_bytes=traffic["bytes"],
                    payloads=traffic["payloads"],
                )
            log.emit("trained", version=cfg.model.refits)
            await anyio.sleep_forever()
    finally:
        with anyio.CancelScope(shield=True):
            await transport.aclose()
            await control.aclose()
            await store.close()
        log.close()
