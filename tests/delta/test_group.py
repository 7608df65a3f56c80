"""The TrainingGroup seam as LocalTrainingGroup implements it: hosted ranks, per-rank commits,
residual jobs chosen at stage and carried by commit, full conversion with residual tasks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_dist_group import canonical_of, scaled_plan

from dcr.delta.group import LocalTrainingGroup, TrainingGroup
from dcr.delta.layout import TrainLayout
from dcr.errors import ConfigError
from dcr.models.updates import apply_to_state_dict
from dcr.tensors.bits import bits
from dcr.tensors.records import Encoding, Item, Mode

LAYOUT = TrainLayout(tp=2, dp=2)


def items_of(group: LocalTrainingGroup, full_conversion: bool = False) -> list[Item]:
    streams = group.build(
        mode=Mode.MIXED, xor_allowed=set(group.catalog), full_conversion=full_conversion
    )
    return [i for it, _ in streams.values() for b in it for i in b.items]


def baseline_bits(group: LocalTrainingGroup) -> dict[str, np.ndarray]:
    out = {}
    for owner in group.owners.values():
        out.update({k: bits(t).copy() for k, t in owner.trackers.items()})
        out.update({f"R:{k}": bits(t).copy() for k, t in owner.residual_baseline.items()})
    return out


def test_local_group_hosts_every_rank() -> None:
    plan, v0 = scaled_plan(LAYOUT)
    group = LocalTrainingGroup(plan, v0)
    assert isinstance(group, TrainingGroup)
    assert group.ranks == tuple(range(LAYOUT.world_size))
    assert group.failure is None
    group.check()
    assert group.owner(1) is group.owners[1]
    with pytest.raises(ConfigError):
        group.owner(LAYOUT.world_size)
    with pytest.raises(ConfigError):
        group.build(mode=Mode.MIXED, xor_allowed=())


@pytest.mark.parametrize("build_first", [True, False])
def test_commit_per_rank_equals_commit_of_all(build_first: bool) -> None:
    plan, v0 = scaled_plan(LAYOUT)
    v1 = dict(v0, scale=torch.tensor(1.25), b=(v0["b"].float() - 1).to(torch.bfloat16))
    whole, per_rank = LocalTrainingGroup(plan, v0), LocalTrainingGroup(plan, v0)
    for group in (whole, per_rank):
        group.stage(v1)
        if build_first:
            assert {i.name for i in items_of(group)} == {"w", "b"}
    whole.commit()
    for rank in per_rank.ranks:
        per_rank.commit(rank)
        per_rank.commit(rank)  # repeatable
    assert per_rank.staged is v1 and whole.staged is None
    a, b = baseline_bits(whole), baseline_bits(per_rank)
    assert a.keys() == b.keys()
    assert all(np.array_equal(a[k], b[k]) for k in a)
    # Even without a build, the commit moved the residual baseline with the trackers.
    owner = whole.owners[plan.residual_owner("w")]
    assert np.array_equal(bits(owner.residual_baseline["w"]), bits(canonical_of(v1, 2)["w"]))
    per_rank.stage(v1)
    assert items_of(per_rank) == []


def test_full_conversion_covers_residual_tasks() -> None:
    plan, v0 = scaled_plan(LAYOUT)
    v1 = dict(v0, scale=torch.tensor(0.5))
    group = LocalTrainingGroup(plan, v0, full_conversion=True)
    group.stage(v1)
    items = items_of(group, full_conversion=True)
    assert {i.name for i in items} == {"w"}
    assert all(i.encoding is Encoding.OVERWRITE for i in items)
    receiver = canonical_of(v0, 2)
    apply_to_state_dict(receiver, items)
    expected = canonical_of(v1, 2)
    assert all(np.array_equal(bits(receiver[n]), bits(expected[n])) for n in expected)
    assert group.export(v1).keys() == expected.keys()
    assert all(np.array_equal(bits(group.export(v1)[n]), bits(expected[n])) for n in expected)


def test_restarted_residual_owner_rejoins_the_transition() -> None:
    plan, v0 = scaled_plan(LAYOUT)
    v1 = dict(v0, scale=torch.tensor(1.75))
    steady, restarted = LocalTrainingGroup(plan, v0), LocalTrainingGroup(plan, v0)
    for group in (steady, restarted):
        group.stage(v1)
    rank = plan.residual_owner("w")
    fresh = restarted.restart(rank, v0)
    assert restarted.owner(rank) is fresh and "w" in fresh.residual_baseline
    expected, got = items_of(steady), items_of(restarted)
    assert [(i.name, i.indices.tolist(), i.values.tolist()) for i in got] == [
        (i.name, i.indices.tolist(), i.values.tolist()) for i in expected
    ]
    restarted.commit()
    restarted.stage(v1)
    assert items_of(restarted) == []
