"""Trainer kind ``synthetic``: the demo's and the benchmarks' trainer, one rank per process.

``dcr fleet`` starts it once per rank (``dcr owner --rank r``) when ``[trainer] kind`` is
``synthetic`` (the default).  The ranks form a torch.distributed process group (gloo on CPU,
rendezvous through a TCP store the launcher holds); each holds only its own shards of the
synthetic ``[model]`` (:class:`~dcr.models.synthetic.SyntheticRun`, laid out by ``[trainer]
tp``, ``ep`` and ``dp``), and step ``k`` updates about ``rate`` of the elements,
deterministically.  Each rank joins the fleet like any trainer
(:func:`~dcr.fleet.trainer.join_trainer`) and publishes every step.  Like a real trainer it
writes a checkpoint of its shards after each committed step (``<run_dir>/trainer/
o<rank>.npz``, bit patterns only; written to a temporary file, fsynced, renamed into place
and the directory fsynced), and a rank restarted after a crash resumes from it at the
committed version (replaying the steps the checkpoint is missing, at most one when it died
mid-write).  A checkpoint that cannot be read whole (torn, truncated, of another run or
layout) counts as absent: the rank says so on stderr and computes the version from scratch.

Besides ``sent`` and ``committed`` the rank reports what the refit benchmark measures
(:mod:`dcr.fleet.timing`): ``publish`` when it hands a version over, the intervals of each
bucket it built and each payload it sent, and its baseline update.  With ``[trainer]
lockstep`` it reports ``stepped`` after each optimizer step and publishes only once the
launcher says go (``<run_dir>/go.json``).
"""

from __future__ import annotations

import io
import json
import sys
import zipfile
import zlib
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import torch

from dcr.delta.dist import DistTrainingGroup
from dcr.files import atomic_write
from dcr.fleet.config import FleetConfig
from dcr.fleet.model import FleetModel
from dcr.fleet.timing import TimedSends, TimedTrainingSide
from dcr.fleet.trainer import TrainerContext, join_trainer
from dcr.models.synthetic import held_by
from dcr.tensors.bits import bits

__all__ = ["synthetic_trainer"]

LOCKSTEP_WAIT_S = 3600.0
"""Longest wait for the launcher's go in lockstep (its checks of a large model included)."""


def _optimizer_step(model: FleetModel, weights: dict[str, torch.Tensor], step: int) -> None:
    """The synthetic trainer's step ``step``: updates about ``rate`` of its elements."""
    for key, t in weights.items():
        model.run.advance_shard(model.plan[key], t, step)


def _checkpoint_path(cfg: FleetConfig, rank: int) -> Path:
    return cfg.run_dir / "trainer" / f"o{rank}.npz"


def _save_checkpoint(path: Path, version: int, weights: dict[str, torch.Tensor]) -> None:
    """Write the rank's shards at ``version`` (their bit patterns), atomically and durably:
    a temporary file, fsynced, renamed over ``path``, then the directory fsynced."""
    path.parent.mkdir(parents=True, exist_ok=True)
    keys = sorted(weights)
    arrays: dict[str, Any] = {f"t{i}": bits(weights[k]).reshape(-1) for i, k in enumerate(keys)}
    buffer = io.BytesIO()
    np.savez(buffer, version=np.array(version), keys=np.array(keys), **arrays)
    atomic_write(path, buffer.getbuffer().tobytes(), mode=0o644)


_UNREADABLE = (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile, zlib.error)
"""What reading a torn or foreign checkpoint raises (numpy, zipfile): it counts as absent."""


def _npz(loaded: Any) -> Any:
    """What ``np.load`` read, when it is an ``.npz`` archive (a bare ``.npy`` is not ours)."""
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise ValueError("not an .npz archive")
    return loaded


