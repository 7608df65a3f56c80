"""The choice between sparse and dense per tensor (``BuildConfig.dense_above``): a shard changed
at least that much travels as span overwrites of everything it projects, the rest as sparse
entries, and applying the items still gives exactly the new bits, in every layout, round after
round (commit keeps the trackers right whichever way a shard went)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcr.delta import owner as owner_module
from dcr.delta.build import DENSE_ABOVE, BuildConfig, BuildStats
from dcr.delta.group import LocalTrainingGroup
from dcr.delta.layout import TrainLayout, build_plan
from dcr.errors import ConfigError
from dcr.fleet.sections import TrainerSection
from dcr.models.families import random_state_dict, tiny_config
from dcr.models.updates import apply_to_state_dict, perturb
from dcr.tensors.bits import bits
from dcr.tensors.records import Encoding, Item, Mode, TensorSpec

pytestmark = pytest.mark.usefixtures("both_paths")


@pytest.fixture
def any_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny models' tensors are below the size from which a tensor may go dense."""
    monkeypatch.setattr(owner_module, "DENSE_MIN_ELEMENTS", 0)


def _build(
    group: LocalTrainingGroup, new: dict[str, torch.Tensor], mode: Mode = Mode.MIXED
) -> tuple[list[Item], BuildStats]:
    group.stage(new)
    items: list[Item] = []
    total = BuildStats()
    for it, stats in group.build(mode=mode, xor_allowed=set(group.catalog)).values():
        for bucket in it:
            items.extend(bucket.items)
        total.merge(stats)
    return items, total


def _same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    for n in b:
        assert np.array_equal(bits(a[n]), bits(b[n])), n


def _dense_names(items: list[Item]) -> set[str]:
    return {i.name for i in items if i.span is not None}


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow,
          HealthCheck.function_scoped_fixture])  # fmt: skip
@given(
    family=st.sampled_from(["llama", "qwen3", "qwen3_moe"]),
    tp=st.sampled_from([1, 2, 4]),
    ep=st.sampled_from([1, 2]),
    rates=st.lists(st.sampled_from([0.0, 0.01, 0.2, 0.6, 1.0]), min_size=3, max_size=3),
    above=st.sampled_from([0.05, 0.3, 1.0]),
    mode=st.sampled_from([Mode.MIXED, Mode.OVERWRITE]),
    seed=st.integers(0, 2**16),
)
def test_dense_and_sparse_tensors_together_give_the_new_bits(
    any_size: None,
    family: str,
    tp: int,
    ep: int,
    rates: list[float],
    above: float,
    mode: Mode,
    seed: int,
) -> None:
    cfg = tiny_config(family)
    ep = ep if family == "qwen3_moe" else 1
    w = random_state_dict(cfg, family, seed=seed)
    catalog = {n: TensorSpec.of(n, t) for n, t in w.items()}
    plan = build_plan(catalog, TrainLayout(tp=tp, ep=ep), family=family, config=cfg)
    group = LocalTrainingGroup(plan, plan.slice(w), config=BuildConfig(dense_above=above))
    receiver = {n: t.clone() for n, t in w.items()}
    names = sorted(w)
    for r, rate in enumerate(rates):
        # Half the tensors change at ``rate``, the other half at 1%: both kinds in one refit.
        heavy = perturb(w, rate=rate, seed=seed + r, names=names[::2])
        new = perturb(heavy, rate=0.01, seed=seed + 100 + r, names=names[1::2])
        items, stats = _build(group, plan.slice(new), mode)
        for item in items:
            if item.span is not None:
                assert item.encoding is Encoding.OVERWRITE
        assert bool(stats.dense_tensors) == bool(_dense_names(items))
        if rate >= 0.6 and above <= 0.3:  # the heavy tensors' shards changed past the bound
            assert _dense_names(items) and stats.dense_elements > 0
        if above == 1.0 and rate < 1.0:
            assert not _dense_names(items)
        apply_to_state_dict(receiver, items)
        _same_bits(receiver, new)
        group.commit()
        w = new


def test_a_tensor_goes_dense_from_the_threshold_and_only_then(any_size: None) -> None:
    cfg = tiny_config("llama")
    w = random_state_dict(cfg, "llama", seed=3)
    catalog = {n: TensorSpec.of(n, t) for n, t in w.items()}
    plan = build_plan(catalog, TrainLayout(tp=2), family="llama", config=cfg)
    group = LocalTrainingGroup(plan, plan.slice(w), config=BuildConfig(dense_above=0.25))
    name = "model.layers.0.mlp.down_proj.weight"  # row parallel: spans of rows on each rank
    numel = w[name].numel()
    new = {n: t.clone() for n, t in w.items()}
    flat = bits(new[name]).reshape(-1)
    flat[: numel // 2] ^= 1  # the first half: rank 0's columns of every row change
    items, stats = _build(group, plan.slice(new))
    dense = [i for i in items if i.span is not None]
    assert {i.name for i in dense} == {name}
    # Each rank holds half the columns of every row; half the rows changed, so half of each
    # rank's shard changed (past 25%): both ranks send their whole shard, as row spans.
    assert sum(i.count for i in dense) == numel
    assert stats.dense_tensors == 2 and stats.dense_elements == numel
    receiver = {n: t.clone() for n, t in w.items()}
    apply_to_state_dict(receiver, items)
    _same_bits(receiver, new)
    group.commit()
    # Below the threshold on every shard: sparse entries again.
    newer = {n: t.clone() for n, t in new.items()}
    bits(newer[name]).reshape(-1)[:: numel // 64] ^= 2
    items, stats = _build(group, plan.slice(newer))
    assert not _dense_names(items) and stats.dense_tensors == 0
    assert {i.encoding for i in items} == {Encoding.ULP}
    apply_to_state_dict(receiver, items)
    _same_bits(receiver, newer)


def test_small_tensors_stay_sparse_whatever_the_bound() -> None:
    cfg = tiny_config("qwen3")
    w = random_state_dict(cfg, "qwen3", seed=4)
    catalog = {n: TensorSpec.of(n, t) for n, t in w.items()}
    plan = build_plan(catalog, TrainLayout(tp=2), family="qwen3", config=cfg)
    new = perturb(w, rate=1.0, seed=5)
    assert max(t.numel() for t in w.values()) < owner_module.DENSE_MIN_ELEMENTS
    for config in (BuildConfig(dense_above=0.5), BuildConfig(dense_above=0.01)):
        group = LocalTrainingGroup(plan, plan.slice(w), config=config)
        items, stats = _build(group, plan.slice(new))
        assert not _dense_names(items) and stats.dense_tensors == 0


def test_the_threshold_is_checked_and_reaches_the_fleet() -> None:
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ConfigError, match="dense_above"):
            BuildConfig(dense_above=bad)
    for bad in (-0.1, 2, True, "x"):
        with pytest.raises(ValueError, match="dense_above"):
            TrainerSection(dense_above=bad)  # type: ignore[arg-type]
    assert BuildConfig().dense_above == TrainerSection().build_config().dense_above == DENSE_ABOVE
    assert DENSE_ABOVE == 0.08
    assert TrainerSection(dense_above=0).build_config().dense_above is None  # never dense
    built = TrainerSection(dense_above=0.2, chunk_mb=1.0, build_threads=3).build_config()
    assert (built.dense_above, built.chunk_bytes, built.threads) == (0.2, 1 << 20, 3)
