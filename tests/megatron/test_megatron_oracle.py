"""Megatron-Core trainers refit through Megatron-Bridge's mappings, checked against the Bridge.

Tiny Llama, Qwen3 (tied embeddings) and Qwen3-MoE models are built on CPU at TP=2, TP=2 x DP=2
and TP=2 x EP=2, one process per rank (gloo).  After every refit the receiver equals, bit for
bit, a dense load of ``AutoBridge.export_hf_weights`` of the updated model, and every changed
source element, projected by dcr, lands where the Bridge's export puts it.  Perturbing one
mapping (k and v swapped in QKV) is caught by both checks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import megatron_helpers as mh
import numpy as np
import pytest
import torch
import torch.distributed as dist

from dcr.adapters.loaders.torch_module import TorchModuleLoader
from dcr.adapters.sources.megatron import MegatronSource, _Residual
from dcr.apply.applier import Applier
from dcr.delta.mapping import AffineMapping, FusedQKV
from dcr.models.compare import bit_mismatches
from dcr.models.modules import module_from_state_dict
from dcr.tensors.bits import bits
from dcr.tensors.records import Mode
from dcr.testing.trainer import apply_payloads, build_payloads, spawn

VOCAB = 1000


class SwappedKV(MegatronSource):
    """A deliberately wrong translation: key rows projected into v_proj and back."""

    def _qkv(self, *args: Any, **kwargs: Any) -> AffineMapping:
        m = super()._qkv(*args, **kwargs)
        assert isinstance(m, FusedQKV)
        return FusedQKV(
            m.q_name, m.v_name, m.k_name, m.num_heads, m.num_kv_heads, m.head_dim, m.inner,
            m.tp_rank, m.tp_size,
        )  # fmt: skip


class NormsResidual(MegatronSource):
    """Norms and the first layer's QKV treated as not provably element-wise: they take the
    residual path (the Bridge's own collective conversion, overwrite records)."""

    def _translate(self, task: Any, config: Any, also: tuple[str, ...]) -> Any:
        name = task.global_param_name
        if name.endswith("layernorm.weight") or "layers.0.self_attention.linear_qkv" in name:
            raise _Residual("forced by the test")
        return super()._translate(task, config, also)


VARIANTS = {"plain": MegatronSource, "swap_kv": SwappedKV, "residual": NormsResidual}


def _projection_errors(
    source: MegatronSource,
    before: dict[str, torch.Tensor],
    after: dict[str, torch.Tensor],
    expected: dict[str, torch.Tensor],
) -> tuple[int, int]:
    """Changed source elements of this rank's affine shards, and how many of them land
    anywhere but where the Bridge's export holds their new bits."""
    projected = errors = 0
    for spec in source.plan.shards:
        if spec.mapping is None or spec.key not in after:
            continue
        new, old = bits(after[spec.key]).reshape(-1), bits(before[spec.key]).reshape(-1)
        changed = np.flatnonzero(new != old).astype(np.int64)
        for dest in spec.mapping.project(changed):
            local = changed if dest.select is None else changed[dest.select]
            truth = bits(expected[dest.name]).reshape(-1)[dest.indices]
            projected += local.size
            errors += int((truth != new[local]).sum())
    return projected, errors


def _trainer(
    rank: int,
    world: int,
    family: str,
    tp: int,
    ep: int,
    config_dir: str,
    shared: str,
    refits: int,
    pad: bool,
    variant: str,
) -> dict[str, Any]:
    bridge, chunks = mh.build(config_dir, tp=tp, ep=ep, pad=pad)
    source = VARIANTS[variant](chunks, bridge)
    group = source.training_group()
    dense = mh.export(bridge, chunks, VOCAB)
    receiver = Applier(TorchModuleLoader(module_from_state_dict(dense)), source.catalog)
    receiver.prewarm()
    out: dict[str, Any] = {"mismatches": [], "elements": [], "projected": 0, "errors": 0}
    out["translations"] = sorted(
        {f"{t.bridge_mapping}->{t.affine or 'residual'}" for t in source.translations}
    )
    out["residual_tasks"] = source.residual_tasks
    out["catalog_is_export"] = sorted(source.catalog) == sorted(dense)
    before = {k: t.clone() for k, t in source.candidate_shards().items()}
    for version in range(1, refits + 1):
        mh.step(chunks, version)
        candidate = source.candidate_shards()
        group.stage(candidate)
        payloads, _ = build_payloads(
            group, attempt=version, mode=Mode.MIXED, xor_allowed=receiver.xor_allowed()
        )
        folder = Path(shared, f"v{version}")
        folder.mkdir(exist_ok=True)
        for i, p in enumerate(payloads):
            Path(folder, f"r{rank}-{i}.bin").write_bytes(p)
        dist.barrier()
        expected = mh.export(bridge, chunks, VOCAB)
        projected, errors = _projection_errors(source, before, candidate, expected)
        out["projected"] += projected
        out["errors"] += errors
        if rank == 0:
            apply_payloads(
                [receiver], source.catalog, [f.read_bytes() for f in sorted(folder.iterdir())]
            )
            held = dict(receiver.loader.module.named_parameters())
            bad = bit_mismatches(held, expected)
            out["mismatches"].append(bad)
            out["elements"].append(
                sum(int((bits(held[n]) != bits(expected[n])).sum()) for n in bad)
            )
            out["changed_in_export"] = sum(
                int((bits(expected[n]) != bits(dense[n])).sum()) for n in expected
            )
        group.commit()
        before = {k: t.clone() for k, t in candidate.items()}
        dense = expected
        dist.barrier()
    return out


CASES = [
    pytest.param("qwen3", 2, 1, 2, False, id="qwen3-tp2-tied"),
    pytest.param("llama", 2, 1, 4, True, id="llama-tp2xdp2-padded-vocab"),
    pytest.param("qwen3_moe", 2, 2, 4, True, id="qwen3moe-tp2xep2-padded-vocab"),
]


@pytest.mark.parametrize(("family", "tp", "ep", "world", "pad"), CASES)
def test_receivers_equal_the_bridge_export_after_every_refit(
    tmp_path: Path, family: str, tp: int, ep: int, world: int, pad: bool
) -> None:
    config = mh.write_config(family, tmp_path / "hf", vocab=VOCAB)
    shared = tmp_path / "payloads"
    shared.mkdir()
    results = spawn(_trainer, world, family, tp, ep, config, str(shared), 2, pad, "plain")
    head = results[0]
    assert head["catalog_is_export"]
    assert head["mismatches"] == [[], []], head["elements"]
    assert all(r["errors"] == 0 for r in results)
    assert all(r["projected"] > 0 for r in results)
    assert head["residual_tasks"] == 0  # every mapping of these models is element-wise
    assert not any(t.endswith("residual") for r in results for t in r["translations"])
    kinds = {t for r in results for t in r["translations"]}
    assert {"QKVMapping->FusedQKV", "AutoMapping->RowParallel", "AutoMapping->Replicated"} <= kinds
    assert "AutoMapping->ColumnParallel" in kinds or "AutoMapping->Tied(ColumnParallel)" in kinds
    if family != "qwen3_moe":
        assert "GatedMLPMapping->GatedMLP" in kinds
    if family == "qwen3_moe":
        assert "GatedMLPMapping->PerExpert(GatedMLP)" in kinds
        assert "AutoMapping->PerExpert(RowParallel)" in kinds
    if family == "qwen3":
        assert "AutoMapping->Tied(ColumnParallel)" in kinds


def test_a_swapped_mapping_is_caught(tmp_path: Path) -> None:
    config = mh.write_config("qwen3", tmp_path / "hf", vocab=VOCAB)
    shared = tmp_path / "payloads"
    shared.mkdir()
    results = spawn(_trainer, 2, "qwen3", 2, 1, config, str(shared), 1, False, "swap_kv")
    head = results[0]
    (bad,) = head["mismatches"]
    assert bad and all("k_proj" in n or "v_proj" in n for n in bad)
    assert all(r["errors"] > 0 for r in results)


def test_residual_tensors_go_through_the_bridge_conversion(tmp_path: Path) -> None:
    config = mh.write_config("qwen3_moe", tmp_path / "hf", vocab=VOCAB)
    shared = tmp_path / "payloads"
    shared.mkdir()
    results = spawn(_trainer, 2, "qwen3_moe", 2, 1, config, str(shared), 2, False, "residual")
    head = results[0]
    assert head["residual_tasks"] > 0
    assert "QKVMapping->residual" in head["translations"]
    assert head["mismatches"] == [[], []]
    assert all(r["errors"] == 0 for r in results)
