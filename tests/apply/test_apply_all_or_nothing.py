"""All-or-nothing payloads: a rejected payload leaves every stored bit as it was.

Each case builds a payload of valid items plus one bad item at the first, a middle or the last
position, and compares every stored tensor's integer view before and after.  The valid items
alone do change stored bits (the control), so a receiver that wrote them before finding the
bad item fails these tests.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace

import numpy as np
import pytest
import torch
from apply_helpers import bit_diff, catalog_of, snapshot

from dcr.apply import Applier, Loader
from dcr.errors import DcrError, LoaderConditionViolated, PayloadRejected
from dcr.tensors.bits import bits, numpy_bits_dtype
from dcr.tensors.ordered import ulp_delta
from dcr.tensors.records import Encoding, Item

# Every test runs with the C kernels and with numpy only (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("both_paths")


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(6, 4, dtype=torch.bfloat16))
        self.b = torch.nn.Parameter(torch.zeros(8, dtype=torch.bfloat16))
        self.c = torch.nn.Parameter(torch.zeros(5, dtype=torch.float32))  # bf16 canonical: a cast
        self.d = torch.nn.Parameter(torch.zeros(3, dtype=torch.float32))  # a cast too
        self.i = torch.nn.Parameter(torch.zeros(5, dtype=torch.int16), requires_grad=False)
        self.j = torch.nn.Parameter(torch.zeros(7, dtype=torch.int16), requires_grad=False)
        self.w = torch.nn.Parameter(torch.zeros(6, 4, dtype=torch.bfloat16))


def _plain(target: torch.Tensor, t: torch.Tensor) -> None:
    target.copy_(t)


def _shifted(target: torch.Tensor, t: torch.Tensor) -> None:
    target[:3].copy_(t[3:])
    target[3:].copy_(t[:3])


def _raises(target: torch.Tensor, t: torch.Tensor) -> None:
    target[:2].copy_(t[:2])
    raise RuntimeError("the loader gave up half way")


class Faulty(Loader):
    """``load_state_dict``-style copies; ``w`` is loaded with :attr:`w_write`."""

    def __init__(self) -> None:
        self._module = Model()
        self.w_write: Callable[[torch.Tensor, torch.Tensor], None] = _plain

    @property
    def module(self) -> torch.nn.Module:
        return self._module

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = set()
        with torch.no_grad():
            for name, t in weights:
                target = getattr(self._module, name)
                (self.w_write if name == "w" else _plain)(target, t)
                loaded.add(name)
        return loaded


def _base() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    sd = {
        n: torch.randn(s, generator=gen).to(torch.bfloat16)
        for n, s in (("a", (6, 4)), ("b", (8,)), ("c", (5,)), ("d", (3,)), ("w", (6, 4)))
    }
    sd["i"] = torch.arange(5, dtype=torch.int16)
    sd["j"] = torch.arange(7, dtype=torch.int16)
    return sd


BASE = _base()


def _ready() -> tuple[Faulty, Applier]:
    loader = Faulty()
    loader.dense_load(BASE)
    receiver = Applier(loader, catalog_of(BASE))
    receiver.prewarm()
    return loader, receiver


def _item(
    tensor: str,
    encoding: Encoding,
    indices: list[int],
    values: list[int] | None = None,
    **kw: object,
) -> Item:
    t = BASE[tensor]
    word = numpy_bits_dtype(t.dtype)
    fields: dict[str, object] = {
        "name": tensor,
        "shape": tuple(t.shape),
        "dtype": t.dtype,
        "encoding": encoding,
        "indices": np.array(indices, dtype=np.int64),
        "values": np.array(values if values is not None else [0x0041] * len(indices), dtype=word),
    }
    fields.update(kw)
    return Item(**fields)  # type: ignore[arg-type]


def _valid() -> list[Item]:
    """Four items that change stored bits: XOR, ULP, a cast overwrite and an integer XOR."""
    old = bits(BASE["b"])[[1, 5]]
    new = old ^ np.uint16(0x0102)
    return [
        _item("a", Encoding.XOR, [0, 7, 23]),
        _item("b", Encoding.ULP, [1, 5], ulp_delta(new, old).tolist()),
        _item("c", Encoding.OVERWRITE, [2, 4], [0x3F80, 0xC000]),
        _item("i", Encoding.XOR, [0, 3], [0x0101, 0x7000]),
    ]


def _misplacing(loader: Faulty) -> Item:
    """A valid item of ``w``, which the loader now writes elsewhere than at prewarm."""
    loader.w_write = _shifted
    return _item("w", Encoding.XOR, [1])


def _failing(loader: Faulty) -> Item:
    """A valid item of ``w``, on which the loader now raises after a first copy."""
    loader.w_write = _raises
    return _item("w", Encoding.OVERWRITE, [1])


BAD: dict[str, tuple[Callable[[Faulty], Item], type[DcrError], str]] = {
    "name": (lambda _: _item("w", Encoding.XOR, [1], name="missing"), PayloadRejected, "name"),
    "shape": (lambda _: _item("w", Encoding.XOR, [1], shape=(4, 6)), PayloadRejected, "shape"),
    "dtype": (
        lambda _: _item("w", Encoding.XOR, [1], dtype=torch.float16),
        PayloadRejected,
        "dtype",
    ),
    "order": (lambda _: _item("w", Encoding.XOR, [5, 2]), PayloadRejected, "schema"),
    "repeat": (lambda _: _item("w", Encoding.XOR, [2, 2]), PayloadRejected, "schema"),
    "values": (
        lambda _: replace(_item("w", Encoding.XOR, [1]), values=np.array([1], dtype=np.uint32)),
        PayloadRejected,
        "schema",
    ),
    "bounds": (lambda _: _item("w", Encoding.XOR, [3, 24]), PayloadRejected, "bounds"),
    "negative": (lambda _: _item("w", Encoding.XOR, [-1, 3]), PayloadRejected, "bounds"),
    "xor-on-a-cast": (lambda _: _item("d", Encoding.XOR, [1]), PayloadRejected, "classification"),
    "ulp-on-a-cast": (lambda _: _item("d", Encoding.ULP, [1]), PayloadRejected, "classification"),
    "ulp-on-integers": (lambda _: _item("j", Encoding.ULP, [1]), PayloadRejected, "encoding"),
    "overlap": (lambda _: _item("a", Encoding.XOR, [3, 7]), PayloadRejected, "overlap"),
    "overlap-across-encodings": (
        lambda _: _item("a", Encoding.OVERWRITE, [23]),
        PayloadRejected,
        "overlap",
    ),
    "loader-pattern": (_misplacing, LoaderConditionViolated, "pattern"),
    "loader-error": (_failing, LoaderConditionViolated, "loader-error"),
}


def test_the_valid_items_alone_change_stored_bits() -> None:
    """The control: without the bad item the payload applies and writes every valid item."""
    loader, receiver = _ready()
    before = snapshot(loader.module)
    report = receiver.apply_items(_valid(), attempt=3)
    assert bit_diff(snapshot(loader.module), before) == ["a", "b", "c", "i"]
    assert report.written == 3 + 2 + 2 + 2


@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("fault", sorted(BAD))
def test_a_rejected_payload_changes_no_stored_bit(fault: str, where: str) -> None:
    loader, receiver = _ready()
    make, error, check = BAD[fault]
    items = _valid()
    bad = make(loader)
    items.insert({"first": 0, "middle": 2, "last": len(items)}[where], bad)
    before = snapshot(loader.module)
    with pytest.raises(error) as err:
        receiver.apply_items(items, attempt=5)
    assert (err.value.check, err.value.attempt) == (check, 5)
    assert bit_diff(snapshot(loader.module), before) == []


def test_items_of_one_name_are_merged_into_one_loader_call() -> None:
    loader, receiver = _ready()
    calls = []
    inner = loader.load_weights

    def counting(weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        weights = list(weights)
        calls.extend(n for n, _ in weights)
        return inner(weights)

    loader.load_weights = counting  # type: ignore[method-assign]
    items = [_item("a", Encoding.XOR, [k], [0x0100 + k]) for k in (9, 2, 17, 0, 5)]
    report = receiver.apply_items(items)
    assert calls == ["a"]
    assert [(r.name, r.entries, r.merged, r.written) for r in report.items] == [("a", 5, 5, 5)]
    want = bits(BASE["a"]).reshape(-1).copy()
    want[[9, 2, 17, 0, 5]] ^= np.array([0x0109, 0x0102, 0x0111, 0x0100, 0x0105], dtype=np.uint16)
    assert np.array_equal(bits(loader.module.a).reshape(-1), want)


def test_disjoint_items_of_one_name_with_different_encodings_both_apply() -> None:
    loader, receiver = _ready()
    items = [_item("a", Encoding.XOR, [1, 3]), _item("a", Encoding.OVERWRITE, [2], [0x4000])]
    report = receiver.apply_items(items)
    assert [(r.encoding, r.entries) for r in report.items] == [
        (Encoding.XOR, 2),
        (Encoding.OVERWRITE, 1),
    ]
    want = bits(BASE["a"]).reshape(-1).copy()
    want[[1, 3]] ^= np.uint16(0x0041)
    want[2] = 0x4000
    assert np.array_equal(bits(loader.module.a).reshape(-1), want)
