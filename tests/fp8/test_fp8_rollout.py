"""FP8 refits of a BF16 trainer's versions (``dcr.delta.fp8``) applied through a receiver:
after every refit the receiver's module holds exactly the bits of a fresh load of ``dcr fp8
export`` of that version (FP8 values, scales and BF16 tensors, compared as integers), for
block and channel scales and three model families; the rollout's staging, commit, discard and
dense items; and the torch-module loader path with float8 parameters and float32 scale
buffers."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest
import torch

from dcr.adapters.loaders.torch_module import TorchModuleLoader
from dcr.apply.applier import Applier
from dcr.delta.fp8 import Fp8Region, Fp8Rollout, Fp8Stats, overwrite_item
from dcr.errors import ConfigError, LayoutError
from dcr.models.families import random_state_dict, tiny_config
from dcr.models.fp8 import export_checkpoint, quantized_names
from dcr.models.hf import read_checkpoint, write_checkpoint
from dcr.models.modules import module_from_state_dict
from dcr.models.updates import adamw_update, perturb
from dcr.tensors.bits import bits
from dcr.tensors.fp8 import Fp8Scheme
from dcr.tensors.records import Item, TensorSpec
from dcr.testing.fp8 import grow_first_row_max, refit_items

FAMILIES = ("llama", "qwen3", "qwen3_moe")


def _versions(family: str, count: int) -> list[dict[str, torch.Tensor]]:
    """BF16 versions: a perturbation at 3% with moved scales, then a real AdamW step, then 1%."""
    cfg = tiny_config(family)
    out = [random_state_dict(cfg, family, seed=7)]
    steps = [
        lambda sd: grow_first_row_max(perturb(sd, rate=0.03, seed=1)),
        lambda sd: adamw_update(sd, lr=1e-4, seed=2),
        lambda sd: perturb(sd, rate=0.01, seed=3),
    ]
    for v in range(1, count):
        out.append(steps[(v - 1) % len(steps)](out[-1]))
    return out


def _export(tmp: Path, family: str, sd: Mapping[str, torch.Tensor], scheme: Fp8Scheme,
            tag: str) -> dict[str, torch.Tensor]:  # fmt: skip
    src = write_checkpoint(tmp / f"bf16-{tag}", tiny_config(family), family, sd)
    export_checkpoint(src, tmp / f"fp8-{tag}", scheme)
    return read_checkpoint(tmp / f"fp8-{tag}")


def _mismatches(module: torch.nn.Module, reference: Mapping[str, torch.Tensor]) -> list[str]:
    held = dict(module.named_parameters())
    held.update(module.named_buffers())
    return [n for n, t in reference.items()
            if held[n].dtype != t.dtype or not np.array_equal(bits(held[n]), bits(t))]  # fmt: skip


def _module(fp8: Mapping[str, torch.Tensor], scheme: Fp8Scheme) -> torch.nn.Module:
    """float8 parameters, float32 scales as buffers, BF16 parameters elsewhere."""
    scales = [n for n in fp8 if n.endswith(scheme.scale_name(""))]
    return module_from_state_dict(fp8, buffers=scales)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("block", [16, None], ids=["block", "channel"])
def test_fp8_refits_equal_fresh_loads_of_the_export(
    tmp_path: Path, family: str, block: int | None
) -> None:
    scheme = Fp8Scheme(block)
    versions = _versions(family, 4)
    names = quantized_names({n: tuple(t.shape) for n, t in versions[0].items()})
    exports = [_export(tmp_path, family, sd, scheme, f"v{v}") for v, sd in enumerate(versions)]
    module = _module(exports[0], scheme)
    receiver = Applier(TorchModuleLoader(module),
                       {n: TensorSpec.of(n, t) for n, t in exports[0].items()})  # fmt: skip
    receiver.prewarm()
    rollout = Fp8Rollout(scheme, {n: versions[0][n] for n in names})
    assert rollout.specs() == {n: TensorSpec.of(n, exports[0][n])
                               for n in exports[0] if n.startswith(tuple(names))}  # fmt: skip
    for v in range(1, len(versions)):
        stale = _mismatches(module, exports[v])
        assert stale, "the versions must differ for the comparison to mean anything"
        stats = Fp8Stats()
        items = refit_items(versions[v - 1], versions[v], rollout, stats)
        assert stats.tiles_touched > 0 and stats.fp8_changed > 0
        assert stats.scales_changed > 0 or v != 1  # v1 moved every first row's scale
        receiver.apply_items(items, attempt=v)
        rollout.commit()
        assert _mismatches(module, exports[v]) == []


def test_a_discarded_refit_leaves_the_baseline_and_the_next_one_is_exact(tmp_path: Path) -> None:
    scheme = Fp8Scheme(16)
    v0, v1, v2 = _versions("qwen3", 3)
    names = quantized_names({n: tuple(t.shape) for n, t in v0.items()})
    rollout = Fp8Rollout(scheme, {n: v0[n] for n in names})
    before = {n: bits(t).copy() for n, t in rollout.mirror.items()}
    q_before = {n: bits(t).copy() for n, t in rollout.q.items()}
    refit_items(v0, v1, rollout, Fp8Stats())
    rollout.discard()
    assert all(np.array_equal(bits(rollout.mirror[n]), before[n]) for n in names)
    assert all(np.array_equal(bits(rollout.q[n]), q_before[n]) for n in names)
    # Straight from v0 to v2, as a retried transition would.
    refit_items(v0, v2, rollout, Fp8Stats())
    rollout.commit()
    fresh = Fp8Rollout(scheme, {n: v2[n] for n in names})
    for n in names:
        assert np.array_equal(bits(rollout.q[n]), bits(fresh.q[n]))
        assert np.array_equal(bits(rollout.s[n]), bits(fresh.s[n]))
    with pytest.raises(LayoutError, match="not a quantized weight"):
        rollout.stage("model.norm.weight", np.array([0]), np.array([0], np.uint16))
    name = names[0]
    rollout.stage(name, np.empty(0, np.int64), np.empty(0, np.uint16))
    with pytest.raises(LayoutError, match="staged twice"):
        rollout.stage(name, np.empty(0, np.int64), np.empty(0, np.uint16))


def test_dense_items_restore_a_receiver_that_holds_nothing(tmp_path: Path) -> None:
    """A joining receiver (zeros everywhere) gets the committed FP8 tensors whole."""
    scheme = Fp8Scheme(None)
    v0, v1 = _versions("llama", 2)
    names = quantized_names({n: tuple(t.shape) for n, t in v0.items()})
    rollout = Fp8Rollout(scheme, {n: v0[n] for n in names})
    refit_items(v0, v1, rollout, Fp8Stats())
    rollout.commit()
    want = _export(tmp_path, "llama", v1, scheme, "v1")
    module = _module({n: torch.zeros_like(t) for n, t in want.items()}, scheme)
    receiver = Applier(TorchModuleLoader(module), {n: TensorSpec.of(n, t) for n, t in want.items()})
    receiver.prewarm()
    kept = [overwrite_item(n, t, None, bits(t).reshape(-1)) for n, t in v1.items()
            if n not in rollout.mirror]  # fmt: skip
    receiver.apply_items([*rollout.dense_items(), *kept], attempt=1)
    assert _mismatches(module, want) == []


def test_a_rollout_quantizes_only_bfloat16_matrices() -> None:
    with pytest.raises(LayoutError, match="bfloat16 matrices"):
        Fp8Rollout(Fp8Scheme(16), {"a.weight": torch.zeros(4, 4)})
    with pytest.raises(LayoutError, match="bfloat16 matrices"):
        Fp8Rollout(Fp8Scheme(16), {"a.weight": torch.zeros(4, dtype=torch.bfloat16)})


def _regions(name: str, shape: tuple[int, int], axis: int, parts: int) -> list[Fp8Region]:
    rows, cols = shape
    n = shape[axis] // parts
    out = []
    for k in range(parts):
        span = (k * n, (k + 1) * n)
        out.append(Fp8Region(name, shape, span if axis == 0 else (0, rows),
                             span if axis == 1 else (0, cols)))  # fmt: skip
    return out


def _entries(items: list[Item]) -> dict[str, dict[int, int]]:
    out: dict[str, dict[int, int]] = {}
    for item in items:
        out.setdefault(item.name, {}).update(
            zip(item.indices.tolist(), item.values.tolist(), strict=True)
        )
    return out


@pytest.mark.parametrize(("block", "axis"), [(16, 0), (16, 1), (None, 0)])
def test_owners_of_regions_send_together_what_one_owner_of_the_weight_sends(
    block: int | None, axis: int
) -> None:
    """A weight split into row or column slices (tensor-parallel shards), each quantized by
    its own rollout: the union of their items, sparse and dense, is the whole weight's."""
    scheme = Fp8Scheme(block)
    v0, v1 = _versions("qwen3", 2)
    name = "model.layers.0.mlp.gate_proj.weight"
    shape = tuple(v0[name].shape)
    top = int(v0[name].to(torch.float32).abs().argmax())  # the weight's largest: a scale moves
    v1[name].view(-1)[top] = (v1[name].view(-1)[top].to(torch.float32) * 1.5).to(torch.bfloat16)
    whole = Fp8Rollout(scheme, {name: v0[name]})
    parts = []
    for region in _regions(name, shape, axis, 2):
        (r0, r1), (c0, c1) = region.rows, region.cols
        parts.append(Fp8Rollout(scheme, {name: v0[name][r0:r1, c0:c1]}, {name: region}))
    assert all(p.specs() == whole.specs() for p in parts)
    new_bits = bits(v1[name]).reshape(-1)
    changed = np.flatnonzero(bits(v0[name]).reshape(-1) != new_bits)
    want = _entries(whole.stage(name, changed, new_bits[changed]))
    got: dict[str, dict[int, int]] = {}
    cols = shape[1]
    for p in parts:
        (r0, r1), (c0, c1) = p.regions[name].rows, p.regions[name].cols
        r, c = np.divmod(changed, cols)
        mine = changed[(r >= r0) & (r < r1) & (c >= c0) & (c < c1)]
        for n, entries in _entries(p.stage(name, mine, new_bits[mine])).items():
            got.setdefault(n, {}).update(entries)
    assert got == want and len(want) == 2
    for p in [whole, *parts]:
        p.commit()
    dense: dict[str, dict[int, int]] = {}
    for p in parts:
        for item in p.dense_items():
            dense.setdefault(item.name, {}).update(
                zip(item.indices.tolist(), item.values.tolist(), strict=True)
            )
    assert dense == _entries(whole.dense_items())


