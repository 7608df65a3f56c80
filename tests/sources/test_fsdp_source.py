"""FSDP2 / DTensor trainers as the source, in real gloo processes.

Every rank trains with FSDP2 (``fully_shard``, AdamW, fp32 master weights) and its owner reads
only its own local shards; rank 0 also hosts a receiver that gets nothing but payload bytes.
After every refit the receiver equals, bit for bit, the full (gathered) parameters cast to the
serving dtype.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from dcr.adapters.loaders.torch_module import TorchModuleLoader
from dcr.adapters.sources.fsdp import FsdpSource
from dcr.apply.applier import Applier
from dcr.delta.mapping import SubTensor, Tied
from dcr.errors import ConfigError, LayoutError
from dcr.models.compare import bit_mismatches
from dcr.models.modules import module_from_state_dict
from dcr.tensors.bits import bits
from dcr.tensors.records import Mode
from dcr.testing.trainer import apply_payloads, build_payloads, spawn

BF16 = torch.bfloat16
TIED = [("head.weight", "embed.weight")]


class Tiny(torch.nn.Module):
    """A small language model: tied embedding/head, a row count FSDP splits unevenly."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(250, 64)
        self.up = torch.nn.Linear(64, 96, bias=False)
        self.odd = torch.nn.Linear(96, 33)  # 33 rows: 17 + 16 across two ranks
        self.down = torch.nn.Linear(33, 64, bias=False)
        self.norm = torch.nn.LayerNorm(64)
        self.head = torch.nn.Linear(64, 250, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.down(torch.nn.functional.gelu(self.odd(torch.relu(self.up(h)))))
        return self.head(self.norm(h))  # type: ignore[no-any-return]


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter name (tied ones too), gathered and cast: what serving loads."""
    return {
        n: p.full_tensor().detach().to(BF16)  # type: ignore[operator]
        for n, p in model.named_parameters(remove_duplicate=False)
    }


def _receiver(dense: dict[str, torch.Tensor], source: FsdpSource) -> Applier:
    receiver = Applier(TorchModuleLoader(module_from_state_dict(dense, tied=TIED)), source.catalog)
    receiver.prewarm()
    return receiver


def _fsdp_trainer(rank: int, world: int, shared: str, steps: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Tiny()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    source = FsdpSource(model, dtype=BF16)
    group = source.training_group()
    dense = _full(model)
    receiver = _receiver(dense, source)  # every rank prewarms the same receiver: same xor set
    xor = receiver.xor_allowed()
    gen = torch.Generator().manual_seed(rank)
    out: dict[str, Any] = {"mismatches": [], "changed": [], "fraction": [], "bytes": []}
    out["keys"] = sorted(s.key for s in source.plan.shards)
    out["owners"] = {s.key: s.owner for s in source.plan.shards}
    out["held"] = sorted(source.base_shards())
    for step in range(1, steps + 1):
        tokens = torch.randint(0, 250, (4, 16), generator=gen)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 250), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        group.stage(source.candidate_shards())
        payloads, stats = build_payloads(group, attempt=step, mode=Mode.MIXED, xor_allowed=xor)
        folder = Path(shared, f"step{step}")
        folder.mkdir(exist_ok=True)
        for i, p in enumerate(payloads):
            Path(folder, f"r{rank}-{i}.bin").write_bytes(p)
        dist.barrier()
        new = _full(model)
        if rank == 0:
            received = [f.read_bytes() for f in sorted(folder.iterdir())]
            apply_payloads([receiver], source.catalog, received)
            held = dict(receiver.loader.module.named_parameters(remove_duplicate=False))
            out["mismatches"].append(bit_mismatches(held, new))
            changed = sum(
                int((bits(new[n]) != bits(dense[n])).sum()) for n in new if n != "head.weight"
            )
            total = sum(t.numel() for n, t in new.items() if n != "head.weight")
            out["fraction"].append(changed / total)
            out["bytes"].append(sum(len(f.read_bytes()) for f in folder.iterdir()))
        out["changed"].append(stats.changed_elements)
        group.commit()
        dense = new
        dist.barrier()
    return out


def test_fsdp2_trainer_refits_bit_exact(tmp_path: Path) -> None:
    results = spawn(_fsdp_trainer, 2, str(tmp_path), 3)
    head = results[0]
    # Every step moved bits and the receiver equals the gathered parameters, bit for bit.
    assert head["mismatches"] == [[], [], []]
    assert all(f > 0 for f in head["fraction"])
    assert all(b > 0 for b in head["bytes"])
    # Owners count each changed canonical element once; the tied head counts its own.
    # Shards: each parameter cut in two boxes (the odd rows 17 + 16), the plan is the same
    # everywhere, and each rank holds only its own boxes.
    assert results[0]["keys"] == results[1]["keys"]
    assert results[0]["owners"] == results[1]["owners"]
    assert "odd.weight@0,0" in head["keys"] and "odd.weight@17,0" in head["keys"]
    assert set(results[0]["held"]).isdisjoint(results[1]["held"])
    assert all(c > 0 for c in results[0]["changed"]) and all(c > 0 for c in results[1]["changed"])


def _mesh_trainer(rank: int, world: int, shared: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2))
    torch.manual_seed(0)
    placements = {
        "hsdp": (Replicate(), Shard(0)),  # replicated over mesh dim 0: two copies of each box
        "cols": (Shard(1), Replicate()),
        "grid": (Shard(0), Shard(1)),
        "cube": (Shard(2), Shard(0)),
    }
    shapes = {"hsdp": (6, 5), "cols": (4, 10), "grid": (7, 9), "cube": (5, 3, 6)}
    module = torch.nn.Module()
    for name, shape in shapes.items():
        full = torch.randn(shape).to(BF16)
        module.register_parameter(
            name, torch.nn.Parameter(distribute_tensor(full, mesh, placements[name]))
        )
    source = FsdpSource(module)
    group = source.training_group()
    dense = {n: p.full_tensor() for n, p in module.named_parameters()}  # type: ignore[operator]
    receiver = Applier(TorchModuleLoader(module_from_state_dict(dense)), source.catalog)
    receiver.prewarm()
    # An update every replica applies identically: a function of the global position.
    with torch.no_grad():
        for name, p in module.named_parameters():
            full = p.full_tensor()  # type: ignore[operator]
            step = torch.zeros_like(full)
            step.view(-1)[::3] = 0.125
            p.copy_(distribute_tensor(full + step, mesh, placements[name]))
    group.stage(source.candidate_shards())
    payloads, _ = build_payloads(
        group, attempt=1, mode=Mode.MIXED, xor_allowed=receiver.xor_allowed()
    )
    for i, p in enumerate(payloads):
        Path(shared, f"r{rank}-{i}.bin").write_bytes(p)
    dist.barrier()
    new = {n: p.full_tensor() for n, p in module.named_parameters()}  # type: ignore[operator]
    out: dict[str, Any] = {}
    if rank == 0:
        apply_payloads(
            [receiver], source.catalog, [f.read_bytes() for f in sorted(Path(shared).iterdir())]
        )
        held = dict(receiver.loader.module.named_parameters())
        out["mismatches"] = bit_mismatches(held, new)
        out["changed"] = [n for n in new if not np.array_equal(bits(new[n]), bits(dense[n]))]
        out["replicas"] = {s.key: list(s.replicas) for s in source.plan.shards}
        out["mappings"] = {s.key: type(s.mapping).__name__ for s in source.plan.shards}
    group.commit()
    return out


def test_dtensor_placements_on_a_2d_mesh(tmp_path: Path) -> None:
    (head, *_) = spawn(_mesh_trainer, 4, str(tmp_path))
    assert head["mismatches"] == []
    assert sorted(head["changed"]) == ["cols", "cube", "grid", "hsdp"]
    # Replicate() mesh dimensions make replicas: each hsdp box is held by two ranks.
    hsdp = {k: v for k, v in head["replicas"].items() if k.startswith("hsdp")}
    assert sorted(hsdp.values()) == [[0, 2], [1, 3]]
    assert all(len(v) == 1 for k, v in head["replicas"].items() if k.startswith("grid"))
    assert set(head["mappings"].values()) == {"SubTensor"}


def _refusing_trainer(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    mesh = init_device_mesh("cpu", (world,))
    module = torch.nn.Module()
    local = torch.ones(2, 3)
    module.register_parameter(
        "w", torch.nn.Parameter(DTensor.from_local(local, mesh, (Partial(),)))
    )
    out = {}
    try:
        FsdpSource(module)
    except ConfigError as exc:
        out["partial"] = exc.check
    # Ranks that disagree on what a shard is (one name, two shapes) are refused, by every rank.
    other = torch.nn.Module()
    other.register_parameter("w", torch.nn.Parameter(torch.ones(2 + rank, 3)))
    try:
        FsdpSource(other)
    except LayoutError as exc:
        out["disagree"] = exc.check
    return out


def test_placements_without_a_box_are_refused() -> None:
    results = spawn(_refusing_trainer, 2)
    assert all(r["partial"] == "placement" for r in results)
    assert all(r["disagree"] == "replicas" for r in results)


def test_subtensor_boxes_of_a_shard0_split() -> None:
    # What fully_shard gives two ranks for 33 rows: torch.chunk's 17 + 16.
    first = SubTensor("odd.weight", (33, 96), (0, 0), (17, 96))
    second = SubTensor("odd.weight", (33, 96), (17, 0), (16, 96))
    assert first.segments()[0].offset == 0 and second.segments()[0].offset == 17 * 96
    tied = Tied(SubTensor("embed.weight", (250, 64), (125, 0), (125, 64)), ("head.weight",))
    assert [d.name for d in tied.project(torch.arange(3).numpy())] == [
        "embed.weight",
        "head.weight",
    ]


@pytest.mark.parametrize("dtype", [None, BF16])
def test_fsdp_source_needs_a_process_group(dtype: torch.dtype | None) -> None:
    with pytest.raises(ConfigError, match="process group"):
        FsdpSource(Tiny(), dtype=dtype)
