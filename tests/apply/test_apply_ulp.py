"""ULP items: ``stored = unordered(ordered(stored) + delta)``, checked on bits for every float."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from apply_helpers import (
    base_state_dict,
    bit_diff,
    catalog_of,
    dense_reference,
    snapshot,
    tp_config,
    update,
)

import dcr.apply.rmw as rmw
from dcr.adapters.loaders.torch_module import TorchModuleLoader
from dcr.apply import Applier, ApplyConfig
from dcr.errors import LoaderConditionViolated
from dcr.tensors.bits import bits, changed_indices, numpy_bits_dtype
from dcr.tensors.ordered import ULP_DTYPES, ulp_delta
from dcr.tensors.records import Encoding, Item

FLOATS = sorted(ULP_DTYPES, key=str)


def _specials(dtype: torch.dtype) -> list[int]:
    """±0, ±inf (or the largest finite), NaNs, the smallest subnormals and normals."""
    width = torch.finfo(dtype).bits
    mantissa = round(-np.log2(torch.finfo(dtype).eps))
    sign = 1 << (width - 1)
    exp_all = ((1 << (width - 1 - mantissa)) - 1) << mantissa
    smallest_normal = 1 << mantissa
    pats = [0, sign, 1, sign | 1, smallest_normal - 1, smallest_normal, sign | smallest_normal]
    pats += [exp_all, sign | exp_all, exp_all | 1, sign | exp_all | (1 << (mantissa - 1))]
    pats += [exp_all - 1, sign | (exp_all - 1), (1 << width) - 1]
    return pats


def _pair(dtype: torch.dtype, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Old and new stored words: every special-to-special transition, then random words."""
    word = numpy_bits_dtype(dtype)
    rng = np.random.default_rng(seed)
    sp = np.array(_specials(dtype), dtype=np.uint64)
    old_sp, new_sp = np.repeat(sp, sp.size), np.tile(sp, sp.size)
    width = torch.finfo(dtype).bits
    rand_old = rng.integers(0, 1 << width, size=n, dtype=np.uint64)
    # Near neighbours (a few ULP, across zero and the subnormal boundary) and far jumps.
    step = rng.integers(-3, 4, size=n).astype(np.int64)
    rand_new = np.where(
        rng.random(n) < 0.5,
        (rand_old.astype(np.int64) + step).astype(np.uint64) & np.uint64((1 << width) - 1),
        rng.integers(0, 1 << width, size=n, dtype=np.uint64),
    )
    old = np.concatenate([old_sp, rand_old]).astype(word)
    new = np.concatenate([new_sp, rand_new]).astype(word)
    return old, new


def _tensor(words: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    t = torch.empty(words.size, dtype=dtype)
    bits(t)[...] = words
    return t


class One(torch.nn.Module):
    def __init__(self, n: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.x = torch.nn.Parameter(torch.zeros(n, dtype=dtype), requires_grad=False)


@pytest.mark.parametrize("check", [False, True])
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_ulp_items_give_the_new_bits_for_every_float(dtype: torch.dtype, check: bool) -> None:
    old, new = _pair(dtype, 3000, seed=FLOATS.index(dtype))
    w0, w1 = {"x": _tensor(old, dtype)}, {"x": _tensor(new, dtype)}
    module = One(old.size, dtype)
    loader = TorchModuleLoader(module)
    loader.dense_load(w0)
    receiver = Applier(loader, catalog_of(w0), ApplyConfig(post_apply_checks=check))
    receiver.prewarm()
    assert receiver.xor_allowed() == {"x"}
    idx = changed_indices(new, old)
    item = Item(
        name="x",
        shape=(old.size,),
        dtype=dtype,
        encoding=Encoding.ULP,
        indices=idx,
        values=ulp_delta(new[idx], old[idx]),
    )
    report = receiver.apply_item(item)
    assert report.written == idx.size and report.checked == (idx.size if check else 0)
    assert np.array_equal(bits(module.x), new)
    want = One(old.size, dtype)
    TorchModuleLoader(want).dense_load(w1)
    assert np.array_equal(bits(module.x), bits(want.x))
    # Relative to the base: applied once more, it moves the bits again (retries must not).
    receiver.apply_item(item)
    assert not np.array_equal(bits(module.x), new)


def test_ulp_items_through_a_sharded_loader_equal_a_dense_load() -> None:
    family, tp = "qwen3", 2
    config = tp_config(family, tp)
    w0 = base_state_dict(config, family)
    w1 = update(w0, rate=0.05, seed=3)
    for rank in range(tp):
        loader = dense_reference(config, family, w0, tp, rank)
        receiver = Applier(loader, catalog_of(w0), ApplyConfig(post_apply_checks=True))
        receiver.prewarm()
        items = []
        for name, t in w1.items():
            b_new, b_old = bits(t).reshape(-1), bits(w0[name]).reshape(-1)
            idx = changed_indices(b_new, b_old)
            if not idx.size:
                continue
            ulp = name in receiver.xor_allowed() and t.dtype in ULP_DTYPES
            items.append(
                Item(
                    name=name,
                    shape=tuple(t.shape),
                    dtype=t.dtype,
                    encoding=Encoding.ULP if ulp else Encoding.OVERWRITE,
                    indices=idx,
                    values=ulp_delta(b_new[idx], b_old[idx]) if ulp else b_new[idx],
                )
            )
        assert Encoding.ULP in {i.encoding for i in items}
        receiver.apply_items(items, attempt=1)
        want = dense_reference(config, family, w1, tp, rank)
        assert bit_diff(snapshot(loader.module), snapshot(want.module)) == []


@pytest.mark.usefixtures("numpy_path")
def test_the_post_apply_check_catches_a_wrong_ulp_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check re-reads the written bits: a write that lands wrong is reported (numpy
    writer; the C writer's check is tested in tests/test_native.py)."""
    old, new = _pair(torch.bfloat16, 100, seed=9)
    w0 = {"x": _tensor(old, torch.bfloat16)}
    module = One(old.size, torch.bfloat16)
    loader = TorchModuleLoader(module)
    loader.dense_load(w0)
    receiver = Applier(loader, catalog_of(w0), ApplyConfig(post_apply_checks=True))
    receiver.prewarm()
    idx = changed_indices(new, old)
    item = Item(
        name="x",
        shape=(old.size,),
        dtype=torch.bfloat16,
        encoding=Encoding.ULP,
        indices=idx,
        values=ulp_delta(new[idx], old[idx]),
    )
    real = rmw._ulp_add
    calls = []

    def off_by_one_once(stored: np.ndarray, delta: np.ndarray) -> np.ndarray:
        calls.append(1)
        out = real(stored, delta)
        return out ^ 1 if len(calls) == 1 else out

    monkeypatch.setattr(rmw, "_ulp_add", off_by_one_once)
    with pytest.raises(LoaderConditionViolated) as err:
        receiver.apply_item(item)
    assert err.value.check == "post-apply"
