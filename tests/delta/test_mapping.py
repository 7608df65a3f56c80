"""Index math of every mapping class against an independent dense slicing of canonical tensors.

Each canonical tensor is filled with unique int64 codes (a per-name offset plus the flat
index); the layout generator slices shards with torch views (``source_blocks``), and every
shard element's projection (``project``, pure index arithmetic) must name exactly the canonical
element whose code the shard holds.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from dcr.delta.layout import TrainLayout, build_plan
from dcr.delta.mapping import (
    ColumnParallel,
    Direct,
    FusedQKV,
    GatedMLP,
    PerExpert,
    Replicated,
    RowParallel,
    Tied,
)
from dcr.errors import LayoutError
from dcr.models.families import canonical_shapes, tiny_config
from dcr.tensors.records import TensorSpec


def coded(shapes: dict[str, tuple[int, ...]]) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    sd, base, off = {}, {}, 0
    for name, shape in shapes.items():
        n = int(np.prod(shape)) if shape else 1
        sd[name] = (torch.arange(n, dtype=torch.int64) + off).reshape(shape)
        base[name] = off
        off += n + 1000
    return sd, base


def check_plan(shapes: dict[str, tuple[int, ...]], plan_kwargs: dict) -> None:
    sd, base = coded(shapes)
    catalog = {n: TensorSpec(name=n, shape=s, dtype=torch.int64) for n, s in shapes.items()}
    plan = build_plan(catalog, **plan_kwargs)
    plan.validate_coverage()
    shards = plan.slice(sd)
    hit = {n: np.zeros(int(np.prod(s)) if s else 1, dtype=np.int64) for n, s in shapes.items()}
    for spec in plan.shards:
        assert spec.mapping is not None
        local = shards[spec.key].reshape(-1).numpy()
        idx = np.arange(local.size, dtype=np.int64)
        for d in spec.mapping.project(idx):
            src = idx if d.select is None else idx[d.select]
            expect = base[d.name] + d.indices
            np.testing.assert_array_equal(local[src], expect, err_msg=f"{spec.key} -> {d.name}")
            np.add.at(hit[d.name], d.indices, 1)
        # owner is one of the replicas and replicas hold this shard's tp rank
        assert spec.owner in spec.replicas
    for name, h in hit.items():
        assert (h == 1).all(), f"{name}: projected {h.min()}..{h.max()} times"


FAMILY_LAYOUTS = [
    ("llama", dict(tp=1)),
    ("llama", dict(tp=2, dp=2)),
    ("llama", dict(tp=4)),
    ("qwen3", dict(tp=2)),
    ("qwen3", dict(tp=4, dp=2)),  # 2 kv heads < tp=4: replicated kv rows
    ("qwen3_moe", dict(tp=1, ep=2)),
    ("qwen3_moe", dict(tp=2, ep=2, dp=2)),
    ("qwen3_moe", dict(tp=4, ep=4)),
    ("qwen3_moe", dict(tp=3, ep=1)),
]


@pytest.mark.parametrize(("family", "lay"), FAMILY_LAYOUTS)
def test_family_layouts_project_every_element_once(family: str, lay: dict) -> None:
    heads = 12 if lay.get("tp") == 3 else 4
    cfg = tiny_config(family, num_attention_heads=heads, hidden_size=96 if heads == 12 else 64)
    if lay.get("tp") == 3:
        cfg.update(
            num_key_value_heads=3, intermediate_size=96, moe_intermediate_size=48, vocab_size=250
        )
    shapes = canonical_shapes(cfg, family)
    check_plan(shapes, dict(layout=TrainLayout(**lay), family=family, config=cfg))


def test_no_family_is_direct_at_tp1_and_replicated_above() -> None:
    shapes = {"a": (3, 5), "b": (7,), "c": ()}
    catalog = {n: TensorSpec(name=n, shape=s, dtype=torch.bfloat16) for n, s in shapes.items()}
    plan = build_plan(catalog, TrainLayout(tp=1, dp=3))
    assert all(type(s.mapping) is Direct for s in plan.shards)
    assert all(len(s.replicas) == 3 for s in plan.shards)
    plan2 = build_plan(catalog, TrainLayout(tp=2))
    assert all(type(s.mapping) is Replicated for s in plan2.shards)
    check_plan(shapes, dict(layout=TrainLayout(tp=2, dp=2)))


def test_owner_election_is_stable_and_spread() -> None:
    shapes = {f"t{i}": (4,) for i in range(64)}
    catalog = {n: TensorSpec(name=n, shape=s, dtype=torch.float32) for n, s in shapes.items()}
    a = build_plan(catalog, TrainLayout(dp=4))
    b = build_plan(catalog, TrainLayout(dp=4))
    assert [s.owner for s in a.shards] == [s.owner for s in b.shards]
    counts = np.bincount([s.owner for s in a.shards], minlength=4)
    assert counts.min() >= 8, counts  # a hash, not "always rank 0"


def test_tied_embedding_emits_both_destinations() -> None:
    cfg = tiny_config("qwen3")
    shapes = canonical_shapes(cfg, "qwen3")
    assert "lm_head.weight" not in shapes
    shapes["lm_head.weight"] = shapes["model.embed_tokens.weight"]
    catalog = {n: TensorSpec(name=n, shape=s, dtype=torch.int64) for n, s in shapes.items()}
    plan = build_plan(catalog, TrainLayout(tp=2), family="qwen3", config=cfg)
    emb = [s for s in plan.shards if s.source_name == "embedding.word_embeddings.weight"]
    assert all(isinstance(s.mapping, Tied) for s in emb)
    assert not any(s.source_name == "output_layer.weight" for s in plan.shards)
    hit = {
        n: np.zeros(int(np.prod(shapes[n])), dtype=np.int64)
        for n in ("model.embed_tokens.weight", "lm_head.weight")
    }
    for s in emb:
        idx = np.arange(int(np.prod(s.shape)), dtype=np.int64)
        dests = s.mapping.project(idx)
        assert [d.name for d in dests] == ["model.embed_tokens.weight", "lm_head.weight"]
        np.testing.assert_array_equal(dests[0].indices, dests[1].indices)
        for d in dests:
            np.add.at(hit[d.name], d.indices, 1)
    assert all((h == 1).all() for h in hit.values())
    plan.validate_coverage()


def test_padded_vocab_rows_are_dropped() -> None:
    m = ColumnParallel("e", (10, 3), tp_rank=1, tp_size=2, padded_rows=16)
    assert m.source_shape == (8, 3)
    idx = np.arange(24, dtype=np.int64)
    (d,) = m.project(idx)
    # rank 1 holds padded rows 8..15; only rows 8, 9 exist
    np.testing.assert_array_equal(d.indices, np.arange(24, 30))
    np.testing.assert_array_equal(d.select, np.arange(6))
    m3 = ColumnParallel("e", (10, 3), tp_rank=3, tp_size=4, padded_rows=16)
    assert m3.project(np.arange(12, dtype=np.int64)) == []


def test_hand_checked_qkv_permutation() -> None:
    # 4 query heads, 2 groups, head_dim 1, one column: Megatron rows per group [q, q, k, v]
    m = FusedQKV(
        "q", "k", "v", num_heads=4, num_kv_heads=2, head_dim=1, inner=(), tp_rank=0, tp_size=1
    )
    got = {d.name: (d.indices.tolist(), d.select.tolist()) for d in m.project(np.arange(8))}
    assert got == {"q": ([0, 1, 2, 3], [0, 1, 4, 5]), "k": ([0, 1], [2, 6]), "v": ([0, 1], [3, 7])}
    # groups < tp: 4 ranks, 2 groups; rank 1 replicates group 0's kv and must not project it
    r1 = FusedQKV(
        "q", "k", "v", num_heads=4, num_kv_heads=2, head_dim=1, inner=(), tp_rank=1, tp_size=4
    )
    assert r1.source_shape == (3,)
    assert [(d.name, d.indices.tolist()) for d in r1.project(np.arange(3))] == [("q", [1])]
    r2 = FusedQKV(
        "q", "k", "v", num_heads=4, num_kv_heads=2, head_dim=1, inner=(), tp_rank=2, tp_size=4
    )
    assert [(d.name, d.indices.tolist()) for d in r2.project(np.arange(3))] == [
        ("q", [2]),
        ("k", [1]),
        ("v", [1]),
    ]


def test_gated_row_and_expert_index_math() -> None:
    g = GatedMLP("gate", "up", (4, 2), tp_rank=1, tp_size=2)
    got = {d.name: d.indices.tolist() for d in g.project(np.arange(8))}
    assert got == {"gate": [4, 5, 6, 7], "up": [4, 5, 6, 7]}
    r = RowParallel("o", (2, 4), tp_rank=1, tp_size=2)
    assert r.project(np.arange(4))[0].indices.tolist() == [2, 3, 6, 7]
    assert PerExpert.global_index(ep_rank=2, ep_size=4, num_experts=8, local_index=1) == 5
    with pytest.raises(LayoutError):
        PerExpert.global_index(ep_rank=0, ep_size=4, num_experts=8, local_index=2)


def test_bad_layouts_raise_typed_errors() -> None:
    cfg = tiny_config("llama")
    catalog = {
        n: TensorSpec(name=n, shape=s, dtype=torch.bfloat16)
        for n, s in canonical_shapes(cfg, "llama").items()
    }
    with pytest.raises(LayoutError):
        build_plan(catalog, TrainLayout(tp=3), family="llama", config=cfg)  # 4 heads / 3
    with pytest.raises(LayoutError):
        build_plan(catalog, TrainLayout(ep=2), family="llama", config=cfg)  # no experts
    with pytest.raises(LayoutError):
        build_plan(catalog, TrainLayout(ep=2))


@pytest.mark.parametrize(("tp", "rank"), list(itertools.product([1, 2, 4], range(4))))
def test_project_accepts_any_order_and_subsets(tp: int, rank: int) -> None:
    if rank >= tp:
        return
    m = FusedQKV(
        "q", "k", "v", num_heads=8, num_kv_heads=4, head_dim=2, inner=(3,), tp_rank=rank, tp_size=tp
    )
    full = {
        d.name: dict(
            zip(
                (d.select if d.select is not None else np.arange(m.numel)).tolist(),
                d.indices.tolist(),
                strict=True,
            )
        )
        for d in m.project(np.arange(m.numel, dtype=np.int64))
    }
    rng = np.random.default_rng(rank)
    sub = rng.permutation(m.numel)[: m.numel // 3].astype(np.int64)
    for d in m.project(sub):
        pos = sub if d.select is None else sub[d.select]
        assert [full[d.name][p] for p in pos.tolist()] == d.indices.tolist()
