"""Owners end to end in canonical space: detect, project, pack; applying the items to W^v gives
exactly the bits of W^{v+1} (G1 on the training side), in every mode and layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcr.delta.build import BuildConfig
from dcr.delta.group import LocalTrainingGroup
from dcr.delta.layout import ShardSpec, TrainingPlan, TrainLayout, build_plan, stable_hash
from dcr.delta.mapping import ColumnParallel, Replicated
from dcr.delta.residual import ResidualPart, ResidualTask, ScaledCast
from dcr.errors import LayoutError
from dcr.models.families import random_state_dict, tiny_config
from dcr.models.updates import apply_to_state_dict, perturb, special_patterns
from dcr.tensors.bits import bits
from dcr.tensors.records import Encoding, Item, Mode, TensorSpec

# Every test runs with the C kernels and with numpy only (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("both_paths")

XOR = BuildConfig(relative_encoding=Encoding.XOR)


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for n in a:
        assert np.array_equal(bits(a[n]), bits(b[n])), n


def catalog_of(sd: dict[str, torch.Tensor]) -> dict[str, TensorSpec]:
    return {n: TensorSpec.of(n, t) for n, t in sd.items()}


def merged(items: list[Item]) -> dict[str, tuple[list[int], list[int]]]:
    """Entries per canonical tensor, sorted by index, whichever owners/items carried them."""
    out: dict[str, list[tuple[int, int]]] = {}
    for i in items:
        out.setdefault(i.name, []).extend(zip(i.indices.tolist(), i.values.tolist(), strict=True))
    return {n: sorted(v) for n, v in out.items()}


def run(group: LocalTrainingGroup, new_shards, mode=Mode.MIXED, xor=None, full=False):
    group.stage(new_shards)
    xor_allowed = set(group.catalog) if xor is None else xor
    items: list[Item] = []
    finals = 0
    for it, _stats in group.build(
        mode=mode, xor_allowed=xor_allowed, full_conversion=full
    ).values():
        for bucket in it:
            items.extend(bucket.items)
            finals += bucket.final
    assert finals == len(group.owners)  # every owner ends with exactly one final bucket
    return items


def refit_and_check(
    family, layout, rate, seed, mode=Mode.MIXED, special=False, rounds=2, config=None
):
    cfg = tiny_config(family)
    w = random_state_dict(cfg, family, seed=seed)
    plan = build_plan(catalog_of(w), layout, family=family, config=cfg)
    group = LocalTrainingGroup(plan, plan.slice(w), config=config)
    receiver = {n: t.clone() for n, t in w.items()}
    for r in range(rounds):
        new = perturb(w, rate=rate, seed=seed * 10 + r)
        if special:
            special_patterns(new, seed=r)
        items = run(group, plan.slice(new), mode=mode)
        if mode is Mode.OVERWRITE:
            assert all(i.encoding is Encoding.OVERWRITE for i in items)
        apply_to_state_dict(receiver, items)
        same_bits(receiver, new)
        group.commit()
        w = new
    return items


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    family=st.sampled_from(["llama", "qwen3", "qwen3_moe"]),
    tp=st.sampled_from([1, 2, 4]),
    dp=st.integers(1, 2),
    ep=st.sampled_from([1, 2]),
    rate=st.sampled_from([0.0, 0.03, 0.5, 1.0]),
    mode=st.sampled_from([Mode.MIXED, Mode.OVERWRITE]),
    special=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_items_reproduce_new_bits(family, tp, dp, ep, rate, mode, special, seed):
    if family != "qwen3_moe":
        ep = 1
    refit_and_check(family, TrainLayout(tp=tp, dp=dp, ep=ep), rate, seed, mode, special)


def test_zero_change_emits_nothing_but_final_buckets():
    cfg = tiny_config("llama")
    w = random_state_dict(cfg, "llama", seed=1)
    plan = build_plan(catalog_of(w), TrainLayout(tp=2, dp=2), family="llama", config=cfg)
    group = LocalTrainingGroup(plan, plan.slice(w))
    assert run(group, plan.slice(w)) == []


def test_single_element_change_is_one_xor_entry():
    cfg = tiny_config("qwen3")
    w = random_state_dict(cfg, "qwen3", seed=2)
    new = {n: t.clone() for n, t in w.items()}
    name = "model.layers.1.self_attn.k_proj.weight"
    b = bits(new[name]).reshape(-1)
    b[77] ^= 0x0003
    plan = build_plan(catalog_of(w), TrainLayout(tp=2, dp=2), family="qwen3", config=cfg)
    group = LocalTrainingGroup(plan, plan.slice(w), config=XOR)
    items = run(group, plan.slice(new))
    assert len(items) == 1
    (item,) = items
    assert (item.name, item.encoding, item.indices.tolist(), item.values.tolist()) == (
        name,
        Encoding.XOR,
        [77],
        [3],
    )


def test_signed_zero_and_nan_payload_changes_are_detected():
    w = {"x": torch.tensor([0.0, float("nan"), 1.0, -0.0], dtype=torch.bfloat16)}
    new = {"x": w["x"].clone()}
    b = bits(new["x"])
    b[0] = 0x8000  # +0 -> -0: equal as floats
    b[1] = 0x7FC1  # another NaN payload: NaN != NaN as floats, but only bits matter
    plan = build_plan(catalog_of(w), TrainLayout())
    group = LocalTrainingGroup(plan, plan.slice(w), config=XOR)
    items = run(group, plan.slice(new))
    assert [(i.indices.tolist(), i.values.tolist()) for i in items] == [
        ([0, 1], [0x8000, 0x7FC0 ^ 0x7FC1])
    ]
    # The default ULP deltas: +0 -> -0 is one step down in the order, 0x7FC0 -> 0x7FC1 one up.
    group = LocalTrainingGroup(plan, plan.slice(w))
    items = run(group, plan.slice(new))
    assert [(i.encoding, i.indices.tolist(), i.values.tolist()) for i in items] == [
        (Encoding.ULP, [0, 1], [0xFFFF, 1])
    ]


def test_xor_only_where_allowed():
    cfg = tiny_config("llama")
    w = random_state_dict(cfg, "llama", seed=3)
    plan = build_plan(catalog_of(w), TrainLayout(tp=2), family="llama", config=cfg)
    group = LocalTrainingGroup(plan, plan.slice(w))
    new = perturb(w, rate=0.1, seed=4)
    allowed = {"model.layers.0.self_attn.q_proj.weight"}
    items = run(group, plan.slice(new), xor=allowed)
    assert {i.name for i in items if i.encoding.relative} == allowed
    receiver = {n: t.clone() for n, t in w.items()}
    apply_to_state_dict(receiver, items)
    same_bits(receiver, new)


def test_small_buckets_split_payloads_and_stay_exact():
    items = refit_and_check(
        "qwen3_moe",
        TrainLayout(tp=2, ep=2),
        0.05,
        5,
        config=BuildConfig(chunk_bytes=4096, bucket_bytes=8192),
    )
    assert items


def test_full_conversion_mode_matches_projection():
    cfg = tiny_config("qwen3_moe")
    w = random_state_dict(cfg, "qwen3_moe", seed=6)
    plan = build_plan(catalog_of(w), TrainLayout(tp=2, ep=2, dp=2), family="qwen3_moe", config=cfg)
    new = perturb(w, rate=0.03, seed=7)
    special_patterns(new, seed=1)
    g1 = LocalTrainingGroup(plan, plan.slice(w), full_conversion=True)
    f_items = run(g1, plan.slice(new), full=True)
    assert all(i.encoding is Encoding.OVERWRITE for i in f_items)
    recv = {n: t.clone() for n, t in w.items()}
    apply_to_state_dict(recv, f_items)
    same_bits(recv, new)
    g2 = LocalTrainingGroup(plan, plan.slice(w))
    p_items = run(g2, plan.slice(new), mode=Mode.OVERWRITE)
    assert merged(f_items) == merged(p_items)
    g1.commit()
    assert run(g1, plan.slice(new), full=True) == []


def scaled_plan(tp: int) -> tuple[TrainingPlan, dict[str, torch.Tensor]]:
    """Canonical ``w`` = bf16(source * scale): source sharded over tp, scale replicated."""
    layout = TrainLayout(tp=tp, dp=2)
    canon = TensorSpec(name="w", shape=(8, 6), dtype=torch.bfloat16)
    other = TensorSpec(name="b", shape=(6,), dtype=torch.bfloat16)
    world = layout.world_size
    shards = []
    parts = []
    for r in range(tp):
        reps = tuple(layout.rank(dp=d, ep=0, tp=r) for d in range(layout.dp))
        shards.append(
            ShardSpec(
                key=f"src@tp{r}",
                source_name="src",
                shape=(8 // tp, 6),
                dtype=torch.float32,
                mapping=None,
                replicas=reps,
                owner=reps[stable_hash("src") % len(reps)],
                tp_rank=r,
            )
        )
        parts.append(
            ResidualPart(
                inputs=(f"src@tp{r}", "scale"),
                placement=ColumnParallel("w", (8, 6), r, tp),
                convert=ScaledCast(torch.bfloat16),
            )
        )
    shards.append(
        ShardSpec(
            key="scale",
            source_name="scale",
            shape=(),
            dtype=torch.float32,
            mapping=None,
            replicas=tuple(range(world)),
            owner=stable_hash("scale") % world,
        )
    )
    shards.append(
        ShardSpec(
            key="b",
            source_name="b",
            shape=(6,),
            dtype=torch.bfloat16,
            mapping=Replicated("b", (6,)),
            replicas=tuple(range(world)),
            owner=stable_hash("b") % world,
        )
    )
    task = ResidualTask(
        spec=canon,
        parts=tuple(parts),
        depends_on=frozenset({*(f"src@tp{r}" for r in range(tp)), "scale"}),
    )
    plan = TrainingPlan(
        layout=layout,
        family=None,
        catalog={"w": canon, "b": other},
        shards=tuple(shards),
        residual=(task,),
    )
    gen = torch.Generator().manual_seed(0)
    src = torch.randn(8, 6, generator=gen)
    state = {f"src@tp{r}": src.chunk(tp)[r].contiguous() for r in range(tp)}
    state["scale"] = torch.tensor(1.5)
    state["b"] = torch.randn(6, generator=gen).to(torch.bfloat16)
    return plan, state


def canonical_of(state: dict[str, torch.Tensor], tp: int) -> dict[str, torch.Tensor]:
    src = torch.cat([state[f"src@tp{r}"] for r in range(tp)])
    return {"w": (src * state["scale"]).to(torch.bfloat16), "b": state["b"].clone()}


@pytest.mark.parametrize("tp", [1, 2])
def test_residual_scale_change_becomes_overwrites(tp):
    plan, state = scaled_plan(tp)
    plan.validate_coverage()
    group = LocalTrainingGroup(plan, state)
    receiver = canonical_of(state, tp)
    # 1. only the shared scale changes: every converted value may change, no source element does
    new = dict(state, scale=torch.tensor(1.25))
    items = run(group, new)
    assert {i.name for i in items} == {"w"}
    assert all(i.encoding is Encoding.OVERWRITE for i in items)
    assert sum(i.count for i in items) > 8
    apply_to_state_dict(receiver, items)
    same_bits(receiver, canonical_of(new, tp))
    group.commit()
    # 2. one source element changes: only its converted value is emitted (compared to R_u)
    src0 = new["src@tp0"].clone()
    src0[0, 0] += 1.0
    new2 = dict(new, **{"src@tp0": src0})
    items = run(group, new2)
    assert [(i.name, i.indices.tolist()) for i in items] == [("w", [0])]
    apply_to_state_dict(receiver, items)
    same_bits(receiver, canonical_of(new2, tp))
    group.commit()
    # 3. an unrelated affine change does not select the residual tensor
    new3 = dict(new2, b=(new2["b"].float() + 1).to(torch.bfloat16))
    items = run(group, new3)
    assert {i.name for i in items} == {"b"}


def test_residual_parts_must_cover_the_tensor():
    plan, state = scaled_plan(2)
    task = plan.residual[0]
    broken = ResidualTask(spec=task.spec, parts=task.parts[:1], depends_on=task.depends_on)
    bad = TrainingPlan(
        layout=plan.layout,
        family=None,
        catalog=plan.catalog,
        shards=plan.shards,
        residual=(broken,),
    )
    with pytest.raises(LayoutError):
        LocalTrainingGroup(bad, state)


@pytest.mark.parametrize("rate", [0.002, 0.05])  # scattered writes; whole-tracker copies
def test_commit_is_repeatable_and_only_after_commit_baseline_moves(
    both_paths: str, rate: float
) -> None:
    cfg = tiny_config("llama")
    w = random_state_dict(cfg, "llama", seed=8)
    plan = build_plan(catalog_of(w), TrainLayout(tp=2), family="llama", config=cfg)
    group = LocalTrainingGroup(plan, plan.slice(w))
    new = perturb(w, rate=rate, seed=9)
    first = run(group, plan.slice(new))
    # a retry before commit recomputes the same changed set from the unchanged baseline
    again = run(group, plan.slice(new))
    assert merged(first) == merged(again)
    group.commit()
    group.owners[0].commit()  # repeating the in-place update is harmless
    assert run(group, plan.slice(new)) == []


def test_donated_candidates_become_the_baseline_without_a_copy(both_paths: str) -> None:
    """``stage(..., donate=True)``: at commit the owners keep the candidate tensors themselves
    as trackers; refits stay exact, and an abort leaves the old trackers in place."""
    cfg = tiny_config("llama")
    w = random_state_dict(cfg, "llama", seed=8)
    plan = build_plan(catalog_of(w), TrainLayout(tp=2), family="llama", config=cfg)
    group = LocalTrainingGroup(plan, plan.slice(w))
    receiver = {n: t.clone() for n, t in w.items()}
    version = w
    for step in range(3):
        new = perturb(version, rate=0.03, seed=20 + step)
        shards = plan.slice(new)
        # an aborted attempt with a donated candidate: the baseline neither moves nor aliases
        group.stage(shards, donate=True)
        group.discard()
        for owner in group.owners.values():
            for key, tracker in owner.trackers.items():
                assert tracker.data_ptr() != shards[key].data_ptr()
        group.stage(shards, donate=True)
        items = []
        for it, _stats in group.build(mode=Mode.MIXED, xor_allowed=set(group.catalog)).values():
            for bucket in it:
                items.extend(bucket.items)
        apply_to_state_dict(receiver, items)
        same_bits(receiver, new)
        group.commit()
        group.owners[0].commit()  # repeatable after a donation too
        for owner in group.owners.values():
            for key, tracker in owner.trackers.items():
                assert tracker.data_ptr() == shards[key].data_ptr()
        assert run(group, plan.slice(new)) == []
        group.discard()
        version = new


def test_without_donation_the_baseline_is_a_copy_the_caller_may_overwrite() -> None:
    cfg = tiny_config("llama")
    w = random_state_dict(cfg, "llama", seed=8)
    plan = build_plan(catalog_of(w), TrainLayout(tp=2), family="llama", config=cfg)
    group = LocalTrainingGroup(plan, plan.slice(w))
    new = perturb(w, rate=0.03, seed=9)
    shards = {k: t.clone() for k, t in plan.slice(new).items()}
    run(group, shards)
    group.commit()
    for t in shards.values():
        bits(t).reshape(-1)[:] ^= 1  # the trainer steps its weights in place
    assert merged(run(group, plan.slice(new))) == {}
