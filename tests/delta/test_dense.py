"""Dense builds restore a joining receiver over the wire: every committed element as an
overwrite, through encode -> strict decode -> the receiver's native loader, onto weights that
start as garbage; afterwards every parameter bit equals a dense load of the committed version."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_dist_group import canonical_of, scaled_plan

from dcr.adapters.loaders.sharded import ShardedServingLoader
from dcr.adapters.loaders.torch_module import TorchModuleLoader
from dcr.apply.applier import Applier
from dcr.apply.loader import Loader
from dcr.delta.build import BuildConfig
from dcr.delta.group import LocalTrainingGroup, TrainingGroup
from dcr.delta.layout import TrainLayout, build_plan
from dcr.errors import DcrError
from dcr.models.compare import bit_mismatches, module_bit_mismatches
from dcr.models.families import random_state_dict, tiny_config
from dcr.models.modules import module_from_state_dict
from dcr.models.updates import perturb
from dcr.tensors.records import Encoding, Item, Mode, TensorSpec
from dcr.wire.decode import decode_payload
from dcr.wire.encode import encode_payload
from dcr.wire.format import PayloadHeader
from dcr.wire.locations import LocationKind, encode_locations

CASES = [
    ("llama", TrainLayout(tp=2, dp=2)),
    ("qwen3", TrainLayout(tp=2, dp=2)),
    ("qwen3_moe", TrainLayout(tp=2, dp=2, ep=2)),
]


def dense_payloads(group: TrainingGroup, attempt: int = 1) -> list[bytes]:
    """Every owner's dense buckets as payload bytes."""
    out = []
    for rank, (buckets, _stats) in group.build_dense().items():
        finals = 0
        for seq, bucket in enumerate(buckets):
            assert all(i.encoding is Encoding.OVERWRITE for i in bucket.items)
            header = PayloadHeader(attempt=attempt, owner=rank, payload_id=seq, final=bucket.final)
            out.append(encode_payload(header, bucket.items))
            finals += bucket.final
        assert finals == 1
    return out


def restore(receiver: Applier, payloads: list[bytes]) -> None:
    """Strictly decode and apply payloads in their declared order."""
    decoded = [
        decode_payload(p, catalog=receiver.catalog, xor_allowed=receiver.xor_allowed())
        for p in payloads
    ]
    for p in sorted(decoded, key=lambda p: p.header.order):
        receiver.apply_items(p.items, attempt=p.header.attempt)


def receivers_of(
    family: str, cfg: dict[str, object], state: dict[str, torch.Tensor]
) -> list[Loader]:
    """Serving TP 1 and 2 sharded ranks plus a plain torch module, dense-loaded from ``state``."""
    loaders: list[Loader] = [ShardedServingLoader.dense(cfg, family, state)]
    loaders += [
        ShardedServingLoader.dense(cfg, family, state, tp_size=2, tp_rank=r) for r in (0, 1)
    ]
    loaders.append(TorchModuleLoader(module_from_state_dict(state)))
    return loaders


def references(
    family: str, cfg: dict[str, object], state: dict[str, torch.Tensor]
) -> list[torch.nn.Module]:
    return [loader.module for loader in receivers_of(family, cfg, state)]


def covered_once(group: TrainingGroup) -> dict[str, int]:
    """Entries per canonical tensor over every owner's dense items (each index exactly once)."""
    seen: dict[str, list[np.ndarray]] = {}
    for buckets, _ in group.build_dense().values():
        for bucket in buckets:
            for item in bucket.items:
                seen.setdefault(item.name, []).append(item.indices)
    counts = {}
    for name, parts in seen.items():
        idx = np.sort(np.concatenate(parts))
        assert np.array_equal(idx, np.arange(group.catalog[name].numel)), name
        counts[name] = idx.size
    return counts


@pytest.mark.parametrize(("family", "layout"), CASES, ids=[c[0] for c in CASES])
def test_dense_build_restores_garbage_receivers(family: str, layout: TrainLayout) -> None:
    cfg = tiny_config(family)
    w0 = random_state_dict(cfg, family, seed=21)
    w1 = perturb(w0, rate=0.03, seed=22)
    catalog = {n: TensorSpec.of(n, t) for n, t in w0.items()}
    plan = build_plan(catalog, layout, family=family, config=cfg)
    group = LocalTrainingGroup(plan, plan.slice(w0))
    receivers = [
        Applier(loader, catalog)
        for loader in receivers_of(family, cfg, random_state_dict(cfg, family, seed=99))
    ]
    for r in receivers:
        r.prewarm()

    # A staged candidate is not the committed version: the dense build ignores it.
    group.stage(plan.slice(w1))
    payloads = dense_payloads(group)
    for r, ref in zip(receivers, references(family, cfg, w0), strict=True):
        restore(r, payloads)
        assert module_bit_mismatches(r.loader.module, ref) == []
    checkpoint = sum(s.nbytes for s in catalog.values())
    assert 0.5 * checkpoint < sum(map(len, payloads)) < 1.05 * checkpoint
    assert covered_once(group) == {n: s.numel for n, s in catalog.items()}

    # After the commit it restores the new version.
    for it, _ in group.build(mode=Mode.MIXED, xor_allowed=set(catalog)).values():
        list(it)
    group.commit()
    payloads = dense_payloads(group, attempt=2)
    for r, ref in zip(receivers, references(family, cfg, w1), strict=True):
        restore(r, payloads)
        assert module_bit_mismatches(r.loader.module, ref) == []


