"""FP8 serving ranks of the sharded reference model (``ShardedServingModel(fp8=...)``): a rank
dense-loaded with ``dcr fp8 export``'s tensors holds the quantization of its own BF16 rank
(the fused pieces are whole tiles), and owners' FP8 refits at training TP 1 or 2 bring serving
ranks at TP 1 and 2 to exactly the dense load of the next export."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest
import torch

from dcr.adapters.loaders.sharded import ShardedServingLoader, ShardedServingModel
from dcr.apply.applier import Applier
from dcr.delta.group import LocalTrainingGroup
from dcr.delta.layout import TrainLayout, build_plan
from dcr.errors import LayoutError
from dcr.models.families import random_state_dict, tiny_config
from dcr.models.fp8 import rollout_state_dict
from dcr.models.updates import perturb
from dcr.tensors.bits import bits
from dcr.tensors.fp8 import FP8_DTYPE, Fp8Scheme, quantize
from dcr.tensors.records import Mode, TensorSpec

ROW_PARALLEL = ("o_proj.weight", "down_proj.weight", "w2_weight")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and np.array_equal(bits(a), bits(b))


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("block", [8, None], ids=["block", "channel"])
def test_a_dense_fp8_load_holds_the_quantization_of_the_bf16_rank(
    family: str, tp: int, block: int | None
) -> None:
    cfg = tiny_config(family)
    sd = random_state_dict(cfg, family, seed=5)
    scheme = Fp8Scheme(block)
    fp8 = rollout_state_dict(sd, scheme)
    for rank in range(tp):
        bf16 = ShardedServingLoader.dense(cfg, family, sd, tp_size=tp, tp_rank=rank).module
        held = ShardedServingLoader.dense(cfg, family, fp8, tp_size=tp, tp_rank=rank,
                                          fp8=scheme).module.rank_tensors()  # fmt: skip
        checked = 0
        for name, t in bf16.rank_tensors().items():
            if held[name].dtype != FP8_DTYPE:
                assert _same(held[name], t), name
                continue
            scale = held[name + ("_scale_inv" if block else "_scale")]
            if block is None and tp > 1 and name.endswith(ROW_PARALLEL):
                continue  # channel scales of a column slice are the whole rows' (below)
            stacked = t.dim() == 3  # experts: one matrix each
            pieces = t.unbind(0) if stacked else [t]
            scales = scale.unbind(0) if stacked else [scale]
            values = held[name].unbind(0) if stacked else [held[name]]
            for piece, s_held, q_held in zip(pieces, scales, values, strict=True):
                q, s = quantize(piece, scheme)
                assert _same(q_held, q) and _same(s_held, s), name
                checked += 1
        assert checked > 0


def test_channel_scales_of_row_parallel_weights_are_the_whole_rows() -> None:
    cfg = tiny_config("qwen3")
    sd = random_state_dict(cfg, "qwen3", seed=6)
    scheme = Fp8Scheme(None)
    fp8 = rollout_state_dict(sd, scheme)
    name = "model.layers.0.self_attn.o_proj.weight"
    for rank in range(2):
        held = ShardedServingLoader.dense(cfg, "qwen3", fp8, tp_size=2, tp_rank=rank,
                                          fp8=scheme).module.rank_tensors()  # fmt: skip
        cols = held[name].shape[1]
        assert _same(held[name + "_scale"], fp8[name + "_scale"])
        assert _same(held[name], fp8[name][:, rank * cols : (rank + 1) * cols])


def test_fused_pieces_that_are_not_whole_tiles_are_refused() -> None:
    with pytest.raises(LayoutError, match="not whole"):
        ShardedServingModel(tiny_config("qwen3"), "qwen3", tp_size=2, fp8=Fp8Scheme(64))


def _catalog(sd: Mapping[str, torch.Tensor]) -> dict[str, TensorSpec]:
    return {n: TensorSpec.of(n, t) for n, t in sd.items()}


@pytest.mark.parametrize(("tp_train", "tp_serve", "block"),
                         [(1, 2, 8), (2, 1, 8), (2, 2, 8), (1, 2, None), (2, 2, None)])  # fmt: skip
def test_owners_refit_fp8_serving_ranks_to_the_dense_load_of_the_next_export(
    tp_train: int, tp_serve: int, block: int | None
) -> None:
    family = "qwen3_moe"
    cfg = tiny_config(family)
    scheme = Fp8Scheme(block)
    v0 = random_state_dict(cfg, family, seed=8)
    versions = [v0, perturb(v0, rate=0.03, seed=9), perturb(v0, rate=0.2, seed=10)]
    plan = build_plan(_catalog(v0), TrainLayout(tp=tp_train), family=family, config=cfg,
                      fp8=scheme)  # fmt: skip
    group = LocalTrainingGroup(plan, plan.slice(v0))
    ranks = []
    for r in range(tp_serve):
        loader = ShardedServingLoader.dense(cfg, family, rollout_state_dict(v0, scheme),
                                            tp_size=tp_serve, tp_rank=r, fp8=scheme)  # fmt: skip
        applier = Applier(loader, plan.wire_catalog)
        applier.prewarm()
        ranks.append((r, loader.module, applier))
    for v in (1, 2):
        group.stage(plan.slice(versions[v]))
        streams = group.build(mode=Mode.MIXED, xor_allowed=frozenset())
        items = [i for it, _ in streams.values() for bucket in it for i in bucket.items]
        for _, _, applier in ranks:
            applier.apply_items(items, attempt=v)
        group.commit()
        export = rollout_state_dict(versions[v], scheme)
        for r, module, _ in ranks:
            want = ShardedServingLoader.dense(cfg, family, export, tp_size=tp_serve, tp_rank=r,
                                              fp8=scheme).module.rank_tensors()  # fmt: skip
            held = module.rank_tensors()
            assert [n for n, t in want.items() if not _same(held[n], t)] == [], (v, r)
