"""Several payloads in one call: each all or nothing, written while the next one is planned.

``Applier.apply_payloads`` must end exactly where one ``apply_items`` call per payload ends,
whatever the thread count, with the C kernels and without; a payload that fails leaves the
ones before it applied and none after it.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from apply_helpers import bit_diff, catalog_of, make_items, snapshot

from dcr.adapters.loaders.torch_module import TorchModuleLoader
from dcr.apply import Applier, ApplyConfig
from dcr.apply.writes import CHUNK
from dcr.errors import PayloadRejected
from dcr.tensors.records import Item

pytestmark = pytest.mark.usefixtures("both_paths")


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # Big enough that one item spans several chunks of the writer.
        self.big = torch.nn.Parameter(torch.zeros(3 * CHUNK + 17, dtype=torch.bfloat16))
        self.w = torch.nn.Parameter(torch.zeros(64, 48, dtype=torch.bfloat16))
        self.f = torch.nn.Parameter(torch.zeros(300, dtype=torch.float32))


def _state(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        n: torch.randn(p.shape, generator=gen).to(p.dtype) for n, p in Model().named_parameters()
    }


OLD, NEW = _state(0), _state(1)


def _receiver(threads: int | None = None) -> Applier:
    loader = TorchModuleLoader(Model())
    loader.dense_load(OLD)
    receiver = Applier(loader, catalog_of(OLD), ApplyConfig(threads=threads))
    receiver.prewarm()
    return receiver


def _payloads(receiver: Applier, parts: int) -> list[list[Item]]:
    """The update cut into ``parts`` payloads: every item split by index range."""
    payloads: list[list[Item]] = [[] for _ in range(parts)]
    for item in make_items(OLD, NEW, receiver.xor_allowed()):
        cuts = np.array_split(np.arange(item.count), parts)
        for k, sel in enumerate(cuts):
            if sel.size:
                payloads[k].append(
                    dataclasses.replace(item, listed=item.indices[sel], values=item.values[sel])
                )
    return payloads


def _dense_new() -> dict[str, np.ndarray]:
    loader = TorchModuleLoader(Model())
    loader.dense_load(NEW)
    return snapshot(loader.module)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_apply_payloads_ends_where_one_call_per_payload_ends(threads: int) -> None:
    overlapped, one_by_one = _receiver(threads), _receiver(threads)
    payloads = _payloads(overlapped, 4)
    landed: list[int] = []
    reports = overlapped.apply_payloads(payloads, attempt=3, on_applied=landed.append)
    singles = [one_by_one.apply_items(p, attempt=3) for p in payloads]
    assert landed == [0, 1, 2, 3]
    assert [r.written for r in reports] == [r.written for r in singles]
    assert sum(r.written for r in reports) == sum(i.count for p in payloads for i in p)
    assert bit_diff(snapshot(overlapped.loader.module), _dense_new()) == []
    assert bit_diff(snapshot(one_by_one.loader.module), _dense_new()) == []


@pytest.mark.parametrize("bad_at", [0, 2, 3])
def test_a_failing_payload_leaves_the_earlier_ones_applied_and_no_later_one(
    bad_at: int,
) -> None:
    receiver, control = _receiver(), _receiver()
    payloads = _payloads(receiver, 4)
    bad = dataclasses.replace(payloads[bad_at][0], name="no.such.tensor")
    payloads[bad_at] = [*payloads[bad_at][1:], bad]
    landed: list[int] = []
    with pytest.raises(PayloadRejected) as err:
        receiver.apply_payloads(payloads, attempt=5, on_applied=landed.append)
    assert err.value.check == "name"
    assert landed == list(range(bad_at))
    for p in payloads[:bad_at]:
        control.apply_items(p, attempt=5)
    assert bit_diff(snapshot(receiver.loader.module), snapshot(control.loader.module)) == []
    if bad_at:  # the control: the earlier payloads did change stored bits
        assert bit_diff(snapshot(control.loader.module), snapshot(_receiver().loader.module))


def test_payloads_of_one_name_in_order_overwrite_as_a_dense_load_does() -> None:
    """Two payloads that overwrite the same positions: the later one's bits stay."""
    receiver = _receiver()
    first = make_items(OLD, NEW, set())
    back = [
        dataclasses.replace(i, values=np.asarray(i.values) ^ np.asarray(i.values)) for i in first
    ]
    receiver.apply_payloads([first, back], attempt=1)
    zeros = _receiver()
    for item in back:
        zeros.apply_items([item], attempt=1)
    assert bit_diff(snapshot(receiver.loader.module), snapshot(zeros.loader.module)) == []
