"""FP8 rollouts built by a BF16 trainer's owners (``build_plan(fp8=...)``): each owner scans its
BF16 shards, re-quantizes only the tiles of its region that changed, and sends the FP8 values
and scales that changed; a receiver holding the FP8 checkpoint then holds exactly the bits of
``dcr fp8 export`` of each version -- for three families, TP 1 and 2, block and channel
scales, retried attempts, commits that no build reached, and dense builds for joining
receivers.  Layouts whose shards cut through tiles are refused when the plan is built."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
import torch

from dcr.adapters.loaders.torch_module import TorchModuleLoader
from dcr.apply.applier import Applier
from dcr.apply.proof import receiver_proof
from dcr.delta.build import BuildConfig, BuildStats
from dcr.delta.group import BucketStreams, LocalTrainingGroup
from dcr.delta.layout import TrainLayout, build_plan
from dcr.delta.proof import owner_proof
from dcr.errors import LayoutError
from dcr.models.families import canonical_shapes, random_state_dict, tiny_config
from dcr.models.fp8 import rollout_state_dict
from dcr.models.modules import module_from_state_dict
from dcr.models.updates import adamw_update, perturb
from dcr.protocol.proof import ProofRequest, judge
from dcr.tensors.bits import bits
from dcr.tensors.fp8 import Fp8Scheme
from dcr.tensors.records import Encoding, Item, Mode, TensorSpec
from dcr.testing.fp8 import grow_first_row_max

CASES = [
    (family, tp, block)
    for family in ("llama", "qwen3", "qwen3_moe")
    for tp, block in ((1, 16), (1, None), (2, 16), (2, None))
]
"""At TP 2, qwen3_moe's experts are 24 rows per rank: their 16x16 tiles are cut, and shared by
the two ranks (as the row-parallel weights' rows are under channel scales)."""


def _catalog(sd: Mapping[str, torch.Tensor]) -> dict[str, TensorSpec]:
    return {n: TensorSpec.of(n, t) for n, t in sd.items()}


def _versions(family: str) -> list[dict[str, torch.Tensor]]:
    cfg = tiny_config(family)
    v0 = random_state_dict(cfg, family, seed=21)
    v1 = grow_first_row_max(perturb(v0, rate=0.03, seed=22))  # first rows' scales move
    v2 = adamw_update(v1, lr=1e-4, seed=23)
    v3 = perturb(v2, rate=0.01, seed=24)
    return [v0, v1, v2, v3]


def _receiver(
    fp8: Mapping[str, torch.Tensor], scheme: Fp8Scheme
) -> tuple[torch.nn.Module, Applier]:
    scales = [n for n in fp8 if n.endswith(scheme.scale_name(""))]
    module = module_from_state_dict(fp8, buffers=scales)
    applier = Applier(TorchModuleLoader(module), _catalog(fp8))
    applier.prewarm()
    return module, applier


def _mismatches(module: torch.nn.Module, reference: Mapping[str, torch.Tensor]) -> list[str]:
    held = dict(module.named_parameters())
    held.update(module.named_buffers())
    return [n for n, t in reference.items()
            if held[n].dtype != t.dtype or not np.array_equal(bits(held[n]), bits(t))]  # fmt: skip


def _items(streams: BucketStreams) -> tuple[list[Item], BuildStats]:
    items: list[Item] = []
    total = BuildStats()
    for it, stats in streams.values():
        for bucket in it:
            items += bucket.items
        total.merge(stats)
    return items, total


@pytest.mark.parametrize(("family", "tp", "block"), CASES)
def test_owners_refit_an_fp8_receiver_to_the_export_of_every_version(
    family: str, tp: int, block: int | None
) -> None:
    scheme = Fp8Scheme(block)
    versions = _versions(family)
    plan = build_plan(_catalog(versions[0]), TrainLayout(tp=tp), family=family,
                      config=tiny_config(family), fp8=scheme)  # fmt: skip
    exports = [rollout_state_dict(v, scheme) for v in versions]
    assert plan.wire_catalog == _catalog(exports[0])
    group = LocalTrainingGroup(plan, plan.slice(versions[0]))
    module, receiver = _receiver(exports[0], scheme)
    for v in range(1, len(versions)):
        assert _mismatches(module, exports[v]), "the versions must differ"
        group.stage(plan.slice(versions[v]))
        items, stats = _items(group.build(mode=Mode.MIXED, xor_allowed=receiver.xor_allowed()))
        wire = {i.name for i in items}
        assert all(i.encoding is Encoding.OVERWRITE for i in items if i.name in plan.quantized)
        assert stats.fp8.tiles_touched > 0 and stats.fp8.fp8_changed > 0
        assert stats.fp8.scales_changed > 0 or v != 1  # v1 moved every first row's scale
        assert wire & plan.quantized and not wire - set(plan.wire_catalog)
        receiver.apply_items(items, attempt=v)
        group.commit()
        assert _mismatches(module, exports[v]) == []


def test_a_retried_attempt_and_a_commit_no_build_reached_stay_exact() -> None:
    scheme = Fp8Scheme(16)
    v0, v1, v2, v3 = _versions("qwen3")
    plan = build_plan(_catalog(v0), TrainLayout(tp=2), family="qwen3",
                      config=tiny_config("qwen3"), fp8=scheme)  # fmt: skip
    group = LocalTrainingGroup(plan, plan.slice(v0))
    module, receiver = _receiver(rollout_state_dict(v0, scheme), scheme)
    # Attempt 1 applies half its items; attempt 2 (overwrite mode) of the same candidate all.
    group.stage(plan.slice(v1))
    first, _ = _items(group.build(mode=Mode.MIXED, xor_allowed=receiver.xor_allowed()))
    receiver.apply_items(first[: len(first) // 2], attempt=1)
    second, _ = _items(group.build(mode=Mode.OVERWRITE, xor_allowed=frozenset()))
    receiver.apply_items(second, attempt=2)
    group.commit()
    assert _mismatches(module, rollout_state_dict(v1, scheme)) == []
    # v2 commits on the owners without any build (this receiver is restored densely later).
    group.stage(plan.slice(v2))
    group.commit()
    joined, fresh = _receiver({n: torch.zeros_like(t) for n, t in
                               rollout_state_dict(v2, scheme).items()}, scheme)  # fmt: skip
    dense, _ = _items(group.build_dense())
    assert all(i.span is not None for i in dense)
    fresh.apply_items(dense, attempt=3)
    assert _mismatches(joined, rollout_state_dict(v2, scheme)) == []
    # And the next delta refit, built against the baseline that commit moved, is exact.
    group.stage(plan.slice(v3))
    items, _ = _items(group.build(mode=Mode.MIXED, xor_allowed=fresh.xor_allowed()))
    fresh.apply_items(items, attempt=4)
    group.commit()
    assert _mismatches(joined, rollout_state_dict(v3, scheme)) == []


def test_a_discarded_transition_leaves_the_fp8_baseline() -> None:
    scheme = Fp8Scheme(None)
    v0, v1, v2, _ = _versions("llama")
    plan = build_plan(_catalog(v0), TrainLayout(tp=1), family="llama",
                      config=tiny_config("llama"), fp8=scheme)  # fmt: skip
    group = LocalTrainingGroup(plan, plan.slice(v0))
    module, receiver = _receiver(rollout_state_dict(v0, scheme), scheme)
    group.stage(plan.slice(v1))
    _items(group.build(mode=Mode.MIXED, xor_allowed=receiver.xor_allowed()))
    group.discard()
    group.stage(plan.slice(v2))
    items, _ = _items(group.build(mode=Mode.MIXED, xor_allowed=receiver.xor_allowed()))
    receiver.apply_items(items, attempt=2)
    group.commit()
    assert _mismatches(module, rollout_state_dict(v2, scheme)) == []


def test_tiles_that_shards_cut_are_shared_and_only_bf16_weights_are_quantized() -> None:
    cfg = tiny_config("qwen3")
    catalog = {n: TensorSpec(name=n, shape=s, dtype=torch.bfloat16)
               for n, s in canonical_shapes(cfg, "qwen3").items()}  # fmt: skip
    # TP 2 cuts 32x32 tiles of the attention projections: the plan lists them as shared.
    plan = build_plan(catalog, TrainLayout(tp=2), family="qwen3", config=cfg, fp8=Fp8Scheme(32))
    shared = plan.fp8_shared_tiles()
    assert shared and set(shared.offsets) <= set(plan.quantized)
    assert not build_plan(catalog, TrainLayout(tp=1), family="qwen3", config=cfg,
                          fp8=Fp8Scheme(32)).fp8_shared_tiles()  # fmt: skip
    fp32 = {n: TensorSpec(name=n, shape=s.shape, dtype=torch.float32) for n, s in catalog.items()}
    with pytest.raises(LayoutError, match="bfloat16 projection weights"):
        build_plan(fp32, TrainLayout(tp=1), family="qwen3", config=cfg, fp8=Fp8Scheme(16))


def test_a_plan_takes_an_fp8_rollout_later_as_if_built_with_it() -> None:
    cfg = tiny_config("qwen3")
    catalog = {n: TensorSpec(name=n, shape=s, dtype=torch.bfloat16)
               for n, s in canonical_shapes(cfg, "qwen3").items()}  # fmt: skip
    bf16 = build_plan(catalog, TrainLayout(tp=2), family="qwen3", config=cfg)
    built = build_plan(catalog, TrainLayout(tp=2), family="qwen3", config=cfg, fp8=Fp8Scheme(16))
    later = bf16.with_fp8(Fp8Scheme(16))
    assert later.fp8 == built.fp8 and later.quantized == built.quantized
    assert later.wire_catalog == built.wire_catalog != bf16.wire_catalog
    assert [later.fp8_regions(r).keys() for r in later.owners] == [
        built.fp8_regions(r).keys() for r in built.owners
    ]
    assert bf16.with_fp8(None) is bf16 and later.with_fp8(Fp8Scheme(16)) is later
    back = later.with_fp8(None)
    assert back.fp8 is None and not back.quantized and back.wire_catalog == bf16.wire_catalog


@pytest.mark.parametrize(("tp", "block"), [(1, None), (2, 16), (2, None)])
def test_the_proof_of_the_base_version_covers_fp8_values_and_scales(
    tp: int, block: int | None
) -> None:
    """Owners prove their committed FP8 values and scales; a receiver that holds them agrees,
    and one flipped bit of an FP8 value or a scale fails it."""
    scheme = Fp8Scheme(block)
    v0, v1, *_ = _versions("qwen3")
    plan = build_plan(_catalog(v0), TrainLayout(tp=tp), family="qwen3",
                      config=tiny_config("qwen3"), fp8=scheme)  # fmt: skip
    group = LocalTrainingGroup(plan, plan.slice(v0))
    module, receiver = _receiver(rollout_state_dict(v0, scheme), scheme)
    group.stage(plan.slice(v1))
    items, _ = _items(group.build(mode=Mode.MIXED, xor_allowed=receiver.xor_allowed()))
    receiver.apply_items(items, attempt=1)
    group.commit()
    request = ProofRequest(seed=5, samples=64, fingerprint=True)

    def verdict() -> Any:
        owners = {f"o{k}": owner_proof(o, request) for k, o in group.owners.items()}
        return judge(request, owners, {"r0": receiver_proof(receiver, request)})

    clean = verdict()
    assert dict(clean.failed) == {} and clean.unchecked == ()
    assert clean.fingerprinted == len(plan.wire_catalog)
    held = dict(module.named_parameters())
    held.update(module.named_buffers())
    for name in ("model.layers.1.mlp.down_proj.weight", scheme.scale_name(
            "model.layers.0.self_attn.q_proj.weight")):  # fmt: skip
        flat = bits(held[name]).reshape(-1)
        flat[3] ^= 1
        assert set(verdict().failed) == {"r0"}, name
        flat[3] ^= 1
    assert dict(verdict().failed) == {}


def test_regions_whose_fp8_values_change_a_lot_go_dense_and_stay_exact(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With ``dense_above`` at 5%, a real AdamW step at lr 1e-4 (most FP8 values of most
    regions change) sends those regions' FP8 values whole, as span items; the rest stays
    sparse; the receiver ends at the export either way."""
    import dcr.delta.owner as owner_module

    monkeypatch.setattr(owner_module, "DENSE_MIN_ELEMENTS", 0)  # tiny weights may go dense
    scheme = Fp8Scheme(16)
    v0, v1, v2, _ = _versions("qwen3")
    plan = build_plan(_catalog(v0), TrainLayout(tp=2), family="qwen3",
                      config=tiny_config("qwen3"), fp8=scheme)  # fmt: skip
    group = LocalTrainingGroup(plan, plan.slice(v1), config=BuildConfig(dense_above=0.05))
    module, receiver = _receiver(rollout_state_dict(v1, scheme), scheme)
    group.stage(plan.slice(v2))
    items, stats = _items(group.build(mode=Mode.MIXED, xor_allowed=receiver.xor_allowed()))
    spans = [i for i in items if i.name in plan.quantized and i.span is not None]
    listed = [i for i in items if i.name in plan.quantized and i.span is None]
    assert spans and stats.fp8.dense == len(spans)
    assert all(i.count == plan.wire_catalog[i.name].numel // 2 for i in spans)  # a TP 2 region
    receiver.apply_items(items, attempt=1)
    group.commit()
    assert _mismatches(module, rollout_state_dict(v2, scheme)) == []
    assert listed or stats.fp8.dense == len(plan.quantized) * 2


def test_a_retry_abandoned_while_it_re_quantizes_still_commits_the_whole_candidate() -> None:
    """The second attempt of a candidate stops after its first FP8 payload (the coordinator
    moved on); commit then converts what that build left unstaged, and the FP8 baseline is the
    candidate's: the next refit is exact."""
    scheme = Fp8Scheme(16)
    v0, v1, v2, _ = _versions("qwen3")
    plan = build_plan(_catalog(v0), TrainLayout(tp=1), family="qwen3",
                      config=tiny_config("qwen3"), fp8=scheme)  # fmt: skip
    group = LocalTrainingGroup(plan, plan.slice(v0), config=BuildConfig(bucket_bytes=1))
    module, receiver = _receiver(rollout_state_dict(v0, scheme), scheme)
    group.stage(plan.slice(v1))
    items, _ = _items(group.build(mode=Mode.MIXED, xor_allowed=receiver.xor_allowed()))
    receiver.apply_items(items, attempt=1)
    ((it, _),) = group.build(mode=Mode.OVERWRITE, xor_allowed=frozenset()).values()
    for bucket in it:
        if any(i.name in plan.quantized for i in bucket.items):
            break
    else:
        raise AssertionError("no FP8 payload")
    it.close()  # type: ignore[attr-defined]
    group.commit()
    group.stage(plan.slice(v2))
    items, _ = _items(group.build(mode=Mode.MIXED, xor_allowed=receiver.xor_allowed()))
    receiver.apply_items(items, attempt=3)
    group.commit()
    assert _mismatches(module, rollout_state_dict(v2, scheme)) == []
