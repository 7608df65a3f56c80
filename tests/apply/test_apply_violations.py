"""Loader-condition violations fail before a bad bit lands (paper §6.1, App. A.2, Table A.2)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import numpy as np
import pytest
import torch
from apply_helpers import bit_diff, catalog_of, make_items, snapshot

from dcr.adapters.loaders.torch_module import TorchModuleLoader
from dcr.apply import Applier, Loader, PathKind
from dcr.errors import LoaderConditionViolated, LoaderPathUnsupported, PayloadRejected
from dcr.tensors.bits import bits
from dcr.tensors.records import Encoding, Item

Write = Callable[[torch.Tensor, torch.Tensor], None]


class Two(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(6, 4, dtype=torch.bfloat16))
        self.v = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))


def _copy(target: torch.Tensor, w: torch.Tensor) -> None:
    target.copy_(w)


class Switchable(Loader):
    """Loads ``w`` with ``write`` (``prewarm_write`` until :attr:`armed`), ``v`` plainly."""

    def __init__(self, write: Write, prewarm_write: Write = _copy, report: bool = True) -> None:
        self._module = Two()
        self.write = write
        self.prewarm_write = prewarm_write
        self.report = report
        self.armed = False

    @property
    def module(self) -> torch.nn.Module:
        return self._module

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = set()
        with torch.no_grad():
            for name, t in weights:
                if name == "w":
                    (self.write if self.armed else self.prewarm_write)(self._module.w, t)
                    if self.report:
                        loaded.add(name)
                elif name == "v":
                    self._module.v.copy_(t)
                    loaded.add(name)
        return loaded


def _state(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(6, 4, generator=gen).to(torch.bfloat16),
        "v": torch.randn(4, generator=gen).to(torch.bfloat16),
    }


W0, W1 = _state(0), _state(1)


def _ready(loader: Switchable) -> Applier:
    loader.dense_load(W0)
    receiver = Applier(loader, catalog_of(W0))
    receiver.prewarm()
    loader.armed = True
    return receiver


def _item(name: str = "w", encoding: Encoding = Encoding.XOR) -> Item:
    (item,) = [
        i
        for i in make_items(W0, W1, {name} if encoding is Encoding.XOR else set())
        if i.name == name
    ]
    return item


def _violates(loader: Switchable, check: str, encoding: Encoding = Encoding.XOR) -> None:
    receiver = _ready(loader)
    before = snapshot(loader.module)
    with pytest.raises(LoaderConditionViolated) as err:
        receiver.apply_item(_item(encoding=encoding), attempt=7)
    assert (err.value.check, err.value.attempt, err.value.tensor) == (check, 7, "w")
    assert bit_diff(snapshot(loader.module), before) == []


def test_a_well_behaved_loader_applies() -> None:
    """The control case: the same harness without a violation ends at the dense-load bits."""
    loader = Switchable(_copy)
    receiver = _ready(loader)
    receiver.apply_items(make_items(W0, W1, receiver.xor_allowed()))
    want = Switchable(_copy)
    want.dense_load(W1)
    assert bit_diff(snapshot(loader.module), snapshot(want.module)) == []


def test_dtype_change_on_an_xor_path() -> None:
    _violates(Switchable(lambda p, w: p.copy_(w.float())), "xor-dtype")


def test_computed_source_on_an_xor_path() -> None:
    _violates(Switchable(lambda p, w: p.copy_(w * 1)), "xor-source")


def test_overlapping_copies_within_an_item() -> None:
    def twice(p: torch.Tensor, w: torch.Tensor) -> None:
        p.copy_(w)
        p[1:2].copy_(w[0:1])

    _violates(Switchable(twice), "xor-overlap")


def test_different_writes_than_at_prewarm() -> None:
    def shifted(p: torch.Tensor, w: torch.Tensor) -> None:
        p[:3].copy_(w[3:])
        p[3:].copy_(w[:3])

    _violates(Switchable(shifted), "pattern")
    _violates(Switchable(shifted), "pattern", Encoding.OVERWRITE)


def test_reported_load_without_a_copy() -> None:
    _violates(Switchable(lambda p, w: None), "bypass")


def test_a_write_that_bypasses_dispatch_is_detected_after_it_landed() -> None:
    def behind_the_hook(p: torch.Tensor, w: torch.Tensor) -> None:
        bits(p)[...] = bits(w)  # numpy writes never reach the dispatcher

    loader = Switchable(behind_the_hook)
    receiver = _ready(loader)
    with pytest.raises(LoaderConditionViolated) as err:
        receiver.apply_item(_item(), attempt=2)
    assert err.value.check == "bypass"
    assert "overwrite retry" in str(err.value)


def test_mutating_scratch() -> None:
    def scale(p: torch.Tensor, w: torch.Tensor) -> None:
        w.mul_(2)
        p.copy_(w)

    _violates(Switchable(scale), "scratch-mutated")


def test_replacing_parameter_storage() -> None:
    def replace(p: torch.Tensor, w: torch.Tensor) -> None:
        p.data = torch.empty_like(p)
        p.copy_(w)

    loader = Switchable(replace)
    ptr = loader.module.w.data_ptr()
    _violates(loader, "storage-replaced")
    assert loader.module.w.data_ptr() == ptr


def test_storage_replaced_between_payloads_of_an_attempt_is_detected() -> None:
    """A later payload of an attempt reuses the loader's witness (no loader call); the storage
    it wrote must still be the parameter's, or the apply fails and the storage is put back."""
    loader = Switchable(_copy)
    receiver = _ready(loader)
    w = _item("w")
    half = len(w.indices) // 2
    first, second = (
        dataclasses.replace(w, listed=w.indices[part], values=w.values[part])
        for part in (slice(0, half), slice(half, None))
    )
    report = receiver.apply_items([first], attempt=3)
    assert report.loader_calls == 1
    ptr = loader.module.w.data_ptr()
    loader.module.w.data = torch.zeros_like(loader.module.w)
    with pytest.raises(LoaderConditionViolated) as err:
        receiver.apply_items([second], attempt=3)
    assert err.value.check == "storage-replaced"
    assert loader.module.w.data_ptr() == ptr


