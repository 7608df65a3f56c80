"""The RL trainer as ranks of a fleet (``[trainer] kind = "fsdp"``), and as ranks refitting
the engine densely (the reference).

:func:`fsdp_trainer` is what ``dcr fleet`` starts once per trainer rank: it joins the
trainer's gloo group, builds this rank's :class:`~dcr.rl.trainer.FsdpPolicy`, resumes from
its saved state of the committed version, joins the fleet as that rank's owner
(:func:`dcr.join_trainer`) and runs the RL loop (:func:`dcr.rl.loop.run_rank`) with delta
refits.  ``[trainer.options]`` is the run's :class:`~dcr.rl.loop.RunSpec`.

:func:`dense_rank` runs the same loop with dense refits: after each step the ranks write the
full checkpoint and rank 0 has the engine load it through vLLM's own loader
(``POST /dcr/load``).  ``python -m dcr.rl.fleet`` runs one such rank (``dcr rl --refit
dense`` starts them).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import anyio

from dcr.catalog import read_catalog
from dcr.errors import ConfigError
from dcr.fleet.eventlog import EventLog
from dcr.fleet.trainer import TrainerContext, TrainerRank, join_trainer
from dcr.rl.engine import EngineClient
from dcr.rl.loop import RunSpec, _Refit, restore, run_rank
from dcr.tensors.records import TensorSpec

__all__ = ["dense_rank", "fsdp_trainer", "main"]


def _rank_sum(values: list[float]) -> list[float]:
    """Every rank's ``values`` added in rank order (float64), on every rank."""
    import torch
    import torch.distributed as dist

    mine = torch.tensor(values, dtype=torch.float64)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, mine)
    total = parts[0].clone()
    for p in parts[1:]:
        total += p
    return [float(x) for x in total.tolist()]


class _DeltaRefit(_Refit):
    """Publish through dcr: the owner's shards of the next version, committed fleet-wide."""

    def __init__(self, trainer: TrainerRank, policy: Any, engine: EngineClient, rank: int):
        self.trainer, self.policy, self.engine, self.rank = trainer, policy, engine, rank

    async def publish(self, version: int) -> dict[str, Any]:
        # The shards are fresh bf16 casts of the fp32 masters: donated, never written again.
        record = await self.trainer.publish(donate=True)
        if record.version != version:
            raise ConfigError(f"published version {version}, the fleet committed {record.version}")
        last = self.trainer.last
        assert last is not None
        payload_bytes, changed = await anyio.to_thread.run_sync(
            _rank_sum, [float(last.payload_bytes), float(last.changed_elements)]
        )
        gate = None
        if self.rank == 0:
            gate = await anyio.to_thread.run_sync(self.engine.gate_closed_s, version)
        return {
            "refit_s": last.seconds,
            "gate_closed_s": gate,
            "dense_refit_s": None,
            "payload_bytes": int(payload_bytes),
            "changed_elements": int(changed),
            "attempts": len(last.attempts),
        }

    async def finished(self) -> None:
        await self.trainer.finished()


class _DenseRefit(_Refit):
    """Write the full checkpoint; the engine loads it through vLLM's own loader."""

    def __init__(self, spec: RunSpec, policy: Any, engine: EngineClient, rank: int) -> None:
        self.spec, self.policy, self.engine, self.rank = spec, policy, engine, rank
        self.directory = Path(spec.state_dir) / "dense"

    async def publish(self, version: int) -> dict[str, Any]:
        start = time.monotonic()
        target = self.directory / f"v{version:06d}"
        await anyio.to_thread.run_sync(self.policy.export_checkpoint, target)
        # What the engine serves: the checkpoint, or its FP8 export (as `dcr fp8 export`).
        fp8 = self.spec.fp8
        served = target if fp8 is None else target.with_name(target.name + "-fp8")
        result: dict[str, Any] = {}
        if self.rank == 0:
            if fp8 is not None:
                from dcr.models.fp8 import export_checkpoint

                await anyio.to_thread.run_sync(partial(export_checkpoint, target, served, fp8))
            result = await anyio.to_thread.run_sync(self.engine.load, served, version)
        seconds = time.monotonic() - start
        await anyio.to_thread.run_sync(_barrier)
        gate = None
        if self.rank == 0:
            gate = await anyio.to_thread.run_sync(self.engine.gate_closed_s, version)
        size = sum(f.stat().st_size for f in served.glob("*.safetensors"))
        return {
            "refit_s": seconds,
            "gate_closed_s": gate,
            "dense_refit_s": seconds,
            "payload_bytes": size,
            "changed_elements": None,
            "load_s": result.get("seconds"),
        }

    async def finished(self) -> None:
        return None