def test_regions_sharing_tiles_need_their_maxima_and_stay_in_their_region() -> None:
    w = torch.zeros(64, 64, dtype=torch.bfloat16)
    # Rows 0-24 cut 16x16 tiles; a column slice shares its rows' per-channel scales: both
    # need the shared tiles' maxima over every owner.
    for block, region in ((16, Fp8Region("a.weight", (64, 64), (0, 24), (0, 64))),
                          (None, Fp8Region("a.weight", (64, 64), (0, 64), (0, 32)))):  # fmt: skip
        scheme = Fp8Scheme(block)
        assert region.shares_tiles(scheme)
        values = w[region.rows[0] : region.rows[1], region.cols[0] : region.cols[1]]
        with pytest.raises(LayoutError, match="over every owner") as err:
            Fp8Rollout(scheme, {"a.weight": values}, {"a.weight": region})
        assert err.value.check == "fp8-amax"
    # The weight's own edge may end a partial tile: nothing is shared.
    edge = Fp8Region("a.weight", (64, 64), (48, 64), (0, 64))
    assert not edge.shares_tiles(Fp8Scheme(48))
    Fp8Rollout(Fp8Scheme(48), {"a.weight": w[48:]}, {"a.weight": edge})
    with pytest.raises(LayoutError, match="outside"):
        Fp8Region("a.weight", (64, 64), (0, 80), (0, 64)).check(Fp8Scheme(16))
    region = Fp8Region("a.weight", (64, 64), (0, 32), (0, 64))
    rollout = Fp8Rollout(Fp8Scheme(16), {"a.weight": w[:32]}, {"a.weight": region})
    with pytest.raises(LayoutError, match="outside this owner's tiles"):
        rollout.stage("a.weight", np.array([40 * 64]), np.array([1], np.uint16))


