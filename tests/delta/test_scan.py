"""Fused detection + gather, affine segments, threaded construction, canonical change counts and
the ULP construction option."""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dcr.delta.owner as owner_module
from dcr.delta.build import BuildConfig, BuildStats
from dcr.delta.group import LocalTrainingGroup
from dcr.delta.layout import TrainLayout, build_plan
from dcr.delta.mapping import ColumnParallel, FusedQKV, GatedMLP, RowParallel, Tied
from dcr.errors import ConfigError
from dcr.models.families import canonical_shapes, random_state_dict, tiny_config
from dcr.models.updates import apply_to_state_dict, perturb, special_patterns
from dcr.tensors import parallel
from dcr.tensors.bits import bits, changed_words
from dcr.tensors.ordered import ordered, unordered
from dcr.tensors.parallel import ordered_map
from dcr.tensors.records import Encoding, Item, Mode, TensorSpec

# Every test runs with the C kernels and with numpy only (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("both_paths")

WORDS = [np.uint8, np.uint16, np.uint32, np.uint64]


def catalog_of(sd: dict[str, torch.Tensor]) -> dict[str, TensorSpec]:
    return {n: TensorSpec.of(n, t) for n, t in sd.items()}


# ---------------------------------------------------------------------- changed_words


@settings(max_examples=80, deadline=None)
@given(
    word=st.sampled_from(WORDS),
    n=st.integers(0, 5000),
    density=st.sampled_from([0.0, 0.004, 0.01, 0.015, 0.02, 0.025, 0.03, 0.05, 0.08, 0.2, 1.0]),
    skew_new=st.integers(0, 7),
    skew_old=st.integers(0, 7),
    seed=st.integers(0, 2**32 - 1),
)
def test_changed_words_equal_a_bitwise_reference(word, n, density, skew_new, skew_old, seed):
    # Densities span numpy's two scan strategies and the padded band between them; skews put
    # the arrays at every byte offset so head and tail elements take the plain path.
    rng = np.random.default_rng(seed)
    width = np.dtype(word).itemsize
    raw = rng.integers(0, 256, (n + 8) * width, dtype=np.uint8)
    new = raw[skew_new * width : skew_new * width + n * width].view(word)
    old_buf = np.empty((n + 8) * width, dtype=np.uint8)
    old = old_buf[skew_old * width : skew_old * width + n * width].view(word)
    old[:] = new
    flip = np.flatnonzero(rng.random(n) < density)
    shift = rng.integers(0, 8 * width, flip.size).astype(word)
    old[flip] ^= np.left_shift(word(1), shift)
    pos, xor, vals = changed_words(new, old, new_values=True)
    expect = np.flatnonzero(new != old)
    assert pos.dtype == np.int64
    np.testing.assert_array_equal(pos, expect)
    np.testing.assert_array_equal(xor, new[expect] ^ old[expect])
    assert vals is not None
    np.testing.assert_array_equal(vals, new[expect])
    assert changed_words(new, old)[2] is None


@pytest.mark.parametrize("density", [0.015, 0.03, 0.06, 0.099])
def test_padded_scan_band_on_a_large_block(density):
    # A million-element block in the band where the flag scan is padded past 10 % density.
    rng = np.random.default_rng(1)
    new = rng.integers(0, 1 << 16, 1 << 20, dtype=np.uint16)
    old = new.copy()
    old[rng.random(new.size) < density / 4] ^= 1  # word density ~ density
    pos, xor, _ = changed_words(new, old)
    np.testing.assert_array_equal(pos, np.flatnonzero(new != old))
    assert (xor == 1).all()


# ---------------------------------------------------------------------- ordered_map


def test_ordered_map_keeps_order_bounds_the_window_and_propagates_errors():
    running = 0
    peak = 0
    lock = threading.Lock()
    gate = threading.Event()

    def work(i: int) -> int:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        gate.wait(0.002)
        with lock:
            running -= 1
        return i * i

    assert list(ordered_map(work, range(50), threads=4, window=3)) == [i * i for i in range(50)]
    assert peak <= 3
    assert list(ordered_map(work, range(5), threads=1)) == [0, 1, 4, 9, 16]

    def fail(i: int) -> int:
        if i == 7:
            raise ValueError("seven")
        return i

    got = []
    with pytest.raises(ValueError, match="seven"):
        for v in ordered_map(fail, range(20), threads=2):
            got.append(v)
    assert got == list(range(7))


