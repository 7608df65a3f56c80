"""One loader call per name and attempt: later payloads of the attempt reuse its witness.

The witness proves the loader still makes the writes recorded at prewarm; a new attempt (or an
apply without an attempt id) witnesses again, so a loader that changed its writes is caught
at the next attempt.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dcr.adapters.loaders.torch_module import TorchModuleLoader
from dcr.apply import Applier, ApplyConfig
from dcr.errors import LoaderConditionViolated
from dcr.models.modules import module_from_state_dict
from dcr.tensors.bits import bits
from dcr.tensors.ordered import ulp_delta
from dcr.tensors.records import Encoding, Item, TensorSpec

# Every test runs with the C kernels and with numpy only (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("both_paths")


def _weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {f"w{i}": torch.randn(64, 32, generator=gen).to(torch.bfloat16) for i in range(3)}


def _item(name: str, old: torch.Tensor, new: torch.Tensor, lo: int, hi: int) -> Item:
    """The ULP item of ``name`` for flat positions ``[lo, hi)`` that differ."""
    a, b = bits(new).reshape(-1), bits(old).reshape(-1)
    idx = np.flatnonzero(a[lo:hi] != b[lo:hi]).astype(np.int64) + lo
    return Item(
        name=name,
        shape=tuple(old.shape),
        dtype=old.dtype,
        encoding=Encoding.ULP,
        indices=idx,
        values=ulp_delta(a[idx], b[idx]),
    )


def _setup() -> tuple[Applier, torch.nn.Module, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    w0 = _weights()
    w1 = {n: (t.float() * 1.01).to(torch.bfloat16) for n, t in w0.items()}
    module = module_from_state_dict(w0)
    receiver = Applier(
        TorchModuleLoader(module), {n: TensorSpec.of(n, t) for n, t in w0.items()}, ApplyConfig()
    )
    receiver.dense_load(w0)
    receiver.prewarm()
    return receiver, module, w0, w1


def _assert_holds(module: torch.nn.Module, want: dict[str, torch.Tensor]) -> None:
    got = dict(module.named_parameters())
    for name, t in want.items():
        np.testing.assert_array_equal(bits(got[name].detach()), bits(t))


def test_later_payloads_of_an_attempt_reuse_the_witness_and_stay_bit_exact() -> None:
    receiver, module, w0, w1 = _setup()
    half = 64 * 32 // 2
    first = [_item(n, w0[n], w1[n], 0, half) for n in w0]
    second = [_item(n, w0[n], w1[n], half, 64 * 32) for n in w0]
    # The three names of the first payload go to the loader together: one call.
    assert receiver.apply_items(first, attempt=7).loader_calls == 1
    assert receiver.apply_items(second, attempt=7).loader_calls == 0
    _assert_holds(module, w1)


def test_a_new_attempt_and_an_apply_without_attempt_witness_again() -> None:
    receiver, module, w0, w1 = _setup()
    half = 64 * 32 // 2
    assert (
        receiver.apply_items([_item("w0", w0["w0"], w1["w0"], 0, half)], attempt=1).loader_calls
        == 1
    )
    rest = _item("w0", w0["w0"], w1["w0"], half, 64 * 32)
    assert receiver.apply_items([rest], attempt=2).loader_calls == 1
    back = Item(
        name="w0",
        shape=rest.shape,
        dtype=rest.dtype,
        encoding=Encoding.ULP,
        indices=rest.indices,
        values=(-rest.values.view(np.int16)).view(np.uint16),
    )
    assert receiver.apply_items([back]).loader_calls == 1
    assert receiver.apply_items([rest]).loader_calls == 1
    _assert_holds(module, {"w0": w1["w0"], "w1": w0["w1"], "w2": w0["w2"]})


def test_a_loader_that_changed_its_writes_is_caught_at_the_next_attempt() -> None:
    receiver, _, w0, w1 = _setup()
    half = 64 * 32 // 2
    receiver.apply_items([_item("w1", w0["w1"], w1["w1"], 0, half)], attempt=1)
    loader = receiver.loader
    assert isinstance(loader, TorchModuleLoader)
    # The loader now writes w1's values into a column view of w2's storage: another copy.
    real = loader.load_weights

    def rerouted(weights):  # type: ignore[no-untyped-def]
        out = real(weights)
        with torch.no_grad():
            dict(loader.module.named_parameters())["w2"][:, :1].copy_(
                torch.zeros(64, 1, dtype=torch.bfloat16)
            )
        return out

    loader.load_weights = rerouted  # type: ignore[method-assign]
    rest = _item("w1", w0["w1"], w1["w1"], half, 64 * 32)
    # Same attempt: the witness of the first payload stands.
    assert receiver.apply_items([rest], attempt=1).loader_calls == 0
    with pytest.raises(LoaderConditionViolated):
        receiver.apply_items([_item("w1", w1["w1"], w0["w1"], 0, half)], attempt=2)


def _full(w0: dict[str, torch.Tensor], w1: dict[str, torch.Tensor]) -> list[Item]:
    return [_item(n, w0[n], w1[n], 0, 64 * 32) for n in w0]


def test_a_loader_that_draws_every_tensor_first_is_witnessed_name_by_name() -> None:
    """A loader that reads all its input before writing cannot have its writes attributed to
    names: the names are witnessed one call each, and the apply stays exact."""
    receiver, module, w0, w1 = _setup()
    loader = receiver.loader
    real = loader.load_weights
    sizes: list[int] = []

    def greedy(weights):  # type: ignore[no-untyped-def]
        weights = list(weights)
        sizes.append(len(weights))
        return real(weights)

    loader.load_weights = greedy  # type: ignore[method-assign]
    report = receiver.apply_items(_full(w0, w1), attempt=1)
    assert sizes == [3, 1, 1, 1]  # the batch, then each name alone
    assert report.loader_calls == 4
    _assert_holds(module, w1)
    # The receiver stops sharing calls with this loader: the next attempt calls it per name.
    assert receiver.apply_items(_full(w1, w0), attempt=2).loader_calls == 3
    assert sizes == [3, 1, 1, 1, 1, 1, 1]
    _assert_holds(module, w0)


def test_a_batch_that_misattributes_one_name_falls_back_for_it_only() -> None:
    """A loader that writes w1 only when it sees w2 (one tensor late): w1 and w2 are
    witnessed alone -- where, called on one name, the loader makes no write for w1 -- and the
    apply is refused before any write lands."""
    receiver, module, w0, w1 = _setup()
    loader = receiver.loader
    real = loader.load_weights

    def late(weights):  # type: ignore[no-untyped-def]
        held = []
        for name, t in weights:
            if name == "w1":
                held.append((name, t))
                continue
            real([*held, (name, t)] if name == "w2" else [(name, t)])
            held = []
        return {"w0", "w1", "w2"}

    loader.load_weights = late  # type: ignore[method-assign]
    with pytest.raises(LoaderConditionViolated):
        receiver.apply_items(_full(w0, w1), attempt=1)
    _assert_holds(module, w0)
