"""Huge pages for resident weights: advised at prewarm where the kernel allows, bits and
addresses unchanged, a receiver applies bit-exactly on them, and it can be turned off."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dcr.adapters.loaders.torch_module import TorchModuleLoader
from dcr.apply import Applier, ApplyConfig
from dcr.apply.pages import HUGE_PAGE, advise_huge_pages
from dcr.models.modules import module_from_state_dict
from dcr.tensors.bits import bits
from dcr.tensors.ordered import ulp_delta
from dcr.tensors.records import Encoding, Item, TensorSpec

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    """The bracketed mode of the kernel's THP setting, or None where there is none."""
    if not sys.platform.startswith("linux") or not THP.exists():
        return None
    text = THP.read_text()
    return text[text.index("[") + 1 : text.index("]")]


def _weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    # 8 MiB each: at least two aligned 2 MiB pages inside every storage.
    return {f"w{i}": torch.randn(2048, 2048, generator=gen).to(torch.bfloat16) for i in range(2)}


def test_advice_keeps_every_bit_and_address() -> None:
    t = torch.randn(6 << 20, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    before, ptr = t.view(torch.int16).clone(), t.data_ptr()
    done = advise_huge_pages([t, t[7:], torch.ones(3)])  # one storage, counted once
    assert t.data_ptr() == ptr and torch.equal(t.view(torch.int16), before)
    interior = ((ptr + t.untyped_storage().nbytes()) & ~(HUGE_PAGE - 1)) - (
        (ptr + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
    )
    mode = _thp_mode()
    if mode in ("always", "madvise"):
        assert done.advised == interior > 0
        assert done.collapsed in (0, interior)  # collapsing may be refused (memory pressure)
    else:
        assert done.advised == done.collapsed == 0


def test_advice_can_be_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DCR_HUGE_PAGES", "0")
    assert advise_huge_pages([torch.ones(8 << 20, dtype=torch.bfloat16)]).advised == 0


@pytest.mark.parametrize("huge", [True, False])
def test_a_receiver_on_huge_pages_applies_bit_exact(huge: bool) -> None:
    w0 = _weights()
    w1 = {n: (t.float() * 1.01).to(torch.bfloat16) for n, t in w0.items()}
    module = module_from_state_dict(w0)
    receiver = Applier(
        TorchModuleLoader(module),
        {n: TensorSpec.of(n, t) for n, t in w0.items()},
        ApplyConfig(huge_pages=huge),
    )
    receiver.dense_load(w0)
    report = receiver.prewarm()
    if not huge or _thp_mode() not in ("always", "madvise"):
        assert report.huge_page_bytes == 0
    else:
        assert report.huge_page_bytes % HUGE_PAGE == 0
        assert 0 <= report.huge_page_bytes <= sum(t.nbytes for t in w0.values())
    items = []
    for name in w0:
        a, b = bits(w1[name]).reshape(-1), bits(w0[name]).reshape(-1)
        idx = np.flatnonzero(a != b).astype(np.int64)
        items.append(
            Item(
                name=name,
                shape=tuple(w0[name].shape),
                dtype=torch.bfloat16,
                encoding=Encoding.ULP,
                indices=idx,
                values=ulp_delta(a[idx], b[idx]),
            )
        )
    receiver.apply_items(items, attempt=1)
    held = dict(module.named_parameters())
    for name, t in w1.items():
        np.testing.assert_array_equal(bits(held[name].detach()), bits(t))