def test_maps_running_at_once_share_the_threads_and_run_inline_below_two_each():
    """Two maps of two threads each, at once: each one's share is one thread, so each runs
    its tasks in the thread that consumes it; once one ends, the other uses the pool."""
    me = threading.get_ident()
    seen: dict[str, list[int]] = {"a": [], "b": []}

    def work(tag: str) -> Callable[[int], int]:
        def run(i: int) -> int:
            seen[tag].append(threading.get_ident())
            return i

        return run

    gc.collect()  # maps another test left unfinished end here
    assert parallel._running == 0
    a = ordered_map(work("a"), range(40), threads=2, window=2)
    b = ordered_map(work("b"), range(40), threads=2, window=2)
    assert next(a) == 0  # a alone: its first tasks go to the pool
    assert set(seen["a"]) and me not in seen["a"]
    assert parallel._running == 1
    assert list(b) == list(range(40))  # a is still running: b's share is one thread
    assert set(seen["b"]) == {me}
    assert parallel._running == 1
    done = len(seen["a"])
    assert list(a) == list(range(1, 40))  # alone again: back on the pool
    assert me not in seen["a"][done:]
    assert parallel._running == 0
    c = ordered_map(work("a"), range(40), threads=2)
    next(c)
    assert parallel._running == 1
    c.close()  # an abandoned map no longer counts
    assert parallel._running == 0


# ---------------------------------------------------------------------- segments


def segment_map(mapping) -> dict[str, dict[int, int]]:
    out: dict[str, dict[int, int]] = {}
    for seg in mapping.segments():
        local = np.arange(seg.start, seg.stop, dtype=np.int64)
        for name in seg.names:
            out.setdefault(name, {}).update(
                zip(local.tolist(), seg.canonical(local).tolist(), strict=True)
            )
    return out


def project_map(mapping) -> dict[str, dict[int, int]]:
    local = np.arange(mapping.numel, dtype=np.int64)
    out: dict[str, dict[int, int]] = {}
    for d in mapping.project(local):
        src = local if d.select is None else local[d.select]
        out.setdefault(d.name, {}).update(zip(src.tolist(), d.indices.tolist(), strict=True))
    return out


MAPPINGS = [
    ColumnParallel("e", (10, 3), tp_rank=1, tp_size=2, padded_rows=16),
    ColumnParallel("e", (10, 3), tp_rank=3, tp_size=4, padded_rows=16),
    RowParallel("o", (3, 8), tp_rank=1, tp_size=4),
    GatedMLP("g", "u", (6, 4), tp_rank=1, tp_size=3),
    Tied(ColumnParallel("e", (8, 2), tp_rank=1, tp_size=2), ("h",)),
    *(
        FusedQKV(
            "q",
            "k",
            "v",
            num_heads=8,
            num_kv_heads=kv,
            head_dim=2,
            inner=inner,
            tp_rank=r,
            tp_size=tp,
        )
        for kv, tp in ((4, 2), (2, 4), (1, 2))
        for r in range(tp)
        for inner in ((3,), ())
    ),
]


@pytest.mark.parametrize("mapping", MAPPINGS, ids=lambda m: type(m).__name__)
def test_segments_equal_projection(mapping):
    assert segment_map(mapping) == project_map(mapping)


@pytest.mark.parametrize(
    ("family", "lay"),
    [("llama", dict(tp=2, dp=2)), ("qwen3", dict(tp=4)), ("qwen3_moe", dict(tp=2, ep=2))],
)
def test_family_plan_segments_equal_projection(family, lay):
    cfg = tiny_config(family)
    catalog = {
        n: TensorSpec(name=n, shape=s, dtype=torch.bfloat16)
        for n, s in canonical_shapes(cfg, family).items()
    }
    plan = build_plan(catalog, TrainLayout(**lay), family=family, config=cfg)
    for s in plan.shards:
        if s.mapping is not None:
            assert segment_map(s.mapping) == project_map(s.mapping), s.key


# ---------------------------------------------------------------------- construction


def build_items(group, mode=Mode.MIXED, xor=None):
    xor_allowed = set(group.catalog) if xor is None else xor
    items: list[Item] = []
    total = BuildStats()
    for it, stats in group.build(mode=mode, xor_allowed=xor_allowed).values():
        for bucket in it:
            items.extend(bucket.items)
        total.merge(stats)
    return items, total


def entries(items):
    out = {}
    for i in items:
        for k, v in zip(i.indices.tolist(), i.values.tolist(), strict=True):
            assert (i.name, k) not in out
            out[(i.name, k)] = (i.encoding, v)
    return out


def test_threads_and_block_size_do_not_change_the_records(monkeypatch):
    cfg = tiny_config("qwen3_moe")
    w = random_state_dict(cfg, "qwen3_moe", seed=11)
    plan = build_plan(catalog_of(w), TrainLayout(tp=2, ep=2), family="qwen3_moe", config=cfg)
    new = perturb(w, rate=0.05, seed=12)
    special_patterns(new, seed=2)
    results = []
    for threads, block in ((1, 1 << 18), (3, 64), (2, 1000)):
        monkeypatch.setattr(owner_module, "_SCAN_BLOCK", block)
        group = LocalTrainingGroup(plan, plan.slice(w), config=BuildConfig(threads=threads))
        group.stage(plan.slice(new))
        items, stats = build_items(group)
        for i in items:
            i.validate()
        results.append((entries(items), stats.changed_elements))
        receiver = {n: t.clone() for n, t in w.items()}
        apply_to_state_dict(receiver, items)
        for n in w:
            assert np.array_equal(bits(receiver[n]), bits(new[n])), n
        group.commit()
        for o in group.owners.values():  # commit moved every tracker, replicated rows too
            for key, tracker in o.trackers.items():
                assert np.array_equal(bits(tracker), bits(plan.slice(new)[key])), key
    assert results[0] == results[1] == results[2]