def test_dense_items_are_sorted_and_mostly_runs() -> None:
    cfg = tiny_config("qwen3")
    w = random_state_dict(cfg, "qwen3", seed=3)
    plan = build_plan(
        {n: TensorSpec.of(n, t) for n, t in w.items()},
        TrainLayout(tp=2),
        family="qwen3",
        config=cfg,
    )
    group = LocalTrainingGroup(plan, plan.slice(w))
    items: list[Item] = [i for it, _ in group.build_dense().values() for b in it for i in b.items]
    for item in items:
        item.validate()  # strictly increasing indices, values of the tensor's width
    kinds = [encode_locations(i.indices).kind for i in items]
    # Column splits, fused QKV/gate-up rows and whole tensors are contiguous; row splits are not.
    assert kinds.count(LocationKind.RUN) > len(items) // 2
    row_split = [
        i for i, k in zip(items, kinds, strict=True) if "o_proj" in i.name or "down_proj" in i.name
    ]
    assert row_split and all(
        encode_locations(i.indices).kind is not LocationKind.RUN for i in row_split
    )


def test_dense_buckets_do_not_change_the_records() -> None:
    cfg = tiny_config("qwen3_moe")
    w = random_state_dict(cfg, "qwen3_moe", seed=4)
    catalog = {n: TensorSpec.of(n, t) for n, t in w.items()}
    plan = build_plan(catalog, TrainLayout(tp=2, ep=2), family="qwen3_moe", config=cfg)

    def merged(group: TrainingGroup) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        parts: dict[str, list[Item]] = {}
        for buckets, _ in group.build_dense().values():
            for b in buckets:
                for i in b.items:
                    parts.setdefault(i.name, []).append(i)
        out = {}
        for name, its in parts.items():
            idx = np.concatenate([i.indices for i in its])
            val = np.concatenate([i.values for i in its])
            order = np.argsort(idx)
            out[name] = (idx[order], val[order])
        return out

    whole = merged(LocalTrainingGroup(plan, plan.slice(w)))
    small = BuildConfig(chunk_bytes=2048, bucket_bytes=4096)
    group = LocalTrainingGroup(plan, plan.slice(w), config=small)
    assert max(len(list(it)) for it, _ in group.build_dense().values()) > 3
    blocked = merged(group)
    assert whole.keys() == blocked.keys() == catalog.keys()
    for name, (idx, val) in whole.items():
        assert np.array_equal(idx, blocked[name][0]) and np.array_equal(val, blocked[name][1])


def test_owner_with_nothing_sends_one_empty_final_bucket() -> None:
    w = {"x": torch.randn(4, 4).to(torch.bfloat16)}
    plan = build_plan({"x": TensorSpec.of("x", w["x"])}, TrainLayout(dp=4))
    group = LocalTrainingGroup(plan, plan.slice(w))
    streams = {r: list(it) for r, (it, _) in group.build_dense().items()}
    owner = plan["x"].owner
    for rank, buckets in streams.items():
        assert [b.final for b in buckets] == [True]
        assert bool(buckets[0].items) == (rank == owner)


def test_commit_during_a_dense_build_fails_it() -> None:
    cfg = tiny_config("llama")
    w = random_state_dict(cfg, "llama", seed=5)
    plan = build_plan(
        {n: TensorSpec.of(n, t) for n, t in w.items()}, TrainLayout(), family="llama", config=cfg
    )
    group = LocalTrainingGroup(
        plan, plan.slice(w), config=BuildConfig(chunk_bytes=4096, bucket_bytes=8192)
    )
    ((it, _),) = group.build_dense().values()
    next(it)
    group.stage(plan.slice(perturb(w, rate=0.1, seed=6)))
    group.commit()
    with pytest.raises(DcrError) as err:
        list(it)
    assert err.value.check == "dense-stale"
    group.commit()  # repeating the commit does not move the baseline again
    assert sum(1 for _ in group.build_dense()[0][0]) > 1


def test_dense_build_restores_a_residual_tensor() -> None:
    layout = TrainLayout(tp=2, dp=2)
    plan, v0 = scaled_plan(layout)
    group = LocalTrainingGroup(plan, v0)
    garbage = {"w": torch.randn(8, 6).to(torch.bfloat16), "b": torch.randn(6).to(torch.bfloat16)}
    receiver = Applier(TorchModuleLoader(module_from_state_dict(garbage)), plan.catalog)
    receiver.prewarm()
    restore(receiver, dense_payloads(group))
    assert (
        bit_mismatches(dict(receiver.loader.module.named_parameters()), canonical_of(v0, 2)) == []
    )
    residual_owner = plan.residual_owner("w")
    w_ranks = {
        rank
        for rank, (it, _) in group.build_dense().items()
        for b in it
        for i in b.items
        if i.name == "w"
    }
    assert w_ranks == {residual_owner}
    v1 = dict(v0, scale=torch.tensor(0.75))
    group.stage(v1)
    group.commit()  # no build: the owners copy the whole candidate, residual baseline included
    restore(receiver, dense_payloads(group, attempt=2))
    assert (
        bit_mismatches(dict(receiver.loader.module.named_parameters()), canonical_of(v1, 2)) == []
    )
