"""The sparse path: apply cost follows the entries, not the tensor (docs/architecture.md,
"Receiver data plane")."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from apply_helpers import (
    base_state_dict,
    bit_diff,
    catalog_of,
    dense_reference,
    make_items,
    snapshot,
    tp_config,
    update,
)
from torch.utils._python_dispatch import TorchDispatchMode

from dcr.adapters.loaders.torch_module import TorchModuleLoader
from dcr.apply import Applier, CopyStrategy, Loader
from dcr.tensors.bits import bits
from dcr.tensors.records import Encoding, Item

# Every test runs with the C kernels and with numpy only (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("both_paths")

_INDEX_PUT = {torch.ops.aten.index_put_.default, torch.ops.aten._index_put_impl_.default}
_SCATTER = {torch.ops.aten.scatter_.src}


class LargestTouch(TorchDispatchMode):
    """Largest number of elements any executed op computes or writes.

    Views are free; an in-place op counts the tensor it writes, except ``index_put_`` and
    ``scatter_``, which write only at their indices; a functional op counts its outputs.
    """

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0
        self.ops: list[tuple[str, int]] = []

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = func._schema
        writes = [
            args[i]
            for i, a in enumerate(schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write and i < len(args)
        ]
        if func in _INDEX_PUT or func in _SCATTER:
            touched = int(args[2].numel())
        elif writes:
            touched = max(int(t.numel()) for t in writes if isinstance(t, torch.Tensor))
        elif all(r.alias_info is not None for r in schema.returns):
            touched = 0  # a view
        else:
            results = out if isinstance(out, tuple | list) else [out]
            touched = max(
                (int(t.numel()) for t in results if isinstance(t, torch.Tensor)), default=0
            )
        self.ops.append((str(func), touched))
        self.largest = max(self.largest, touched)
        return out


class Big(torch.nn.Module):
    def __init__(self, rows: int, cols: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(rows, cols, dtype=torch.bfloat16))
        self.t = torch.nn.Parameter(torch.zeros(cols, rows, dtype=torch.bfloat16))
        self.every_other = torch.nn.Parameter(torch.zeros(rows, cols // 2, dtype=torch.bfloat16))


class Views(Loader):
    """Loads ``w`` plainly, ``t`` transposed and every other column of ``w`` separately."""

    def __init__(self, module: Big) -> None:
        self._module = module

    @property
    def module(self) -> torch.nn.Module:
        return self._module

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        m = self._module
        loaded = set()
        with torch.no_grad():
            for name, t in weights:
                if name == "w":
                    m.w.copy_(t)
                    m.every_other.copy_(t[:, ::2])
                    loaded |= {"w", "every_other"}
                elif name == "t":
                    m.t.copy_(t.t())
                    loaded.add("t")
        return loaded


ROWS, COLS = 1024, 512


def _items(
    sd: dict[str, torch.Tensor], count: int, seed: int
) -> tuple[list[Item], dict[str, torch.Tensor]]:
    rng = np.random.default_rng(seed)
    new = {n: t.clone() for n, t in sd.items()}
    for t in new.values():
        flat = bits(t).reshape(-1)
        flat[rng.choice(flat.size, size=count, replace=False)] ^= np.uint16(0x0155)
    return make_items(sd, new, set(sd)), new


def test_xor_items_on_large_tensors_touch_only_their_entries() -> None:
    gen = torch.Generator().manual_seed(0)
    sd = {
        "w": torch.randn(ROWS, COLS, generator=gen).to(torch.bfloat16),
        "t": torch.randn(ROWS, COLS, generator=gen).to(torch.bfloat16),
    }
    module = Big(ROWS, COLS)
    loader = Views(module)
    loader.dense_load(sd)
    receiver = Applier(loader, catalog_of(sd))
    receiver.prewarm()
    strategies = {c.strategy for p in receiver.paths.values() for c in p.copies}
    assert strategies == {CopyStrategy.SPARSE}
    items, new = _items(sd, 40, seed=1)
    assert {i.encoding for i in items} == {Encoding.XOR}
    trace = LargestTouch()
    with trace:
        report = receiver.apply_items(items)
    assert trace.largest <= 64, sorted(trace.ops, key=lambda o: -o[1])[:5]
    assert not any(r.dense for r in report.items)
    assert report.written == 40 + 40 + sum(int(i) % COLS % 2 == 0 for i in items[0].indices)
    want = Big(ROWS, COLS)
    Views(want).dense_load(new)
    assert bit_diff(snapshot(module), snapshot(want)) == []


def test_the_control_dense_fill_would_be_seen() -> None:
    """The trace does count whole-tensor work (so the test above can fail)."""
    scratch = torch.zeros(ROWS, COLS, dtype=torch.bfloat16)
    trace = LargestTouch()
    with trace:
        scratch.fill_(float("nan"))
        scratch.view(-1)[torch.tensor([3])] = 1.0
    assert trace.largest == ROWS * COLS


@pytest.mark.parametrize("tp", [2, 3])
def test_sharded_overwrite_items_are_sparse_too(tp: int) -> None:
    family = "qwen3_moe"
    config = tp_config(family, tp)
    w0 = base_state_dict(config, family)
    w1 = update(w0, rate=0.001, seed=4, specials=0)
    loader = dense_reference(config, family, w0, tp, tp - 1)
    receiver = Applier(loader, catalog_of(w0))
    receiver.prewarm()
    items = [i for i in make_items(w0, w1, frozenset()) if i.name != "model.layers.0.mixer.A_log"]
    trace = LargestTouch()
    with trace:
        report = receiver.apply_items(items)
    assert not any(r.dense for r in report.items)
    assert trace.largest <= max(i.count for i in items) * 2
    want = snapshot(
        dense_reference(
            config, family, {**w0, **{i.name: w1[i.name] for i in items}}, tp, tp - 1
        ).module
    )
    assert bit_diff(snapshot(loader.module), want) == []


def test_a_broadcast_source_takes_the_enumerating_strategy() -> None:
    class Broadcast(Loader):
        def __init__(self) -> None:
            self._module = torch.nn.Module()
            self._module.rows = torch.nn.Parameter(torch.zeros(3, 5, dtype=torch.float16))

        @property
        def module(self) -> torch.nn.Module:
            return self._module

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            with torch.no_grad():
                for _, t in weights:
                    self._module.rows.copy_(t)  # (5,) broadcast to every row
            return {"rows"}

    w0 = {"bias": torch.arange(5, dtype=torch.float16)}
    w1 = {"bias": w0["bias"].clone()}
    bits(w1["bias"])[[1, 4]] ^= np.uint16(0x8000)
    loader = Broadcast()
    loader.dense_load(w0)
    receiver = Applier(loader, catalog_of(w0))
    receiver.prewarm()
    assert receiver.paths["bias"].copies[0].strategy is CopyStrategy.ENUMERATE
    assert receiver.xor_allowed() == {"bias"}
    report = receiver.apply_items(make_items(w0, w1, receiver.xor_allowed()))
    assert report.written == 6
    want = Broadcast()
    want.dense_load(w1)
    assert bit_diff(snapshot(loader.module), snapshot(want.module)) == []


def test_nan_through_a_cast_is_converted_in_the_destination_layout() -> None:
    """torch casts float16 NaNs to float32 differently in vector bodies and scalar tails."""

    class Wide(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.x = torch.nn.Parameter(torch.zeros(17, dtype=torch.float32))

    w0 = {"x": torch.arange(17, dtype=torch.float16)}
    w1 = {"x": w0["x"].clone()}
    bits(w1["x"])[[2, 16]] = np.uint16(0x7C01)  # a signalling NaN, in the body and in the tail
    module = Wide()
    TorchModuleLoader(module).dense_load(w0)
    receiver = Applier(TorchModuleLoader(module), catalog_of(w0))
    receiver.prewarm()
    report = receiver.apply_items(make_items(w0, w1, receiver.xor_allowed()))
    assert report.items[0].dense
    want = Wide()
    TorchModuleLoader(want).dense_load(w1)
    assert bit_diff(snapshot(module), snapshot(want)) == []
