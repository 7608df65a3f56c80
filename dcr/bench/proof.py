"""Cost and detection rate of the proof of the base version (``docs/protocol.md``).

:func:`run_proof_bench` measures, on a plain bf16 model of ``size_mb`` megabytes held by one
:class:`~dcr.TorchModuleLoader` receiver, the seconds per GB of resident weights of the
sample proof and of the complete fingerprint, on each side (owners from their trackers,
the receiver from its storage); then, on the small ``qwen3`` sharded serving model served at
tensor-parallel size 2, the fraction of corrupted receivers each check catches over
``trials`` seeded trials per kind of corruption: one flipped bit, a whole other version, one
refit behind (3% of elements changed), one wrong layer.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch

from dcr.adapters.loaders.sharded import ShardedServingLoader, ShardedServingModel
from dcr.adapters.loaders.torch_module import TorchModuleLoader
from dcr.adapters.sources.state_dict import StateDictSource
from dcr.apply.applier import Applier
from dcr.apply.proof import receiver_proof
from dcr.delta.group import LocalTrainingGroup
from dcr.delta.layout import TrainLayout
from dcr.delta.proof import owner_proof
from dcr.models.families import random_state_dict, tiny_config
from dcr.models.modules import module_from_state_dict
from dcr.models.updates import perturb
from dcr.protocol.proof import ProofRequest, judge

__all__ = ["KINDS", "corrupt", "run_proof_bench"]

KINDS = ("bit", "other", "behind", "layer")


def _timed(fn: Callable[[], Any], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _cost(size_mb: int, samples: int, repeats: int) -> dict[str, float]:
    rows = 2048
    cols = 4096
    n = max(1, size_mb * (1 << 20) // (rows * cols * 2))
    gen = torch.Generator().manual_seed(0)
    sd = {
        f"layers.{i}.weight": torch.randn(rows, cols, generator=gen).to(torch.bfloat16)
        for i in range(n)
    }
    gb = sum(t.numel() * t.element_size() for t in sd.values()) / 1e9
    source = StateDictSource(sd, layout=TrainLayout(dp=1))
    group = LocalTrainingGroup(source.plan, source.base_shards())
    receiver = Applier(TorchModuleLoader(module_from_state_dict(sd)), source.catalog)
    receiver.prewarm()
    owner = group.owners[0]
    out: dict[str, float] = {"resident_gb": gb}
    for label, request in (
        ("sample", ProofRequest(seed=1, samples=samples, fingerprint=False)),
        ("fingerprint", ProofRequest(seed=1, samples=0, fingerprint=True)),
    ):
        owner_s = _timed(partial(owner_proof, owner, request), repeats)
        receiver_s = _timed(partial(receiver_proof, receiver, request), repeats)
        out[f"{label}_owner_s_per_gb"] = owner_s / gb
        out[f"{label}_receiver_s_per_gb"] = receiver_s / gb
    return out


def corrupt(
    kind: str,
    rng: random.Random,
    sd: Mapping[str, torch.Tensor],
    receivers: Mapping[str, Applier],
    cfg: Mapping[str, Any],
) -> None:
    """Corrupt the receivers' qwen3 storage in place, one of :data:`KINDS`: one flipped bit in
    one rank, a whole other version, one refit behind ``sd``, or one layer of another version."""
    with torch.no_grad():
        if kind == "bit":
            rx = receivers[rng.choice(sorted(receivers))]
            params = [p for p in rx.loader.module.parameters() if p.dtype == torch.bfloat16]
            flat = rng.choice(params).view(-1).view(torch.int16)
            flat[rng.randrange(flat.numel())] ^= 1 << rng.randrange(16)
            return
        if kind == "other":
            other = random_state_dict(dict(cfg), "qwen3", seed=10_000 + rng.randrange(10**6))
        else:
            other = perturb(sd, rate=0.03, seed=rng.randrange(10**6))
        if kind == "layer":
            layer = f"model.layers.{rng.randrange(int(cfg['num_hidden_layers']))}."
            other = {k: (other[k] if k.startswith(layer) else v) for k, v in sd.items()}
        for r in receivers.values():
            r.loader.dense_load(other)


def _detection(trials: int, samples: int) -> dict[str, dict[str, float]]:
    cfg = tiny_config("qwen3")
    sd = random_state_dict(cfg, "qwen3", seed=1)
    source = StateDictSource(sd, layout=TrainLayout(tp=2, dp=2), family="qwen3", config=cfg)
    group = LocalTrainingGroup(source.plan, source.base_shards())
    receivers: dict[str, Applier] = {}
    for rank in range(2):
        model = ShardedServingModel(cfg, "qwen3", tp_size=2, tp_rank=rank)
        loader = ShardedServingLoader(model)
        loader.dense_load(sd)
        receivers[f"r{rank}"] = rx = Applier(loader, source.catalog)
        rx.prewarm()
    out: dict[str, dict[str, float]] = {}
    for kind in KINDS:
        rng = random.Random(kind)
        hits = {"sample": 0, "fingerprint": 0}
        for trial in range(trials):
            corrupt(kind, rng, sd, receivers, cfg)
            for label, fingerprint in (("sample", False), ("fingerprint", True)):
                request = ProofRequest(
                    seed=trial, samples=0 if fingerprint else samples, fingerprint=fingerprint
                )
                owners = {f"o{k}": owner_proof(o, request) for k, o in group.owners.items()}
                ranks = {n: receiver_proof(r, request) for n, r in receivers.items()}
                hits[label] += bool(judge(request, owners, ranks).failed)
            for r in receivers.values():
                r.loader.dense_load(sd)
        out[kind] = {label: n / trials for label, n in hits.items()}
    return out


def run_proof_bench(
    *, size_mb: int = 256, samples: int = 64, trials: int = 100, repeats: int = 2
) -> dict[str, Any]:
    """``{"cost": {...seconds per GB...}, "detection": {kind: {"sample", "fingerprint"}}}``."""
    return {
        "samples": samples,
        "trials": trials,
        "cost": _cost(size_mb, samples, repeats),
        "detection": _detection(trials, samples),
    }