def _barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def _policy(spec: RunSpec) -> Any:
    """This rank's policy, built from version 0's checkpoint (collective)."""
    from dcr.rl.trainer import FsdpPolicy

    return FsdpPolicy(spec.checkpoint, spec.config)


async def fsdp_trainer(ctx: TrainerContext) -> None:
    """Trainer kind ``fsdp``: one rank of the RL loop's FSDP2 trainer, refitting by dcr."""
    spec = RunSpec.from_dict(dict(ctx.options))
    if spec.refit != "delta":
        raise ConfigError("the fsdp trainer kind refits through the fleet: refit = 'delta'")
    await anyio.to_thread.run_sync(ctx.init_process_group)
    committed = (await ctx.committed()).version
    policy = await anyio.to_thread.run_sync(_policy, spec)
    engine = EngineClient(Path(spec.engine_ready))
    log = EventLog(Path(spec.events_dir), "rl") if ctx.rank == 0 else None
    try:
        # The trainer's own checkpoint of the committed version first: the owner's baseline
        # (what restarted engines are restored from) is read from these weights.
        await restore(spec, policy, committed, log)
        source = await anyio.to_thread.run_sync(policy.source)
        async with join_trainer(source, ctx.fleet, version=committed) as trainer:
            if log is not None:
                log.emit("rl-start", version=committed, refit="delta", mode=spec.mode)
            await run_rank(
                spec,
                rank=ctx.rank,
                committed=committed,
                policy=policy,
                refit=_DeltaRefit(trainer, policy, engine, ctx.rank),
                log=log,
            )
    finally:
        if log is not None:
            log.close()


def _catalog(ctx: TrainerContext) -> Mapping[str, TensorSpec]:
    """What the ``fsdp`` trainer serves: the tensors of its version-0 checkpoint (the launcher
    checks them against every engine's before starting anything)."""
    return read_catalog(RunSpec.from_dict(dict(ctx.options)).checkpoint)


fsdp_trainer.catalog = _catalog  # type: ignore[attr-defined]


def _init_dense_group(rank: int, world: int, host: str, port: int, timeout_s: float) -> None:
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world, is_master=False, timeout=timeout)  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)


async def dense_rank(
    spec: RunSpec, *, rank: int, world: int, store_port: int, host: str = "127.0.0.1"
) -> None:
    """One rank of the RL loop refitting the engine densely (the reference run)."""
    if spec.refit != "dense":
        raise ConfigError("dense ranks refit by full checkpoints: refit = 'dense'")
    await anyio.to_thread.run_sync(_init_dense_group, rank, world, host, store_port, 600.0)
    policy = await anyio.to_thread.run_sync(_policy, spec)
    engine = EngineClient(Path(spec.engine_ready))
    log = EventLog(Path(spec.events_dir), "rl") if rank == 0 else None
    try:
        await restore(spec, policy, 0, log)
        if log is not None:
            log.emit("rl-start", version=0, refit="dense", mode=spec.mode)
        await run_rank(
            spec, rank=rank, committed=0, policy=policy,
            refit=_DenseRefit(spec, policy, engine, rank), log=log,
        )  # fmt: skip
    finally:
        if log is not None:
            log.close()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m dcr.rl.fleet --spec FILE --rank R --world W --store-port P``: one dense
    rank of ``dcr rl --refit dense``."""
    import json

    p = argparse.ArgumentParser(prog="python -m dcr.rl.fleet", description=main.__doc__)
    p.add_argument("--spec", required=True, help="the run's RunSpec as a JSON file")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--store-port", type=int, required=True)
    args = p.parse_args(argv)
    from dcr.fleet.runtime import die_with_parent

    die_with_parent()
    spec = RunSpec.from_dict(json.loads(Path(args.spec).read_text()))
    anyio.run(
        lambda: dense_rank(spec, rank=args.rank, world=args.world, store_port=args.store_port),
        backend="asyncio",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