def _read_checkpoint(
    model: FleetModel, rank: int, version: int, path: Path
) -> tuple[int, dict[str, torch.Tensor]] | None:
    """``(its version, the rank's shards)`` of the checkpoint at ``path`` when it is one of
    this run and layout at or below ``version``; ``None`` when there is none or it cannot be
    read whole (a line on stderr says which)."""
    plan = {s.key: s for s in held_by(model.plan, rank)}
    try:
        with open(path, "rb") as raw, _npz(np.load(raw, allow_pickle=False)) as f:
            stored_version = f["version"]
            if stored_version.shape != () or stored_version.dtype.kind not in "iu":
                raise ValueError("its version is not an integer")
            start = int(stored_version)
            keys = [str(k) for k in f["keys"]]
            if start > version or set(keys) != set(plan) or len(keys) != len(plan):
                raise ValueError("a checkpoint of another run")
            shards = {}
            for i, key in enumerate(keys):
                spec = plan[key]
                t = torch.empty(spec.shape, dtype=spec.dtype)
                stored, view = f[f"t{i}"], bits(t).reshape(-1)
                if stored.dtype != view.dtype or stored.shape != view.shape:
                    raise ValueError(f"a checkpoint of another layout ({key})")
                view[:] = stored
                shards[key] = t
    except FileNotFoundError:
        return None
    except _UNREADABLE as exc:
        print(f"dcr owner o{rank}: cannot resume from the checkpoint {path} "
              f"({type(exc).__name__}: {exc}); computing version {version} from scratch "
              "instead", file=sys.stderr, flush=True)  # fmt: skip
        return None
    return start, shards


def _resume(model: FleetModel, rank: int, version: int, path: Path) -> dict[str, torch.Tensor]:
    """The rank's shards at the committed ``version``: from its checkpoint when it has one
    at or below ``version`` (the missing steps replayed), else computed from scratch."""
    found = _read_checkpoint(model, rank, version, path)
    if found is None:
        return model.run.shards(model.plan, rank, version)
    start, shards = found
    for step in range(start + 1, version + 1):
        _optimizer_step(model, shards, step)
    return shards


async def _go(cfg: FleetConfig, version: int) -> None:
    """Lockstep: wait until the launcher's ``go.json`` lets ``version`` be published."""
    path = cfg.run_dir / "go.json"
    with anyio.fail_after(LOCKSTEP_WAIT_S):
        while True:
            try:
                if int(json.loads(path.read_text())["version"]) >= version:
                    return
            except (OSError, ValueError, KeyError, TypeError):
                pass
            await anyio.sleep(0.02)


async def synthetic_trainer(ctx: TrainerContext) -> None:
    """Trainer kind ``synthetic``: run trainer rank ``ctx.rank`` of the synthetic model,
    publish every step through :func:`~dcr.fleet.trainer.join_trainer`, then keep serving
    (dense refits of joining receivers) until cancelled."""
    torch.set_num_threads(1)
    cfg, rank = ctx.fleet, ctx.rank
    model = FleetModel(cfg)
    await anyio.to_thread.run_sync(ctx.init_process_group)
    record = await ctx.committed()
    # The committed version is where a (re)started trainer resumes, from its checkpoint.
    checkpoint = _checkpoint_path(cfg, rank)
    shards = await anyio.to_thread.run_sync(_resume, model, rank, record.version, checkpoint)
    group = await anyio.to_thread.run_sync(
        lambda: DistTrainingGroup(
            model.plan, rank, shards, config=model.build, timeout_s=cfg.trainer.timeout_s
        )
    )
    async with join_trainer(
        group, cfg, version=record.version, side=TimedTrainingSide, transport=TimedSends
    ) as trainer:
        # The trainer's weights; the group copied them into its trackers.  Each step works
        # on a copy, and the published copy is donated: at commit it becomes the owner's
        # baseline instead of being copied into it, and it is never written again (two
        # copies of the shards per rank: the baseline and the next step's).
        weights, shards = shards, {}
        for step in range(record.version + 1, cfg.model.refits + 1):
            candidate = {k: t.clone() for k, t in weights.items()}
            await anyio.to_thread.run_sync(_optimizer_step, model, candidate, step)
            if cfg.trainer.lockstep:
                trainer.log.emit("stepped", version=step)
                await _go(cfg, step)
            committed = await trainer.publish(candidate, donate=True)
            weights = candidate
            if cfg.trainer.lockstep:
                group.discard()
            await anyio.to_thread.run_sync(_save_checkpoint, checkpoint, committed.version, weights)
        trainer.log.emit("trained", version=cfg.model.refits)
        await ctx.serve_forever()
