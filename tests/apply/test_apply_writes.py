"""The write executor: fused read-modify-write chunks on worker threads, bit for bit."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from apply_helpers import catalog_of

from dcr import native
from dcr.adapters.loaders.torch_module import TorchModuleLoader
from dcr.apply import Applier, ApplyConfig
from dcr.apply.execution import Execution, _Stage, default_threads
from dcr.apply.geometry import IndexMap
from dcr.apply.rmw import _write_numpy, _write_torch
from dcr.apply.writes import CHUNK, Entries, WritePlan
from dcr.errors import ConfigError
from dcr.tensors.bits import bits
from dcr.tensors.ordered import ordered, unordered
from dcr.tensors.records import Encoding, Item


@pytest.mark.parametrize("writer", ["numpy", "torch"])
@pytest.mark.parametrize("encoding", list(Encoding))
def test_one_chunk_write_matches_the_definition(encoding: Encoding, writer: str) -> None:
    """The numpy writer (CPU storage) and the torch writer (other devices) agree bit for bit."""
    rng = np.random.default_rng(0)
    words = rng.integers(0, 1 << 16, size=256, dtype=np.uint64).astype(np.uint16)
    pos = np.sort(rng.choice(256, size=40, replace=False)).astype(np.int64)
    vals = rng.integers(0, 1 << 16, size=40, dtype=np.uint64).astype(np.uint16)
    flat = torch.from_numpy(words.copy()).view(torch.int16)
    if writer == "numpy":
        bad = _write_numpy(flat.numpy().view(np.uint16), pos, vals, encoding, check=True)
    else:
        t_vals = torch.from_numpy(vals.view(np.int16))
        bad = _write_torch(flat, torch.from_numpy(pos), t_vals, encoding, check=True)
    assert bad == 0
    want = words.copy()
    if encoding is Encoding.XOR:
        want[pos] ^= vals
    elif encoding is Encoding.ULP:
        want[pos] = unordered(ordered(want[pos]) + vals)
    else:
        want[pos] = vals
    assert np.array_equal(flat.numpy().view(np.uint16), want)


class Wide(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(n, dtype=torch.bfloat16))
        self.b = torch.nn.Parameter(torch.zeros(n // 2, 2, dtype=torch.float32))


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_chunks_on_several_threads_give_the_same_bits(threads: int) -> None:
    n = 5 * CHUNK + 123
    gen = torch.Generator().manual_seed(1)
    w0 = {
        "a": torch.randn(n, generator=gen).to(torch.bfloat16),
        "b": torch.randn(n // 2, 2, generator=gen).to(torch.bfloat16),
    }
    module = Wide(n)
    loader = TorchModuleLoader(module)
    loader.dense_load(w0)
    receiver = Applier(loader, catalog_of(w0), ApplyConfig(threads=threads, post_apply_checks=True))
    receiver.prewarm()
    assert receiver.xor_allowed() == {"a"}  # b is stored as float32: overwrite only
    rng = np.random.default_rng(2)
    idx = np.sort(rng.choice(n, size=3 * CHUNK, replace=False)).astype(np.int64)
    mask = rng.integers(1, 1 << 16, size=idx.size, dtype=np.uint64).astype(np.uint16)
    b_new = rng.integers(0, 1 << 14, size=idx.size, dtype=np.uint64).astype(np.uint16)
    items = [
        Item(name="a", shape=(n,), dtype=torch.bfloat16, encoding=Encoding.XOR,
             indices=idx, values=mask),
        Item(name="b", shape=(n // 2, 2), dtype=torch.bfloat16, encoding=Encoding.OVERWRITE,
             indices=idx[idx < n // 2 * 2], values=b_new[idx < n // 2 * 2]),
    ]  # fmt: skip
    report = receiver.apply_items(items)
    assert report.written == report.checked == items[0].count + items[1].count
    want_a = bits(w0["a"]).copy()
    want_a[idx] ^= mask
    want_b = w0["b"].clone().reshape(-1)
    bits(want_b)[items[1].indices] = items[1].values
    assert np.array_equal(bits(module.a), want_a)
    assert np.array_equal(bits(module.b).reshape(-1), bits(want_b.float()))


def test_threads_must_be_positive() -> None:
    with pytest.raises(ConfigError):
        ApplyConfig(threads=0)


@pytest.mark.skipif(native.kernels is None, reason="the C kernels are not built")
@pytest.mark.parametrize(("first", "count"), [(0, 1000), (700, 300), (0, 350)])
def test_a_mapped_plan_hands_out_only_the_entries_its_view_can_hold(first: int, count: int) -> None:
    """Entries outside the span of the copy's source view (another rank's rows) land nowhere:
    the kernels' tasks cover only the entries inside it, and the writes are those of the
    entries in view."""
    rng = np.random.default_rng(3)
    flat = torch.from_numpy(rng.integers(0, 1 << 16, 200, dtype=np.uint64).astype(np.uint16))
    before = flat.numpy().copy()
    indices = np.arange(first, first + count, dtype=np.int64)
    values = rng.integers(1, 1 << 16, count, dtype=np.uint64).astype(np.uint16)
    imap = IndexMap(src_offset=400, src_span=199, dst_offset=0, dims=((1, 200, 1),))
    plan = WritePlan(
        label="w", flat=flat.view(torch.int16), itemsize=2, words=flat.numpy(), imap=imap,
        entries=Entries(values=values, dtype=torch.bfloat16, listed=indices),
    )  # fmt: skip
    inside = (indices >= 400) & (indices < 600)
    stage = _Stage([(plan, Encoding.XOR)])
    covered = [e for _, lo, hi, _ in stage.rows.tolist() for e in range(lo, hi)]
    assert covered == np.flatnonzero(inside).tolist()
    fail = lambda message, check: ConfigError(message, check=check)  # noqa: E731
    written = Execution([[(plan, Encoding.XOR)]], check=True, fail=fail, threads=1).finish()
    assert written[plan] == int(inside.sum())
    want = before.copy()
    want[indices[inside] - 400] ^= values[inside]
    assert np.array_equal(flat.numpy().view(np.int16), want.view(np.int16))


@pytest.mark.parametrize(("allowed", "want"), [({0}, 1), ({1, 3, 5}, 3), (set(range(16)), 8)])
def test_apply_threads_default_to_the_cpus_the_process_may_run_on(
    monkeypatch: pytest.MonkeyPatch, allowed: set[int], want: int
) -> None:
    """A serving worker pinned to a few cores of a large host writes with those, not with
    every core of the host (and never with more than 8)."""
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: allowed, raising=False)
    assert default_threads() == want