def test_changed_elements_count_replicated_kv_rows_once():
    # TP=4 with 2 KV heads: each KV head's rows sit on two ranks; only one projects them.
    cfg = tiny_config("llama", num_attention_heads=4, num_key_value_heads=2)
    w = random_state_dict(cfg, "llama", seed=13)
    plan = build_plan(catalog_of(w), TrainLayout(tp=4), family="llama", config=cfg)
    group = LocalTrainingGroup(plan, plan.slice(w))
    name = "model.layers.0.self_attn.k_proj.weight"
    new = {n: t.clone() for n, t in w.items()}
    bits(new[name])[...] ^= 1  # every element's stored bits change
    group.stage(plan.slice(new))
    items, stats = build_items(group)
    assert stats.changed_elements == new[name].numel() == sum(i.count for i in items)


def test_changed_elements_count_canonical_elements_once():
    cfg = tiny_config("qwen3")
    w = random_state_dict(cfg, "qwen3", seed=14)
    plan = build_plan(catalog_of(w), TrainLayout(tp=4, dp=2), family="qwen3", config=cfg)
    group = LocalTrainingGroup(plan, plan.slice(w))
    new = perturb(w, rate=0.3, seed=15)
    group.stage(plan.slice(new))
    _, stats = build_items(group)
    expect = sum(int((bits(w[n]) != bits(new[n])).sum()) for n in w)
    assert stats.changed_elements + stats.residual_changed == expect > 0


def test_ulp_encoding_reproduces_new_bits_for_float_tensors():
    sd = {
        "a": torch.randn(300, dtype=torch.float32).to(torch.bfloat16),
        "b": torch.randn(70, dtype=torch.float32),
        "c": torch.randint(-50, 50, (90,), dtype=torch.int32),
        "d": torch.randn(40, dtype=torch.float32).to(torch.float16),
    }
    new = perturb(sd, rate=0.5, seed=16)
    special_patterns(new, seed=4)  # ±0, NaN payloads, ±inf, subnormals
    bits(new["c"])[::3] ^= 5
    plan = build_plan(catalog_of(sd), TrainLayout(dp=2))
    group = LocalTrainingGroup(
        plan, plan.slice(sd), config=BuildConfig(relative_encoding=Encoding.ULP)
    )
    group.stage(plan.slice(new))
    items, stats = build_items(group, xor={"a", "b", "c"})
    enc = {i.name: i.encoding for i in items}
    assert enc == {"a": Encoding.ULP, "b": Encoding.ULP, "c": Encoding.XOR, "d": Encoding.OVERWRITE}
    for i in items:
        old = bits(sd[i.name]).reshape(-1)[i.indices]
        want = bits(new[i.name]).reshape(-1)[i.indices]
        if i.encoding is Encoding.ULP:
            with np.errstate(over="ignore"):
                got = unordered(ordered(old) + i.values)
        elif i.encoding is Encoding.XOR:
            got = old ^ i.values
        else:
            got = i.values
        np.testing.assert_array_equal(got, want, err_msg=i.name)
    counts = {i.name: i.count for i in items}
    assert stats.ulp_entries == counts["a"] + counts["b"] and stats.ulp_items == 2
    assert stats.xor_entries == counts["c"] and stats.overwrite_entries == counts["d"]
    # XOR on request, and overwrite mode never emits relative entries
    group2 = LocalTrainingGroup(
        plan, plan.slice(sd), config=BuildConfig(relative_encoding=Encoding.XOR)
    )
    group2.stage(plan.slice(new))
    assert {i.encoding for i in build_items(group2, xor={"a", "b"})[0]} == {
        Encoding.XOR,
        Encoding.OVERWRITE,
    }
    group.discard()
    group.stage(plan.slice(new))
    assert {i.encoding for i in build_items(group, mode=Mode.OVERWRITE)[0]} == {Encoding.OVERWRITE}


def test_build_config_rejects_bad_settings():
    with pytest.raises(ConfigError):
        BuildConfig(threads=0)
    with pytest.raises(ConfigError):
        BuildConfig(relative_encoding=Encoding.OVERWRITE)


def test_changed_words_rejects_mismatched_views():
    with pytest.raises(ConfigError):
        changed_words(np.zeros(4, np.uint16), np.zeros(5, np.uint16))
    with pytest.raises(ConfigError):
        changed_words(np.zeros(4, np.uint16), np.zeros(4, np.uint32))
    with pytest.raises(ConfigError):
        changed_words(np.zeros(4, np.int16), np.zeros(4, np.int16))