@pytest.mark.parametrize("block", [16, 48, None], ids=["block", "partial-block", "channel"])
def test_staging_a_whole_region_equals_staging_its_changed_elements(block: int | None) -> None:
    """For a weight whose elements mostly changed, owners hand over the region's values
    instead of an index per element: the items, the commit and a discard are the same."""
    scheme = Fp8Scheme(block)
    v0, _, v2, _ = _versions("qwen3", 4)  # v2: a real AdamW step, most words changed
    name = "model.layers.1.mlp.down_proj.weight"
    by_index = Fp8Rollout(scheme, {name: v0[name]})
    by_region = Fp8Rollout(scheme, {name: v0[name]})
    new_bits = bits(v2[name]).reshape(-1)
    changed = np.flatnonzero(bits(v0[name]).reshape(-1) != new_bits)
    assert changed.shape[0] * 2 > new_bits.shape[0]
    want = _entries(by_index.stage(name, changed, new_bits[changed]))
    assert _entries(by_region.stage_region(name, v2[name])) == want
    by_region.discard()
    assert np.array_equal(bits(by_region.mirror[name]), bits(v0[name]))
    by_region.stage_region(name, v2[name])
    by_region.commit()
    by_index.commit()
    assert np.array_equal(bits(by_region.q[name]), bits(by_index.q[name]))
    assert np.array_equal(bits(by_region.s[name]), bits(by_index.s[name]))
    with pytest.raises(LayoutError, match="region values"):
        by_region.stage_region(name, v2[name].t())


