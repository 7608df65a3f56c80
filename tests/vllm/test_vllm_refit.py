"""In-place delta refit through vLLM's real native loader on CPU (paper §6, G1).

Each test loads checkpoint W0 into vLLM's model class, applies the items of W0 -> W1 in place
through a :class:`~dcr.apply.applier.Applier`, then builds a fresh model of the same class from
the W1 checkpoint and compares every parameter and buffer bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import pytest
import torch
from vllm_helpers import (
    Checkpoint,
    bit_mismatches,
    pack_what_stayed_plain,
    run_cpu_engine_processing,
    snapshot,
    snapshot_mismatches,
    storage_items,
)

from dcr.adapters.loaders.vllm import VllmLoader, build_vllm_model
from dcr.apply.applier import Applier, PathKind, xor_allowed_across
from dcr.errors import LoaderPathUnsupported
from dcr.models.updates import perturb
from dcr.tensors.bits import bits, changed_indices
from dcr.tensors.records import Encoding, Item, TensorSpec

pytestmark = pytest.mark.vllm

FAMILIES = ("qwen3", "qwen3_moe", "llama")
Build = Callable[[Path], torch.nn.Module]
WriteTiny = Callable[..., Checkpoint]

# Bit patterns planted where float comparison goes wrong (bf16): W0 value -> W1 value.
SPECIALS = np.array(
    [
        (0x0000, 0x8000),  # +0 -> -0
        (0x3F80, 0x7F81),  # 1.0 -> signalling-NaN payload
        (0x7FC1, 0x7FC3),  # NaN -> NaN with another payload
        (0xFF80, 0x7F80),  # -inf -> +inf
        (0x3C00, 0x0001),  # normal -> smallest subnormal
        (0x0003, 0x8003),  # subnormal -> negative subnormal
        (0x8000, 0x0000),  # -0 -> +0
    ],
    dtype=np.uint16,
)


def _special_names(family: str) -> list[str]:
    names = [
        "model.embed_tokens.weight",
        "model.norm.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.1.self_attn.q_norm.weight" if family != "llama" else "lm_head.weight",
    ]
    if family == "qwen3_moe":
        names += ["model.layers.1.mlp.experts.2.up_proj.weight", "model.layers.0.mlp.gate.weight"]
    else:
        names.append("model.layers.1.mlp.down_proj.weight")
    return names


def _plant(sd: dict[str, torch.Tensor], names: list[str], column: int, start: int) -> None:
    """Write ``SPECIALS[:, column]`` at flat positions ``start..`` of each named tensor."""
    for name in names:
        flat = bits(sd[name]).reshape(-1)
        flat[start : start + len(SPECIALS)] = SPECIALS[:, column]


def _with_specials(
    family: str, base: dict[str, torch.Tensor], new: dict[str, torch.Tensor]
) -> None:
    """Plant the W0 side of the special patterns in ``base`` and the W1 side in ``new``."""
    names = _special_names(family)
    _plant(base, names, 0, 5)
    _plant(new, names, 1, 5)


def _updated(sd: Mapping[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """About 3% of the elements of every tensor updated as ``bf16(w * (1 + 0.01 eps))``."""
    return perturb(sd, rate=0.03, seed=seed, relative=0.01)


def _items(
    old: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    xor_names: frozenset[str],
) -> list[Item]:
    """One item per changed canonical tensor: XOR masks where allowed, new bits elsewhere."""
    items = []
    for name, t_new in new.items():
        b_new, b_old = bits(t_new).reshape(-1), bits(old[name]).reshape(-1)
        idx = changed_indices(b_new, b_old)
        if idx.size == 0:
            continue
        xor = name in xor_names
        values = (b_new[idx] ^ b_old[idx]) if xor else b_new[idx].copy()
        items.append(
            Item(
                name=name,
                shape=tuple(t_new.shape),
                dtype=t_new.dtype,
                encoding=Encoding.XOR if xor else Encoding.OVERWRITE,
                indices=idx,
                values=values,
            )
        )
    return items


def _catalog(sd: Mapping[str, torch.Tensor]) -> dict[str, TensorSpec]:
    return {name: TensorSpec.of(name, t) for name, t in sd.items()}


def _receiver(model: torch.nn.Module, sd: Mapping[str, torch.Tensor]) -> Applier:
    receiver = Applier(VllmLoader(model), _catalog(sd))
    receiver.prewarm()
    return receiver


def _versions(family: str, write_tiny: WriteTiny, count: int) -> list[Checkpoint]:
    """W0..W{count-1} on disk; every transition changes ~3% of elements and special bits."""
    base = write_tiny(family)
    sds = [{n: t.clone() for n, t in base.state_dict.items()}]
    for v in range(1, count):
        sds.append(_updated(sds[-1], seed=100 + v))
    names = _special_names(family)
    for v, sd in enumerate(sds):
        _plant(sd, names, v % 2, 5)
    return [write_tiny(family, sd, tag=f"v{v}-of-{count}") for v, sd in enumerate(sds)]


def _changed_fraction(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    changed = sum(changed_indices(bits(b[n]), bits(a[n])).size for n in a)
    return changed / sum(t.numel() for t in a.values())


# --- end to end ------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_refit_equals_a_fresh_dense_load(
    family: str, write_tiny: WriteTiny, build_model: Build
) -> None:
    w0, w1 = _versions(family, write_tiny, 2)
    fraction = _changed_fraction(w0.state_dict, w1.state_dict)
    assert 0.015 < fraction < 0.035

    model = build_model(w0.path)
    receiver = _receiver(model, w0.state_dict)
    items = _items(w0.state_dict, w1.state_dict, receiver.xor_allowed())
    assert {i.encoding for i in items} == {Encoding.XOR}
    reference = build_model(w1.path)
    stale = bit_mismatches(model, reference)
    # Before the refit every large parameter differs: the comparison can fail.
    large = {n for n, p in model.named_parameters(remove_duplicate=False) if p.numel() >= 1000}
    assert "model.norm.weight" in stale and large <= set(stale)

    for item in items:
        receiver.apply_item(item, attempt=1)

    assert bit_mismatches(model, reference) == []


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_overwrite_only_refit_equals_a_fresh_dense_load(
    family: str, write_tiny: WriteTiny, build_model: Build
) -> None:
    w0, w1 = _versions(family, write_tiny, 2)
    model = build_model(w0.path)
    receiver = _receiver(model, w0.state_dict)
    items = _items(w0.state_dict, w1.state_dict, frozenset())
    assert {i.encoding for i in items} == {Encoding.OVERWRITE}
    receiver.apply_items(items, attempt=2)
    assert bit_mismatches(model, build_model(w1.path)) == []


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_overwrite_retry_repairs_a_partial_attempt(
    family: str, write_tiny: WriteTiny, build_model: Build
) -> None:
    """Attempt 1 applies half its XOR items and fails; attempt 2 (overwrite mode) applies all."""
    w0, w1 = _versions(family, write_tiny, 2)
    model = build_model(w0.path)
    receiver = _receiver(model, w0.state_dict)
    xor_items = _items(w0.state_dict, w1.state_dict, receiver.xor_allowed())
    receiver.apply_items(xor_items[: len(xor_items) // 2], attempt=1)
    receiver.apply_items(_items(w0.state_dict, w1.state_dict, frozenset()), attempt=2)
    assert bit_mismatches(model, build_model(w1.path)) == []


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_two_refits_in_a_row(family: str, write_tiny: WriteTiny, build_model: Build) -> None:
    w0, w1, w2 = _versions(family, write_tiny, 3)
    model = build_model(w0.path)
    receiver = _receiver(model, w0.state_dict)
    allowed = receiver.xor_allowed()
    receiver.apply_items(_items(w0.state_dict, w1.state_dict, allowed), attempt=1)
    assert bit_mismatches(model, build_model(w1.path)) == []
    receiver.apply_items(_items(w1.state_dict, w2.state_dict, allowed), attempt=2)
    assert bit_mismatches(model, build_model(w2.path)) == []


def test_xor_against_the_wrong_base_is_caught_by_the_comparison(
    write_tiny: WriteTiny, build_model: Build
) -> None:
    """Masks built from W1 -> W2 applied to a W0 model leave wrong bits, and the check sees it."""
    w0, w1, w2 = _versions("qwen3", write_tiny, 3)
    model = build_model(w0.path)
    receiver = _receiver(model, w0.state_dict)
    receiver.apply_items(_items(w1.state_dict, w2.state_dict, receiver.xor_allowed()), attempt=1)
    assert bit_mismatches(model, build_model(w2.path)) != []


def test_a_refit_missing_only_the_sign_of_a_zero_is_caught(
    write_tiny: WriteTiny, build_model: Build
) -> None:
    """Dropping the single +0 -> -0 entry leaves a value float equality calls equal."""
    w0, w1 = _versions("qwen3", write_tiny, 2)
    model = build_model(w0.path)
    receiver = _receiver(model, w0.state_dict)
    items = _items(w0.state_dict, w1.state_dict, receiver.xor_allowed())
    norm = next(i for i in items if i.name == "model.norm.weight")
    keep = norm.indices != 5  # flat position 5 holds the planted +0 -> -0
    assert norm.values[~keep].tolist() == [0x8000]
    trimmed = Item(
        name=norm.name,
        shape=norm.shape,
        dtype=norm.dtype,
        encoding=norm.encoding,
        indices=norm.indices[keep],
        values=norm.values[keep],
    )
    receiver.apply_items([trimmed if i is norm else i for i in items], attempt=1)
    reference = build_model(w1.path)
    assert bit_mismatches(model, reference) == ["model.norm.weight"]
    mine, theirs = model.model.norm.weight.detach(), reference.model.norm.weight.detach()
    assert float(mine[5]) == float(theirs[5]) == 0.0


def test_fp32_model_refits_through_the_casting_path(
    write_tiny: WriteTiny, vllm_runtime: None
) -> None:
    """A model built in float32 casts every bf16 copy: overwrite only, still bit-exact."""
    w0, w1 = _versions("qwen3", write_tiny, 2)
    model = build_vllm_model(w0.path, dtype=torch.float32)
    receiver = _receiver(model, w0.state_dict)
    assert {p.kind for p in receiver.paths.values()} == {PathKind.TRANSFORMING}
    assert receiver.xor_allowed() == frozenset()
    receiver.apply_items(_items(w0.state_dict, w1.state_dict, frozenset()), attempt=1)
    assert bit_mismatches(model, build_vllm_model(w1.path, dtype=torch.float32)) == []


# --- prewarm and classification ----------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_prewarm_changes_no_resident_bit(
    family: str, write_tiny: WriteTiny, build_model: Build
) -> None:
    ck = write_tiny(family)
    model = build_model(ck.path)
    before = snapshot(model)
    pointers = {name: t.data_ptr() for name, t in storage_items(model)}
    receiver = Applier(VllmLoader(model), _catalog(ck.state_dict))
    report = receiver.prewarm()
    assert report.names == len(ck.state_dict)
    assert snapshot_mismatches(model, before) == []
    assert {name: t.data_ptr() for name, t in storage_items(model)} == pointers


@pytest.mark.parametrize("family", FAMILIES)
def test_every_canonical_tensor_is_a_preserving_path(
    family: str, write_tiny: WriteTiny, build_model: Build
) -> None:
    ck = write_tiny(family)
    receiver = _receiver(build_model(ck.path), ck.state_dict)
    paths = receiver.paths
    assert set(paths) == set(ck.state_dict)
    assert {p.kind for p in paths.values()} == {PathKind.PRESERVING}
    assert receiver.xor_allowed() == frozenset(ck.state_dict)
    assert xor_allowed_across([receiver]) == frozenset(ck.state_dict)
    for name, path in paths.items():
        assert path.reported is True, name
        assert len(path.copies) == 1, name
        padded = name in ("model.embed_tokens.weight", "lm_head.weight")
        assert len(path.fills) == int(padded), name
    if ck.config["tie_word_embeddings"]:
        assert "lm_head.weight" not in paths
    # Fused destinations: q, k and v land in one storage at increasing row offsets.
    attn = "model.layers.0.self_attn."
    dsts = [paths[attn + p + ".weight"].copies[0].dst for p in ("q_proj", "k_proj", "v_proj")]
    assert len({d.storage for d in dsts}) == 1
    assert [d.offset for d in dsts] == sorted(d.offset for d in dsts) and dsts[0].offset == 0


def test_expert_paths_land_in_the_fused_expert_weights(
    write_tiny: WriteTiny, build_model: Build
) -> None:
    ck = write_tiny("qwen3_moe")
    paths = _receiver(build_model(ck.path), ck.state_dict).paths
    p = "model.layers.1.mlp.experts.3."
    gate, up, down = (paths[f"{p}{n}_proj.weight"].copies[0].dst for n in ("gate", "up", "down"))
    assert gate.storage == up.storage != down.storage
    assert "w13_weight" in gate.storage and "w2_weight" in down.storage
    f, h = int(ck.config["moe_intermediate_size"]), int(ck.config["hidden_size"])
    assert (gate.offset, up.offset, down.offset) == (
        3 * 2 * f * h,
        3 * 2 * f * h + f * h,
        3 * h * f,
    )


def test_tied_lm_head_in_the_catalog_is_rejected_at_prewarm(
    write_tiny: WriteTiny, build_model: Build
) -> None:
    ck = write_tiny("qwen3")
    catalog = _catalog(ck.state_dict)
    embed = catalog["model.embed_tokens.weight"]
    catalog["lm_head.weight"] = TensorSpec(
        name="lm_head.weight", shape=embed.shape, dtype=embed.dtype
    )
    model = build_model(ck.path)
    before = snapshot(model)
    with pytest.raises(LoaderPathUnsupported) as info:
        Applier(VllmLoader(model), catalog).prewarm()
    assert info.value.tensor == "lm_head.weight"
    assert snapshot_mismatches(model, before) == []


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_prewarm_rejects_weights_repacked_by_the_cpu_engine(
    family: str, write_tiny: WriteTiny, build_model: Build
) -> None:
    """The CPU engine's processing, completed where it left linears plain, so the model is fully
    repacked on every machine: prewarm refuses it and leaves every bit as it was."""
    ck = write_tiny(family)
    model = build_model(ck.path)
    run_cpu_engine_processing(model, ck.path)
    pack_what_stayed_plain(model)
    before = snapshot(model)
    with pytest.raises(LoaderPathUnsupported) as info:
        Applier(VllmLoader(model), _catalog(ck.state_dict)).prewarm()
    assert info.value.check == "repacked"
    assert snapshot_mismatches(model, before) == []


# --- one-call refit ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "layout"),
    [("qwen3", {"tp": 2, "dp": 2}), ("qwen3_moe", {"tp": 2, "ep": 2})],
)
def test_local_refit_from_sharded_training_state(
    family: str, layout: dict[str, int], write_tiny: WriteTiny, build_model: Build
) -> None:
    """Owners on a sharded training layout -> payload bytes -> two vLLM receivers, twice."""
    from dcr.adapters.sources import StateDictSource
    from dcr.delta.layout import TrainLayout
    from dcr.local import LocalRefit

    w0, w1, w2 = _versions(family, write_tiny, 3)
    models = [build_model(w0.path), build_model(w0.path)]
    source = StateDictSource(
        w0.state_dict, layout=TrainLayout(**layout), family=family, config=w0.config
    )
    with LocalRefit(source, receivers=[VllmLoader(m) for m in models]) as refit:
        first = refit.refit(w1.state_dict)
        reference = build_model(w1.path)
        assert [bit_mismatches(m, reference) for m in models] == [[], []]
        assert first.ulp_entries > 0 and first.payload_bytes < first.checkpoint_bytes
        refit.refit(w2.state_dict, mode="overwrite")
        reference = build_model(w2.path)
        assert [bit_mismatches(m, reference) for m in models] == [[], []]
