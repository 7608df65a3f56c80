"""Receivers over plain torch modules (``load_state_dict``-style loader)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from apply_helpers import SPECIAL_BITS, bit_diff, catalog_of, make_items, snapshot, update
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcr.adapters.loaders.torch_module import TorchModuleLoader
from dcr.apply import Applier, PathKind
from dcr.errors import ConfigError, PayloadRejected
from dcr.tensors.bits import bits, numpy_bits_dtype
from dcr.tensors.records import Encoding


class Tiny(torch.nn.Module):
    """Parameters of several dtypes, a tied pair and a buffer."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16, norm_dtype: torch.dtype | None = None):
        super().__init__()
        self.embed = torch.nn.Parameter(torch.zeros(16, 8, dtype=dtype))
        self.proj = torch.nn.Parameter(torch.zeros(8, 8, dtype=dtype))
        self.norm = torch.nn.Parameter(torch.zeros(8, dtype=norm_dtype or dtype))
        self.head = self.embed  # tied: one Parameter under two names
        self.register_buffer("scale", torch.zeros(4, dtype=torch.float32))


def _state_dict(seed: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    embed = torch.randn(16, 8, generator=gen).to(dtype)
    return {
        "embed": embed,
        "proj": torch.randn(8, 8, generator=gen).to(dtype),
        "norm": (1 + 0.1 * torch.randn(8, generator=gen)).to(dtype),
        "head": embed.clone(),
        "scale": torch.randn(4, generator=gen),
    }


def _tied_update(sd: dict[str, torch.Tensor], seed: int, rate: float) -> dict[str, torch.Tensor]:
    out = update(sd, rate=rate, seed=seed)
    out["head"] = out["embed"].clone()  # a tied checkpoint holds the same bits under both names
    return out


def _dense(sd: dict[str, torch.Tensor], **kw: torch.dtype) -> Tiny:
    module = Tiny(**kw)
    TorchModuleLoader(module).dense_load(sd)
    return module


@pytest.mark.parametrize("rate", [0.0, 0.03, 0.5, 1.0])
def test_refit_equals_dense_load(rate: float) -> None:
    w0 = _state_dict(0)
    w1 = _tied_update(w0, seed=1, rate=rate)
    module = _dense(w0, norm_dtype=torch.float32)
    receiver = Applier(TorchModuleLoader(module), catalog_of(w0))
    receiver.prewarm()
    paths = receiver.paths
    assert paths["proj"].kind is PathKind.PRESERVING
    assert paths["norm"].kind is PathKind.TRANSFORMING  # bf16 -> fp32 cast on copy
    assert paths["embed"].overlaps == {"head"} and paths["head"].overlaps == {"embed"}
    assert receiver.xor_allowed() == {"proj", "scale"}
    items = make_items(w0, w1, receiver.xor_allowed())
    receiver.apply_items(items, attempt=1)
    assert bit_diff(snapshot(module), snapshot(_dense(w1, norm_dtype=torch.float32))) == []


def test_xor_on_a_tied_name_is_rejected() -> None:
    w0 = _state_dict(0)
    module = _dense(w0)
    receiver = Applier(TorchModuleLoader(module), catalog_of(w0))
    receiver.prewarm()
    w1 = _tied_update(w0, seed=2, rate=0.1)
    (item,) = [i for i in make_items(w0, w1, {"embed"}) if i.name == "embed"]
    before = snapshot(module)
    with pytest.raises(PayloadRejected) as err:
        receiver.apply_item(item, attempt=9)
    assert err.value.check == "classification" and err.value.attempt == 9
    assert bit_diff(snapshot(module), before) == []


def test_unknown_names_are_not_loaded_or_reported() -> None:
    module = Tiny()
    loader = TorchModuleLoader(module)
    assert loader.load_weights([("nope", torch.zeros(3)), ("norm", torch.ones(8))]) == {"norm"}
    with pytest.raises(ConfigError):
        loader.load_weights([("norm", torch.ones(9))])


def test_a_catalog_name_the_module_lacks_is_a_native_skip() -> None:
    w0 = _state_dict(0)
    w0["other_rank.weight"] = torch.ones(4, dtype=torch.bfloat16)
    receiver = Applier(
        TorchModuleLoader(_dense({k: v for k, v in w0.items() if k != "other_rank.weight"})),
        catalog_of(w0),
    )
    receiver.prewarm()
    assert receiver.paths["other_rank.weight"].kind is PathKind.SKIP
    assert "other_rank.weight" in receiver.xor_allowed()


# --- property tests -------------------------------------------------------------------------

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


class One(torch.nn.Module):
    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        self.register_buffer("b", torch.zeros(shape[-1:], dtype=dtype))


@st.composite
def _cases(draw: st.DrawFn, max_side: int) -> tuple[object, ...]:
    shape = tuple(draw(st.lists(st.integers(1, max_side), min_size=1, max_size=3)))
    canonical = draw(st.sampled_from(DTYPES))
    resident = draw(st.sampled_from([canonical, *DTYPES]))
    seed = draw(st.integers(0, 2**32 - 1))
    rate = draw(st.sampled_from([0.0, 0.01, 0.3, 1.0]))
    return shape, canonical, resident, seed, rate


def _random_bits(
    shape: tuple[int, ...], dtype: torch.dtype, rng: np.random.Generator
) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype)
    flat = bits(t).reshape(-1)
    width = np.dtype(numpy_bits_dtype(dtype)).itemsize * 8
    flat[:] = rng.integers(0, 1 << width, size=flat.size, dtype=np.uint64).astype(flat.dtype)
    specials = SPECIAL_BITS[dtype]
    flat[: min(len(specials), flat.size)] = np.array(specials[: flat.size], dtype=np.uint64)
    return t


