"""StorageGuard: a full check catches a replaced ``Parameter`` object whether it walks the
loader's tensors or stands on its identity snapshot of the module tree."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import pytest
import torch

from dcr.apply.loader import Loader
from dcr.apply.storage import StorageGuard
from dcr.errors import DcrError


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 3)
        self.b = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))
        self.register_buffer("scale", torch.ones(2))


class _Plain(Loader):
    def __init__(self, module: torch.nn.Module) -> None:
        self._module = module

    @property
    def module(self) -> torch.nn.Module:
        return self._module

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str] | None:
        return None


class _Listed(_Plain):
    """A loader that enumerates its tensors itself (no snapshot: every full check walks)."""

    def storage_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.module.named_parameters(remove_duplicate=False)


class _Failed(DcrError):
    pass


def _fail(message: str, check: str) -> DcrError:
    return _Failed(f"{check}: {message}")


def _new_object(net: _Net) -> None:
    # The same storage under a new Parameter object: only the identity check can tell.
    net.b[0].weight = torch.nn.Parameter(net.b[0].weight.detach())


def _into_the_dictionary(net: _Net) -> None:
    net.a._parameters["bias"] = torch.nn.Parameter(net.a.bias.detach())


def _added(net: _Net) -> None:
    net.b[1].register_parameter("extra", torch.nn.Parameter(torch.zeros(1)))


@pytest.mark.parametrize("kind", [_Plain, _Listed])
@pytest.mark.parametrize("change", [_new_object, _into_the_dictionary, _added])
def test_a_replaced_or_added_parameter_fails_the_full_check(
    kind: type[_Plain], change: Callable[[_Net], None]
) -> None:
    net = _Net()
    guard = StorageGuard(kind(net))
    guard.check(_fail, full=True)
    change(net)
    with pytest.raises(_Failed, match="changed identity"):
        guard.check(_fail, full=True)


def test_a_tree_change_that_keeps_the_tensors_passes_and_is_remembered() -> None:
    """A new empty submodule changes the snapshot but not the loader's tensors: the walk
    decides (it passes), and the snapshot taken then holds for the next checks."""
    net = _Net()
    guard = StorageGuard(_Plain(net))
    net.b.append(torch.nn.ReLU())
    guard.check(_fail, full=True)
    guard.check(_fail, full=True)
    _new_object(net)
    with pytest.raises(_Failed, match="changed identity"):
        guard.check(_fail, full=True)


def test_a_moved_storage_is_restored_before_the_failure() -> None:
    net = _Net()
    guard = StorageGuard(_Plain(net))
    before = net.a.weight.detach().clone()
    ptr = net.a.weight.data_ptr()
    net.a.weight.data = torch.zeros_like(net.a.weight)
    with pytest.raises(_Failed, match="storage-replaced"):
        guard.check(_fail, full=True)
    assert net.a.weight.data_ptr() == ptr
    assert torch.equal(net.a.weight.detach().view(torch.int32), before.view(torch.int32))