def _apply(state: dict[str, np.ndarray], items: list[Item]) -> None:
    """Write overwrite ``items`` (listed or span) into the flat bits of ``state``."""
    for item in items:
        if item.indices is not None:
            state[item.name][item.indices] = item.values
        else:
            assert item.span is not None
            where = item.span.locate(0, len(item.values))
            state[item.name][where] = item.values


CUTS = {16: ((0, 24, 40, 64), (0, 40, 64)), None: ((0, 64), (0, 40, 64))}
"""Owners' rectangles of a 64 x 64 weight: rows and columns cut at these edges -- through 16 x 16
tiles (block), through every row (channel)."""


@pytest.mark.parametrize("block", [16, None], ids=["block", "channel"])
def test_owners_that_share_tiles_quantize_and_refit_as_one(block: int | None) -> None:
    """Owners whose shards cut tiles -- block tiles cut by shard edges, rows split into column
    slices under per-channel scales -- exchange the shared tiles' maxima (``SharedTiles``).
    Each quantizes its values exactly as the whole weight's quantization; their dense items
    together are the export; a change in one owner's part that moves a shared tile's maximum
    makes the others re-quantize that tile without a change of their own; each shared scale
    is sent by one owner; a value that is not finite reaches every owner of its tile and is
    refused there."""
    from dcr.delta.fp8_shared import SharedTiles
    from dcr.tensors.fp8 import quantize, tile_amax

    scheme, name = Fp8Scheme(block), "a.weight"
    scale = scheme.scale_name(name)
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(64, 64, generator=g) * 0.05).to(torch.bfloat16)
    row_edges, col_edges = CUTS[block]
    regions = [Fp8Region(name, (64, 64), (r0, r1), (c0, c1))
               for r0, r1 in itertools.pairwise(row_edges)
               for c0, c1 in itertools.pairwise(col_edges)]  # fmt: skip
    assert all(r.shares_tiles(scheme) for r in regions)
    shared = SharedTiles(scheme, {name: scheme.tile_grid((64, 64))})

    def part(v: torch.Tensor, r: Fp8Region) -> torch.Tensor:
        return v[r.rows[0] : r.rows[1], r.cols[0] : r.cols[1]].contiguous()

    def maxima(v: torch.Tensor) -> torch.Tensor:
        """Every owner's partial maxima, each over its frame (zeros elsewhere), maximised."""
        parts = []
        for r in regions:
            (f0, f1), (g0, g1) = r.frame(scheme)
            frame = torch.zeros((f1 - f0, g1 - g0), dtype=torch.bfloat16)
            frame[r.rows[0] - f0 : r.rows[1] - f0, r.cols[0] - g0 : r.cols[1] - g0] = part(v, r)
            parts.append({name: (r, tile_amax(frame, scheme))})
        return shared.vector(parts)

    amax = maxima(w)
    assert np.array_equal(bits(amax), bits(tile_amax(w, scheme)))
    owners = [Fp8Rollout(scheme, {name: part(w, r)}, {name: r}, shared.tiles(amax, [r]))
              for r in regions]  # fmt: skip
    q, s = quantize(w, scheme)
    export = {name: bits(q).reshape(-1).copy(), scale: bits(s).reshape(-1).copy()}
    held = {k: np.zeros_like(v) for k, v in export.items()}
    for owner in owners:
        _apply(held, owner.dense_items())
    assert all(np.array_equal(held[k], export[k]) for k in export)
    # Every scale is sent by exactly one owner.
    assert (
        sum(len(i.values) for o in owners for i in o.dense_items() if i.name == scale) == s.numel()
    )

    new = w.clone()
    new[5, 50] = 2.0  # the maximum of its tile (block) or row (channel) moves
    changed = np.array([5 * 64 + 50], dtype=np.int64)
    with pytest.raises(LayoutError, match="share"):
        owners[0].stage(name, np.empty(0, np.int64), np.empty(0, np.uint16))
    items: list[Item] = []
    for r, owner in zip(regions, owners, strict=True):
        owner.share(shared.tiles(maxima(new), [r]))
        inside = r.rows[0] <= 5 < r.rows[1] and r.cols[0] <= 50 < r.cols[1]
        mine = changed if inside else np.empty(0, np.int64)
        got = owner.stage(name, mine, bits(new).reshape(-1)[mine])
        if mine.shape[0] == 0 and owner.moved():
            assert any(i.name == name for i in got), "a moved shared scale re-quantizes here"
        items += got
    scales_sent = [i for i in items if i.name == scale]
    assert sum(len(i.values) for i in scales_sent) == 1  # the moved scale, sent once
    new_q, new_s = quantize(new, scheme)
    _apply(export, items)
    assert np.array_equal(export[name], bits(new_q).reshape(-1))
    assert np.array_equal(export[scale], bits(new_s).reshape(-1))
    for owner in owners:
        owner.commit()
        assert owner.moved() == []

    bad = new.clone()
    bad[5, 7] = float("nan")
    for r, owner in zip(regions, owners, strict=True):
        owner.share(shared.tiles(maxima(bad), [r]))
        if not owner.moved():
            continue  # holds no part of the poisoned tile
        with pytest.raises(ConfigError, match="not finite") as caught:
            owner.stage(name, np.empty(0, np.int64), np.empty(0, np.uint16))
        assert caught.value.check == "fp8-finite"