def test_unclassified_write() -> None:
    _violates(Switchable(lambda p, w: p.add_(w)), "unclassified-write")


def test_a_loader_error_writes_nothing() -> None:
    def half_then_fail(p: torch.Tensor, w: torch.Tensor) -> None:
        p[:3].copy_(w[:3])
        raise RuntimeError("shape mismatch")

    _violates(Switchable(half_then_fail, prewarm_write=_copy), "loader-error")


def test_report_that_differs_from_prewarm() -> None:
    loader = Switchable(_copy)
    receiver = _ready(loader)
    loader.report = False
    with pytest.raises(LoaderConditionViolated) as err:
        receiver.apply_item(_item())
    assert err.value.check == "report"


# --- items that do not fit the receiver -----------------------------------------------------


def test_xor_on_a_transforming_path_is_rejected() -> None:
    loader = Switchable(_copy, prewarm_write=lambda p, w: p.copy_(w.float()))
    loader.write = loader.prewarm_write
    receiver = _ready(loader)
    assert receiver.paths["w"].kind is PathKind.TRANSFORMING
    before = snapshot(loader.module)
    with pytest.raises(PayloadRejected) as err:
        receiver.apply_item(_item())
    assert err.value.check == "classification"
    assert bit_diff(snapshot(loader.module), before) == []


@pytest.mark.parametrize(
    ("change", "check"),
    [
        ({"name": "missing"}, "name"),
        ({"shape": (4, 6)}, "shape"),
        ({"dtype": torch.float16}, "dtype"),
        ({"indices": np.array([3, 1], dtype=np.int64)}, "schema"),
        ({"indices": np.array([24], dtype=np.int64)}, "bounds"),
    ],
)
def test_catalog_mismatch_is_rejected(change: dict[str, object], check: str) -> None:
    loader = Switchable(_copy)
    receiver = _ready(loader)
    base = _item()
    fields = {
        "name": base.name,
        "shape": base.shape,
        "dtype": base.dtype,
        "encoding": base.encoding,
        "indices": base.indices,
        "values": base.values,
    }
    fields.update(change)
    if "indices" in change:
        fields["values"] = base.values[: len(change["indices"])]  # type: ignore[arg-type]
    before = snapshot(loader.module)
    with pytest.raises(PayloadRejected) as err:
        receiver.apply_item(Item(**fields))  # type: ignore[arg-type]
    assert err.value.check == check
    assert bit_diff(snapshot(loader.module), before) == []