def _property(case: tuple[object, ...]) -> None:
    shape, canonical, resident, seed, rate = case
    assert isinstance(shape, tuple) and isinstance(canonical, torch.dtype)
    assert isinstance(resident, torch.dtype) and isinstance(seed, int)
    assert isinstance(rate, float)
    rng = np.random.default_rng(seed)
    w0 = {"w": _random_bits(shape, canonical, rng), "b": _random_bits(shape[-1:], canonical, rng)}
    w1 = update(w0, rate=rate, seed=seed + 1)
    module = One(shape, resident)
    TorchModuleLoader(module).dense_load(w0)
    receiver = Applier(TorchModuleLoader(module), catalog_of(w0))
    receiver.prewarm()
    preserving = resident == canonical
    assert receiver.xor_allowed() == ({"w", "b"} if preserving else set())
    receiver.apply_items(make_items(w0, w1, receiver.xor_allowed()), attempt=1)
    want = One(shape, resident)
    TorchModuleLoader(want).dense_load(w1)
    assert bit_diff(snapshot(module), snapshot(want)) == []


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_cases(max_side=9))
def test_property_refit_equals_dense_load(case: tuple[object, ...]) -> None:
    _property(case)


@pytest.mark.heavy
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_cases(max_side=96))
def test_property_refit_equals_dense_load_heavy(case: tuple[object, ...]) -> None:
    _property(case)


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(DTYPES), st.integers(0, 2**32 - 1))
def test_property_xor_twice_restores_overwrite_twice_is_idempotent(
    dtype: torch.dtype, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    w0 = {"w": _random_bits((5, 7), dtype, rng), "b": _random_bits((7,), dtype, rng)}
    w1 = update(w0, rate=0.4, seed=seed)
    module = One((5, 7), dtype)
    TorchModuleLoader(module).dense_load(w0)
    receiver = Applier(TorchModuleLoader(module), catalog_of(w0))
    receiver.prewarm()
    start = snapshot(module)
    xor = make_items(w0, w1, receiver.xor_allowed())
    assert all(i.encoding is Encoding.XOR for i in xor)
    receiver.apply_items(xor)
    receiver.apply_items(xor)
    assert bit_diff(snapshot(module), start) == []
    over = make_items(w0, w1, frozenset())
    receiver.apply_items(over)
    after_once = snapshot(module)
    receiver.apply_items(over)
    assert bit_diff(snapshot(module), after_once) == []
    want = One((5, 7), dtype)
    TorchModuleLoader(want).dense_load(w1)
    assert bit_diff(after_once, snapshot(want)) == []
