"""Apply cost is bounded by the payload: ≤ 64 KiB of items costs ≤ 64 MiB and ≤ 1 s.

The bound is the issue's; the real cost is far below it (one loader call per name and encoding
in a call, merged items, vectorized checks).  The loader-call count is the deterministic part:
a receiver that calls the loader per item fails it long before it fails the clock.
"""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from apply_helpers import bit_diff, catalog_of, dense_reference, snapshot

from dcr.apply import Applier, ApplyReport
from dcr.errors import PayloadRejected
from dcr.models.families import random_state_dict, tiny_config
from dcr.models.updates import apply_to_state_dict
from dcr.tensors.bits import bits, numpy_bits_dtype
from dcr.tensors.records import Encoding, Item

FAMILY = "llama"
CONFIG = tiny_config(FAMILY)
ITEMS = 20_000
MIB = 1 << 20


def _one_entry_items(w0: dict[str, torch.Tensor], names: list[str], seed: int) -> list[Item]:
    """``ITEMS`` one-entry XOR items at distinct positions of ``names``, in random order."""
    rng = np.random.default_rng(seed)
    sizes = np.array([w0[n].numel() for n in names])
    starts = np.concatenate([[0], np.cumsum(sizes)])
    flat = rng.choice(int(starts[-1]), size=ITEMS, replace=False)
    which = np.searchsorted(starts, flat, side="right") - 1
    items = []
    for g, k in zip(flat.tolist(), which.tolist(), strict=True):
        t = w0[names[k]]
        items.append(
            Item(
                name=names[k],
                shape=tuple(t.shape),
                dtype=t.dtype,
                encoding=Encoding.XOR,
                indices=np.array([g - int(starts[k])], dtype=np.int64),
                values=np.array([0x0101], dtype=numpy_bits_dtype(t.dtype)),
            )
        )
    return items


def _rss_peak_reset() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _measured(run: Callable[[], object]) -> tuple[float, int, int | None]:
    """CPU seconds, tracemalloc peak and (where Linux lets us reset it) peak RSS growth."""
    rss = _rss_peak_reset()
    base = _status("VmRSS") if rss else 0
    tracemalloc.start()
    t0 = time.process_time()
    try:
        run()
    finally:
        cpu = time.process_time() - t0
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return cpu, peak, (_status("VmHWM") - base) if rss else None


@pytest.fixture(scope="module")
def base() -> dict[str, torch.Tensor]:
    return random_state_dict(CONFIG, FAMILY, seed=0)


def _receiver(w0: dict[str, torch.Tensor]) -> tuple[Applier, torch.nn.Module]:
    loader = dense_reference(CONFIG, FAMILY, w0, 1, 0, extra=False)
    receiver = Applier(loader, catalog_of(w0))
    receiver.prewarm()
    return receiver, loader.module


def _within_bound(cpu: float, peak: int, rss: int | None) -> None:
    assert cpu <= 1.0, f"{cpu:.2f} s of CPU"
    assert peak <= 64 * MIB, f"{peak / MIB:.1f} MiB traced"
    assert rss is None or rss <= 64 * MIB, f"{rss / MIB:.1f} MiB of RSS"


def test_twenty_thousand_one_entry_items_apply_within_the_bound(base) -> None:
    receiver, module = _receiver(base)
    names = sorted(receiver.xor_allowed())
    items = _one_entry_items(base, names, seed=1)
    assert len(items) == ITEMS
    receiver.apply_items(items[:10])  # warm up (first-call imports and allocations)
    receiver.apply_items(items[:10])  # and back: XOR applied twice restores the bits
    out: list[ApplyReport] = []
    cpu, peak, rss = _measured(lambda: out.append(receiver.apply_items(items, attempt=1)))
    _within_bound(cpu, peak, rss)
    assert out[0].loader_calls <= len(names)
    assert out[0].entries == out[0].written == ITEMS
    want = {n: t.clone() for n, t in base.items()}
    apply_to_state_dict(want, items)
    expected = dense_reference(CONFIG, FAMILY, want, 1, 0, extra=False).module
    assert bit_diff(snapshot(module), snapshot(expected)) == []


@pytest.mark.parametrize("where", ["first", "last"])
def test_twenty_thousand_items_are_rejected_within_the_bound(base, where: str) -> None:
    receiver, module = _receiver(base)
    items = _one_entry_items(base, sorted(receiver.xor_allowed()), seed=2)
    bad = Item(
        name="model.layers.99.mlp.up_proj.weight",
        shape=items[0].shape,
        dtype=items[0].dtype,
        encoding=Encoding.XOR,
        indices=np.array([0], dtype=np.int64),
        values=np.array([1], dtype=np.uint16),
    )
    items.insert(0 if where == "first" else len(items), bad)
    before = snapshot(module)
    failures: list[PayloadRejected] = []

    def run() -> None:
        try:
            receiver.apply_items(items)
        except PayloadRejected as exc:
            failures.append(exc)

    _within_bound(*_measured(run))
    assert [f.check for f in failures] == ["name"]
    assert bit_diff(snapshot(module), before) == []


def test_items_for_every_name_apply_within_the_bound(base) -> None:
    receiver, module = _receiver(base)
    rng = np.random.default_rng(3)
    items = []
    for name, t in base.items():
        flat = bits(t).reshape(-1)
        idx = np.sort(rng.choice(flat.size, size=min(150, flat.size), replace=False))
        xor = name in receiver.xor_allowed()
        values = flat[idx] ^ np.array(0x0003, dtype=flat.dtype)
        items.append(
            Item(
                name=name,
                shape=tuple(t.shape),
                dtype=t.dtype,
                encoding=Encoding.XOR if xor else Encoding.OVERWRITE,
                indices=idx.astype(np.int64),
                values=np.full(idx.size, 0x0003, dtype=flat.dtype) if xor else values,
            )
        )
    out: list[ApplyReport] = []
    _within_bound(*_measured(lambda: out.append(receiver.apply_items(items))))
    assert out[0].loader_calls <= 2 * len(base)
    want = {n: t.clone() for n, t in base.items()}
    apply_to_state_dict(want, items)
    expected = dense_reference(CONFIG, FAMILY, want, 1, 0, extra=False).module
    assert bit_diff(snapshot(module), snapshot(expected)) == []