def test_apply_before_prewarm_is_refused() -> None:
    receiver = Applier(Switchable(_copy), catalog_of(W0))
    with pytest.raises(Exception, match="prewarm"):
        receiver.apply_item(_item())


# --- paths rejected at prewarm --------------------------------------------------------------


def _unsupported(loader: Loader, check: str) -> None:
    before = snapshot(loader.module)
    with pytest.raises(LoaderPathUnsupported) as err:
        Applier(loader, catalog_of(W0)).prewarm()
    assert err.value.check == check
    assert bit_diff(snapshot(loader.module), before) == []


def test_prewarm_rejects_a_reported_load_without_a_write() -> None:
    _unsupported(Switchable(_copy, prewarm_write=lambda p, w: None), "bypass")


def test_prewarm_rejects_overlapping_copies_of_one_name() -> None:
    def twice(p: torch.Tensor, w: torch.Tensor) -> None:
        p.copy_(w)
        p[1:2].copy_(w[0:1])

    _unsupported(Switchable(_copy, prewarm_write=twice), "self-overlap")


def test_prewarm_rejects_a_fill_under_a_copy() -> None:
    def fill_after(p: torch.Tensor, w: torch.Tensor) -> None:
        p.copy_(w)
        p[5:].fill_(0)

    _unsupported(Switchable(_copy, prewarm_write=fill_after), "fill-overlap")


def test_prewarm_rejects_a_transform_that_erases_the_placeholder() -> None:
    # Paper Figure A.10: nan_to_num maps the NaN placeholder to an active-looking value.
    _unsupported(
        Switchable(_copy, prewarm_write=lambda p, w: p.copy_(torch.nan_to_num(w))), "placeholder"
    )


def test_prewarm_rejects_in_place_arithmetic_on_a_parameter() -> None:
    def scale(p: torch.Tensor, w: torch.Tensor) -> None:
        p.copy_(w)
        p.mul_(2)

    _unsupported(Switchable(_copy, prewarm_write=scale), "unclassified-write")


def test_prewarm_rejects_writes_without_a_report() -> None:
    _unsupported(Switchable(_copy, report=False), "report")


def test_prewarm_rejects_a_copy_reading_resident_storage() -> None:
    def from_resident(p: torch.Tensor, w: torch.Tensor) -> None:
        p.copy_(w)
        p[0].copy_(p[1])

    _unsupported(Switchable(_copy, prewarm_write=from_resident), "resident-source")


def test_prewarm_rejects_storage_replacement_and_restores_it() -> None:
    def replace(p: torch.Tensor, w: torch.Tensor) -> None:
        p.data = w.clone()

    loader = Switchable(_copy, prewarm_write=replace)
    ptr = loader.module.w.data_ptr()
    _unsupported(loader, "storage-replaced")
    assert loader.module.w.data_ptr() == ptr


def test_tied_module_both_names_preserving_but_not_xor_allowed() -> None:
    module = torch.nn.Module()
    module.a = torch.nn.Parameter(torch.zeros(3, 2, dtype=torch.bfloat16))
    module.b = module.a
    sd = {"a": torch.ones(3, 2, dtype=torch.bfloat16), "b": torch.ones(3, 2, dtype=torch.bfloat16)}
    receiver = Applier(TorchModuleLoader(module), catalog_of(sd))
    receiver.prewarm()
    assert {p.kind for p in receiver.paths.values()} == {PathKind.PRESERVING}
    assert receiver.xor_allowed() == frozenset()
