"""A trainer of a user's own for the fleet tests: FSDP2 over the fleet's trainer ranks (gloo),
a small MLP with fp32 master weights served in bf16, plain SGD on fixed seeded data.

``dcr fleet`` starts it as ``[trainer] kind = "dcr_toy_trainer:trainer"``; it joins with
:func:`dcr.join_trainer`, checkpoints its own state at every committed version
(``<run_dir>/trainer/rank<r>-v<version>.safetensors``: the rank's fp32 shards) and resumes
from the committed version's checkpoint when restarted.  Rank 0 also exports the served
(bf16) weights of every committed version (``canonical-v<version>.safetensors``) for the
test to check receivers against.  ``receiver_module`` is the receivers' ``torch`` runtime
factory: the same architecture in bf16, zeros (they restore the committed version by dense
refit).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import anyio
import torch

from dcr import join_trainer

DIMS = (24, 96, 40)


def _module(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(1234)
    model = torch.nn.Sequential(
        torch.nn.Linear(DIMS[0], DIMS[1]),
        torch.nn.GELU(),
        torch.nn.Linear(DIMS[1], DIMS[2]),
    )
    return model.to(dtype)


def receiver_module(ctx: Any) -> torch.nn.Module:
    model = _module(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def _save(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    save_file({k: t.detach().contiguous().clone() for k, t in tensors.items()}, str(tmp))
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _step(model: torch.nn.Module, rank: int, step: int, lr: float) -> None:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, DIMS[0], generator=g)
    y = torch.randn(8, DIMS[2], generator=g)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            assert p.grad is not None
            p.add_(p.grad, alpha=-lr)
            p.grad = None


async def trainer(ctx: Any) -> None:
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dcr.adapters.sources.fsdp import FsdpSource

    torch.set_num_threads(1)
    steps = int(ctx.options.get("steps", 3))
    lr = float(ctx.options.get("lr", 0.05))
    await anyio.to_thread.run_sync(ctx.init_process_group)
    model = _module(torch.float32)
    fully_shard(model, mesh=init_device_mesh("cpu", (ctx.world_size,)))
    record = await ctx.committed()
    state = ctx.state_dir
    state.mkdir(parents=True, exist_ok=True)
    if record.version > 0:  # resume from this rank's checkpoint of the committed version
        saved = load_file(str(state / f"rank{ctx.rank}-v{record.version}.safetensors"))
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.to_local().copy_(saved[name])
    source = FsdpSource(model, dtype=torch.bfloat16)
    async with join_trainer(source, ctx.fleet, version=record.version) as rank:
        for step in range(record.version + 1, steps + 1):
            await anyio.to_thread.run_sync(_step, model, ctx.rank, step, lr)
            committed = await rank.publish(donate=True)
            local = {n: p.to_local() for n, p in model.named_parameters()}
            _save(state / f"rank{ctx.rank}-v{committed.version}.safetensors", local)
            served = {n: p.full_tensor().to(torch.bfloat16) for n, p in model.named_parameters()}
            if ctx.rank == 0:
                _save(state / f"canonical-v{committed.version}.safetensors", served)
        await rank.finished()
