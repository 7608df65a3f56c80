"""Receivers on tensor-parallel sharded ranks end with the bits of a dense load (G1)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from apply_helpers import (
    A_LOG,
    DT_BIAS,
    base_state_dict,
    bit_diff,
    catalog_of,
    dense_reference,
    make_items,
    snapshot,
    tp_config,
    update,
)

from dcr.adapters.loaders.sharded import ShardedServingLoader, padded_vocab
from dcr.apply import Applier, ApplyConfig, CopyStrategy, PathKind, PlaceholderScheme
from dcr.apply.applier import xor_allowed_across
from dcr.models.families import FAMILIES
from dcr.tensors.bits import bits
from dcr.tensors.records import Encoding, Item

TP_SIZES = (1, 2, 3, 4)


def _ranks(family: str, tp: int, sd: dict[str, torch.Tensor], **kw: object) -> list[Applier]:
    config = tp_config(family, tp)
    out = []
    for rank in range(tp):
        receiver = Applier(
            dense_reference(config, family, sd, tp, rank), catalog_of(sd), ApplyConfig(**kw)
        )
        receiver.prewarm()
        out.append(receiver)
    return out


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("rate", [0.03, 0.5])
def test_mixed_refit_equals_dense_load(family: str, tp: int, rate: float) -> None:
    config = tp_config(family, tp)
    w0 = base_state_dict(config, family)
    w1 = update(w0, rate=rate, seed=tp)
    receivers = _ranks(family, tp, w0)
    allowed = xor_allowed_across(receivers)
    items = make_items(w0, w1, allowed)
    assert {i.encoding for i in items} == {Encoding.XOR, Encoding.OVERWRITE}
    for rank, receiver in enumerate(receivers):
        want = snapshot(dense_reference(config, family, w1, tp, rank).module)
        assert bit_diff(snapshot(receiver.loader.module), want), "the update must change the rank"
        report = receiver.apply_items(items, attempt=1)
        assert report.entries == sum(i.count for i in items)
        assert bit_diff(snapshot(receiver.loader.module), want) == []


@pytest.mark.parametrize("rate", [0.0, "one", 1.0])
@pytest.mark.parametrize("family", FAMILIES)
def test_change_rates_at_tp2(family: str, rate: float | str) -> None:
    config = tp_config(family, 2)
    w0 = base_state_dict(config, family)
    w1 = update(w0, rate=rate, seed=7)
    receivers = _ranks(family, 2, w0)
    items = make_items(w0, w1, xor_allowed_across(receivers))
    assert len(items) == {0.0: 0, "one": 1, 1.0: len(w0)}[rate]
    for rank, receiver in enumerate(receivers):
        receiver.apply_items(items, attempt=3)
        want = snapshot(dense_reference(config, family, w1, 2, rank).module)
        assert bit_diff(snapshot(receiver.loader.module), want) == []


def test_overwrite_mode_and_post_apply_checks() -> None:
    family, tp = "qwen3_moe", 2
    config = tp_config(family, tp)
    w0 = base_state_dict(config, family)
    w1 = update(w0, rate=0.03, seed=11)
    for rank, receiver in enumerate(_ranks(family, tp, w0, post_apply_checks=True)):
        report = receiver.apply_items(make_items(w0, w1, frozenset()), attempt=2)
        assert report.checked == report.written > 0
        want = snapshot(dense_reference(config, family, w1, tp, rank).module)
        assert bit_diff(snapshot(receiver.loader.module), want) == []


def test_xor_twice_restores_and_overwrite_twice_is_idempotent() -> None:
    family, tp = "qwen3", 2
    config = tp_config(family, tp)
    w0 = base_state_dict(config, family)
    w1 = update(w0, rate=0.05, seed=5)
    for rank, receiver in enumerate(_ranks(family, tp, w0)):
        module = receiver.loader.module
        start = snapshot(module)
        xor_items = make_items(w0, w1, receiver.xor_allowed())
        xor_only = [i for i in xor_items if i.encoding is Encoding.XOR]
        assert xor_only
        receiver.apply_items(xor_only, attempt=1)
        receiver.apply_items(xor_only, attempt=1)
        assert bit_diff(snapshot(module), start) == []
        over = make_items(w0, w1, frozenset())
        receiver.apply_items(over, attempt=2)
        receiver.apply_items(over, attempt=2)
        want = snapshot(dense_reference(config, family, w1, tp, rank).module)
        assert bit_diff(snapshot(module), want) == []


@pytest.mark.parametrize("family", FAMILIES)
def test_prewarm_changes_no_bit_and_is_idempotent(family: str) -> None:
    config = tp_config(family, 4)
    w0 = base_state_dict(config, family)
    loader = dense_reference(config, family, w0, 4, 3)
    before = snapshot(loader.module)
    receiver = Applier(loader, catalog_of(w0))
    first = receiver.prewarm()
    assert bit_diff(snapshot(loader.module), before) == []
    assert receiver.prewarm() is first
    assert first.names == len(w0)
    assert first.preserving + first.transforming + first.skipped == first.names
    assert first.scratch_bytes >= max(t.numel() * t.element_size() for t in w0.values())


def test_classification_of_each_path_kind() -> None:
    family, tp = "qwen3_moe", 4
    config = tp_config(family, tp)
    w0 = base_state_dict(config, family)
    receivers = _ranks(family, tp, w0)
    experts = int(config["num_experts"])
    local = experts // tp
    for rank, receiver in enumerate(receivers):
        paths = receiver.paths
        for e in range(experts):
            name = f"model.layers.1.mlp.experts.{e}.up_proj.weight"
            mine = rank * local <= e < (rank + 1) * local
            assert paths[name].kind is (PathKind.PRESERVING if mine else PathKind.SKIP), name
            assert paths[name].reported is mine
        assert paths["model.norm.weight"].kind is PathKind.TRANSFORMING
        assert paths["model.norm.weight"].copies[0].strategy is CopyStrategy.SPARSE
        assert paths[A_LOG].kind is PathKind.TRANSFORMING
        assert paths[A_LOG].copies[0].strategy is CopyStrategy.PLACEHOLDER
        assert paths[DT_BIAS].kind is PathKind.PRESERVING
        for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.0.mlp.gate.weight"):
            assert paths[name].kind is PathKind.PRESERVING
        transforming = {n for n, p in paths.items() if p.kind is PathKind.TRANSFORMING}
        assert transforming == {"model.norm.weight", A_LOG}
        assert receiver.xor_allowed() == set(w0) - transforming
    # Vocabulary padding: 250 rows padded to 256 at tp 4 -> 64 rows a rank, 6 of them padding
    # on the last rank, which the loader zero-fills.
    assert padded_vocab(250, 4) == 256
    last = receivers[-1].paths["model.embed_tokens.weight"]
    assert [f.value for f in last.fills] == [0]
    assert last.fills[0].dst.shape == (6, int(config["hidden_size"]))
    assert last.xor_allowed


def test_kv_heads_are_replicated_below_tp() -> None:
    """nkv=2 < tp=4: ranks 0,1 hold kv head 0 and ranks 2,3 kv head 1 (like vLLM)."""
    family, tp = "llama", 4
    config = tp_config(family, tp)
    w0 = base_state_dict(config, family, extra=False)
    hd = int(config["head_dim"])
    k = w0["model.layers.0.self_attn.k_proj.weight"]
    for rank in range(tp):
        model = dense_reference(config, family, w0, tp, rank, extra=False).module
        qkv = model.rank_tensors()["model.layers.0.self_attn.qkv_proj.weight"]
        q_rows = 12 // tp * hd
        head = rank * 2 // tp
        assert np.array_equal(bits(qkv[q_rows : q_rows + hd]), bits(k[head * hd : (head + 1) * hd]))


def test_tied_lm_head_is_a_native_skip() -> None:
    family, tp = "qwen3", 2
    config = tp_config(family, tp)
    assert config["tie_word_embeddings"]
    w0 = base_state_dict(config, family)
    w0["lm_head.weight"] = w0["model.embed_tokens.weight"].clone()
    w1 = update(w0, rate=0.03, seed=3)
    w1["lm_head.weight"] = w1["model.embed_tokens.weight"].clone()
    receivers = _ranks(family, tp, w0)
    for receiver in receivers:
        assert receiver.paths["lm_head.weight"].kind is PathKind.SKIP
        assert "model.embed_tokens.weight" in receiver.xor_allowed()
    items = make_items(w0, w1, xor_allowed_across(receivers))
    for rank, receiver in enumerate(receivers):
        receiver.apply_items(items, attempt=1)
        want = snapshot(dense_reference(config, family, w1, tp, rank).module)
        assert bit_diff(snapshot(receiver.loader.module), want) == []


@pytest.mark.parametrize("scheme", list(PlaceholderScheme))
def test_nan_values_on_a_transforming_path_take_two_passes(scheme: PlaceholderScheme) -> None:
    family, tp = "llama", 1
    config = tp_config(family, tp)
    w0 = base_state_dict(config, family)
    w1 = {n: t.clone() for n, t in w0.items()}
    a = bits(w1[A_LOG])
    a[1] = 0x7FC1  # NaN with a payload: cannot be told from the NaN placeholder
    a[2] = 0x8000
    a[5] = 0xFF80
    (receiver,) = _ranks(family, tp, w0, placeholder=scheme)
    (item,) = make_items(w0, w1, receiver.xor_allowed())
    assert item.encoding is Encoding.OVERWRITE
    report = receiver.apply_item(item, attempt=4)
    assert report.loader_calls == 2 and report.dense and report.written == 3
    want = snapshot(dense_reference(config, family, w1, tp, 0).module)
    assert bit_diff(snapshot(receiver.loader.module), want) == []


def test_single_pass_placeholder_when_values_hold_no_nan() -> None:
    family, tp = "llama", 1
    config = tp_config(family, tp)
    w0 = base_state_dict(config, family)
    w1 = {n: t.clone() for n, t in w0.items()}
    bits(w1[A_LOG])[3] ^= 0x0100
    (receiver,) = _ranks(family, tp, w0)
    (item,) = make_items(w0, w1, receiver.xor_allowed())
    report = receiver.apply_item(item)
    assert report.loader_calls == 1 and report.written == 1
    want = snapshot(dense_reference(config, family, w1, tp, 0).module)
    assert bit_diff(snapshot(receiver.loader.module), want) == []


def test_dense_load_restores_a_receiver() -> None:
    family, tp = "qwen3", 2
    config = tp_config(family, tp)
    w0 = base_state_dict(config, family)
    w1 = update(w0, rate=0.5, seed=2)
    receiver = _ranks(family, tp, w0)[1]
    receiver.dense_load(w1)
    want = snapshot(dense_reference(config, family, w1, tp, 1).module)
    assert bit_diff(snapshot(receiver.loader.module), want) == []


def test_an_item_entirely_on_other_ranks_writes_nothing() -> None:
    family, tp = "llama", 2
    config = tp_config(family, tp)
    w0 = base_state_dict(config, family)
    receivers = _ranks(family, tp, w0)
    name = "model.layers.0.mlp.down_proj.weight"  # row-parallel: rank 0 holds columns [0, 48)
    t = w0[name]
    cols = t.shape[1] // tp
    rows = np.arange(t.shape[0], dtype=np.int64)
    idx = np.sort(rows[:, None] * t.shape[1] + cols + np.arange(3)).reshape(-1)
    item = Item(
        name=name,
        shape=tuple(t.shape),
        dtype=t.dtype,
        encoding=Encoding.XOR,
        indices=idx,
        values=np.full(idx.size, 0x0101, dtype=np.uint16),
    )
    before = snapshot(receivers[0].loader.module)
    assert receivers[0].apply_item(item).written == 0
    assert bit_diff(snapshot(receivers[0].loader.module), before) == []
    assert receivers[1].apply_item(item).written == idx.size


def test_reference_loader_skips_unknown_names() -> None:
    config = tp_config("llama", 1)
    w0 = base_state_dict(config, "llama", extra=False)
    loader = ShardedServingLoader.dense(config, "llama", w0)
    assert loader.load_weights([("model.unknown.weight", torch.zeros(2))]) == set()
