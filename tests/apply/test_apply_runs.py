"""Run items (a dense refit's form) apply as block writes with the bits of listed items.

An item whose indices are one run (:class:`~dcr.tensors.records.Span`) reaches a receiver with
no index per entry; through a bit-preserving copy it becomes block copies (overwrite) or block
read-modify-writes (XOR, ULP) in resident storage, while casts and transforming paths keep
their own paths.  Every test compares the stored bits (integer views) with the same entries
sent as listed indices and with a dense load, on the C kernels and on numpy.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import torch
from apply_helpers import (
    A_LOG,
    base_state_dict,
    bit_diff,
    catalog_of,
    dense_reference,
    snapshot,
    tp_config,
    update,
)

import dcr.apply.planning as planning
from dcr.adapters.loaders.torch_module import TorchModuleLoader
from dcr.apply import Applier, ApplyConfig, ApplyReport
from dcr.apply.geometry import IndexMap, ViewGeometry
from dcr.errors import LoaderConditionViolated, PayloadRejected
from dcr.models.families import FAMILIES
from dcr.models.modules import module_from_state_dict
from dcr.tensors.bits import bits
from dcr.tensors.ordered import ULP_DTYPES, ulp_delta
from dcr.tensors.records import Encoding, Item, Span

pytestmark = pytest.mark.usefixtures("both_paths")


def _as_listed(item: Item) -> Item:
    return Item(
        name=item.name,
        shape=item.shape,
        dtype=item.dtype,
        encoding=item.encoding,
        indices=item.indices,
        values=item.values,
    )


def _runs(
    old: dict[str, torch.Tensor],
    new: dict[str, torch.Tensor],
    relative: frozenset[str],
    cut: np.random.Generator | None = None,
) -> list[Item]:
    """One run per tensor taking ``old`` to ``new`` there: the whole tensor, or a random
    range when ``cut`` is given; relative encodings (ULP for floats, else XOR) on
    ``relative`` names, overwrites elsewhere."""
    items = []
    for name, t in new.items():
        b_new, b_old = bits(t).reshape(-1), bits(old[name]).reshape(-1)
        lo, hi = 0, b_new.size
        if cut is not None:
            lo = int(cut.integers(0, b_new.size))
            hi = int(cut.integers(lo + 1, b_new.size + 1))
        enc = Encoding.OVERWRITE
        values = b_new[lo:hi].copy()
        if name in relative:
            enc = Encoding.ULP if t.dtype in ULP_DTYPES else Encoding.XOR
            d = ulp_delta(b_new[lo:hi], b_old[lo:hi])
            values = d if enc is Encoding.ULP else b_new[lo:hi] ^ b_old[lo:hi]
        items.append(
            Item(
                name=name,
                shape=tuple(t.shape),
                dtype=t.dtype,
                encoding=enc,
                span=Span(lo),
                values=np.ascontiguousarray(values),
            )
        )
    return items


def _cut(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], items: list[Item]):
    """``old`` with each item's run taken from ``new``."""
    out = {n: t.clone() for n, t in old.items()}
    for item in items:
        assert item.span is not None
        lo, hi = item.span.start, item.span.start + item.count
        bits(out[item.name]).reshape(-1)[lo:hi] = bits(new[item.name]).reshape(-1)[lo:hi]
    return out


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tp", [1, 3])
@pytest.mark.parametrize("relative", [False, True], ids=["overwrite", "relative"])
@pytest.mark.parametrize("whole", [True, False], ids=["whole", "ranges"])
def test_runs_give_the_bits_of_listed_items_and_of_a_dense_load(
    family: str, tp: int, relative: bool, whole: bool
) -> None:
    """Reference ranks (fused QKV and gate/up, row and column slices, vocabulary padding, a
    cast fp32 norm, a transforming ``A_log``) take runs over whole tensors or random ranges
    -- partial rows of sliced views -- exactly as listed items."""
    config = tp_config(family, tp)
    w0 = base_state_dict(config, family)
    w1 = update(w0, rate=0.5, seed=tp)
    rng = None if whole else np.random.default_rng(tp + 10 * relative)
    for rank in range(tp):
        by_run = Applier(dense_reference(config, family, w0, tp, rank), catalog_of(w0))
        by_list = Applier(dense_reference(config, family, w0, tp, rank), catalog_of(w0))
        by_run.prewarm()
        by_list.prewarm()
        allowed = by_run.xor_allowed() if relative else frozenset()
        if rng is not None:
            rng = np.random.default_rng(tp + 10 * relative)  # the same ranges on every rank
        items = _runs(w0, w1, allowed, rng)
        runs = by_run.apply_items(items, attempt=1)
        listed = by_list.apply_items([_as_listed(i) for i in items], attempt=1)
        assert bit_diff(snapshot(by_run.loader.module), snapshot(by_list.loader.module)) == []
        target = w1 if whole else _cut(w0, w1, items)
        want = dense_reference(config, family, target, tp, rank).module
        assert bit_diff(snapshot(by_run.loader.module), snapshot(want)) == []
        assert [(r.name, r.written, r.copies) for r in runs.items] == [
            (r.name, r.written, r.copies) for r in listed.items
        ]


def _apply_traced(
    monkeypatch: pytest.MonkeyPatch, receiver: Applier, item: Item
) -> tuple[ApplyReport, int, int]:
    """Apply ``item``: the report, the peak of memory traced meanwhile and the block plans
    made."""
    blocks: list[int] = []
    real = planning.plan_block
    monkeypatch.setattr(planning, "plan_block", lambda *a: blocks.append(1) or real(*a))
    tracemalloc.start()
    try:
        report = receiver.apply_items([item], attempt=1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return report, peak, len(blocks)


def test_a_dense_run_writes_blocks_and_lists_no_index(monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole-tensor run of 4M elements through a plain module: block plans, and the apply
    allocates nothing near one index (8 bytes) per entry."""
    n = 1 << 22
    w0 = {"w": torch.zeros(n, dtype=torch.bfloat16)}
    receiver = Applier(TorchModuleLoader(module_from_state_dict(w0)), catalog_of(w0))
    receiver.prewarm()
    values = np.random.default_rng(0).integers(0, 1 << 16, n, dtype=np.uint16)
    item = Item(
        name="w",
        shape=(n,),
        dtype=torch.bfloat16,
        encoding=Encoding.OVERWRITE,
        span=Span(0),
        values=values,
    )
    report, peak, blocks = _apply_traced(monkeypatch, receiver, item)
    assert blocks and report.written == n and not report.items[0].dense
    assert peak < n  # listed indices alone would take 8 * n bytes
    param = dict(receiver.loader.module.named_parameters())["w"]
    np.testing.assert_array_equal(bits(param), values)


def test_runs_through_a_cast_and_a_transforming_path() -> None:
    """An fp32 parameter loaded from bf16 (a cast copy: entries cast one by one) and
    ``A_log`` (a computed copy: the placeholder path) take runs like listed items."""
    config = tp_config("qwen3", 2)
    w0 = base_state_dict(config, "qwen3")
    w1 = update(w0, rate=1.0, seed=3)
    norm = "model.norm.weight"
    names = [norm, A_LOG]
    for rank in range(2):
        receiver = Applier(dense_reference(config, "qwen3", w0, 2, rank), catalog_of(w0))
        receiver.prewarm()
        items = [i for i in _runs(w0, w1, frozenset()) if i.name in names]
        report = receiver.apply_items(items, attempt=1)
        assert {r.name: r.dense for r in report.items}[A_LOG]  # the placeholder path
        target = {n: (w1 if n in names else w0)[n] for n in w0}
        want = dense_reference(config, "qwen3", target, 2, rank).module
        assert bit_diff(snapshot(receiver.loader.module), snapshot(want)) == []


def test_post_apply_checks_on_blocks() -> None:
    config = tp_config("llama", 2)
    w0 = base_state_dict(config, "llama")
    w1 = update(w0, rate=0.5, seed=4)
    for rank in range(2):
        loader = dense_reference(config, "llama", w0, 2, rank)
        receiver = Applier(loader, catalog_of(w0), ApplyConfig(post_apply_checks=True))
        receiver.prewarm()
        items = _runs(w0, w1, receiver.xor_allowed())
        report = receiver.apply_items(items, attempt=1)
        assert report.checked == report.written > 0
        want = dense_reference(config, "llama", w1, 2, rank).module
        assert bit_diff(snapshot(loader.module), snapshot(want)) == []


@pytest.mark.usefixtures("numpy_path")
def test_the_post_apply_check_catches_a_wrong_block_write(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The numpy block writer re-reads what it wrote (the C one: tests/test_native.py)."""
    import dcr.apply.rmw as rmw

    w0 = {"w": torch.zeros(64, dtype=torch.bfloat16)}
    receiver = Applier(
        TorchModuleLoader(module_from_state_dict(w0)),
        catalog_of(w0),
        ApplyConfig(post_apply_checks=True),
    )
    receiver.prewarm()
    real = np.copyto

    def off_by_one(dst: np.ndarray, src: np.ndarray) -> None:
        real(dst, src ^ np.uint16(1))

    monkeypatch.setattr(rmw.np, "copyto", off_by_one)
    item = Item(
        name="w",
        shape=(64,),
        dtype=torch.bfloat16,
        encoding=Encoding.OVERWRITE,
        span=Span(8),
        values=np.arange(16, dtype=np.uint16),
    )
    with pytest.raises(LoaderConditionViolated) as err:
        receiver.apply_items([item], attempt=1)
    assert err.value.check == "post-apply"


def test_runs_of_one_tensor_join_and_bad_runs_change_nothing() -> None:
    w0 = {"a": torch.zeros(40, dtype=torch.bfloat16), "b": torch.zeros(8, dtype=torch.bfloat16)}
    receiver = Applier(TorchModuleLoader(module_from_state_dict(w0)), catalog_of(w0))
    receiver.prewarm()

    def run(name: str, start: int, values: list[int], enc: Encoding = Encoding.OVERWRITE) -> Item:
        shape = tuple(w0[name].shape)
        return Item(
            name=name,
            shape=shape,
            dtype=torch.bfloat16,
            encoding=enc,
            span=Span(start),
            values=np.array(values, dtype=np.uint16),
        )

    # Runs that continue each other (in any order) are one group; a gap between them is not.
    report = receiver.apply_items([run("a", 10, [3, 4]), run("a", 4, [1] * 6)], attempt=1)
    assert [(r.entries, r.merged) for r in report.items] == [(8, 2)]
    receiver.apply_items([run("a", 30, [7]), run("a", 20, [5, 6])], attempt=1)
    module = dict(receiver.loader.module.named_parameters())
    want = np.zeros(40, np.uint16)
    want[4:10], want[10:12], want[20:22], want[30] = 1, [3, 4], [5, 6], 7
    np.testing.assert_array_equal(bits(module["a"]), want)

    before = snapshot(receiver.loader.module)
    for bad, check in (
        ([run("b", 0, [9] * 4), run("a", 38, [1, 2, 3])], "bounds"),  # past the end
        ([run("b", 0, [9] * 4), run("a", 4, [1, 2]), run("a", 5, [3])], "overlap"),
        ([run("a", 0, [1]), run("a", 0, [2], Encoding.XOR)], "overlap"),  # two encodings
    ):
        with pytest.raises(PayloadRejected) as err:
            receiver.apply_items(bad, attempt=2)
        assert err.value.check == check
        assert bit_diff(snapshot(receiver.loader.module), before) == []


@pytest.mark.parametrize(
    "view",
    [
        lambda t: t.view(6, 8, 5)[1:4, 2:6, 1:3],
        lambda t: t.view(6, 8, 5)[:, 3:5],
        lambda t: t.view(48, 5)[7:20],
        lambda t: t.view(6, 8, 5)[2, 3, 4],
        lambda t: t.view(6, 8, 5)[:, :, 2],
        lambda t: t[3:200],
    ],
)
def test_index_map_boxes_cover_exactly_the_run(view: object) -> None:
    """The blocks of a run through a nested view are the positions the index map gives its
    entries, each once, with the same values."""
    base = torch.zeros(6 * 8 * 5)
    src = view(base)  # type: ignore[operator]
    dst = torch.empty(src.shape)
    imap = IndexMap.build(ViewGeometry.of(src, "scratch"), ViewGeometry.of(dst, "d"))
    assert imap is not None
    rng = np.random.default_rng(0)
    for _ in range(40):
        lo = int(rng.integers(0, 241))
        hi = int(rng.integers(lo, 241))
        sel, pos = imap.map(np.arange(lo, hi, dtype=np.int64))
        want = dict(zip(pos.tolist(), sel.tolist(), strict=True))
        got: dict[int, int] = {}
        for d0, s0, dims in imap.boxes(lo, hi - lo):
            at = [(d0, s0)]
            for size, ds, ss in dims:
                at = [(d + i * ds, s + i * ss) for d, s in at for i in range(size)]
            for d, s in at:
                assert d not in got
                got[d] = s
        assert got == want


def _row_spans(
    old: dict[str, torch.Tensor],
    new: dict[str, torch.Tensor],
    relative: frozenset[str],
    parts: int,
    rows_cut: int = 0,
) -> list[Item]:
    """Each 2-D tensor as ``parts`` column blocks of every row (what row-parallel training
    ranks send when they send their shard whole): span items of rows ``period`` long,
    ``(parts - 1) * period`` apart; ``rows_cut`` drops that many trailing elements from the
    last block (a partial last row).  Other tensors are one run."""
    items = []
    for name, t in new.items():
        b_new, b_old = bits(t).reshape(-1), bits(old[name]).reshape(-1)
        cols = t.shape[-1] if t.dim() == 2 else 0
        if cols < parts or cols % parts:
            pieces = [(Span(0), np.arange(b_new.size))]
        else:
            period = cols // parts
            pieces = []
            for k in range(parts):
                span = Span(k * period, period, (parts - 1) * period)
                idx = span.locate(0, t.numel() // parts)
                if k == parts - 1 and rows_cut:
                    idx = idx[:-rows_cut]
                pieces.append((span, idx))
        for span, idx in pieces:
            enc = Encoding.OVERWRITE
            values = b_new[idx]
            if name in relative:
                enc = Encoding.ULP if t.dtype in ULP_DTYPES else Encoding.XOR
                values = ulp_delta(b_new[idx], b_old[idx]) if enc is Encoding.ULP else (
                    b_new[idx] ^ b_old[idx])  # fmt: skip
            items.append(
                Item(
                    name=name,
                    shape=tuple(t.shape),
                    dtype=t.dtype,
                    encoding=enc,
                    span=span,
                    values=np.ascontiguousarray(values),
                )
            )
    return items


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tp", [1, 3])
@pytest.mark.parametrize("relative", [False, True], ids=["overwrite", "relative"])
@pytest.mark.parametrize("rows_cut", [0, 3], ids=["whole-rows", "partial-row"])
def test_row_spans_give_the_bits_of_listed_items_and_of_a_dense_load(
    monkeypatch: pytest.MonkeyPatch, family: str, tp: int, relative: bool, rows_cut: int
) -> None:
    """Column blocks of every row, one item per block and apply call (as each training rank's
    payload brings its own), land on reference ranks -- fused, sliced, padded, cast and
    transformed parameters -- exactly as the same entries listed; through a rank's slice of
    whole rows they land as blocks."""
    strided: list[bool] = []
    real = planning.plan_block
    monkeypatch.setattr(planning, "plan_block", lambda *a: strided.append(a[3].strided) or real(*a))
    config = tp_config(family, tp)
    w0 = base_state_dict(config, family)
    w1 = update(w0, rate=0.5, seed=tp + 7)
    for rank in range(tp):
        by_rows = Applier(dense_reference(config, family, w0, tp, rank), catalog_of(w0))
        by_list = Applier(dense_reference(config, family, w0, tp, rank), catalog_of(w0))
        by_rows.prewarm()
        by_list.prewarm()
        allowed = by_rows.xor_allowed() if relative else frozenset()
        items = _row_spans(w0, w1, allowed, parts=2, rows_cut=rows_cut)
        assert any(i.span is not None and i.span.gap for i in items)
        for attempt, item in enumerate(items, start=1):
            by_rows.apply_items([item], attempt=attempt)
            by_list.apply_items([_as_listed(item)], attempt=attempt)
        assert bit_diff(snapshot(by_rows.loader.module), snapshot(by_list.loader.module)) == []
        if not rows_cut:
            want = dense_reference(config, family, w1, tp, rank).module
            assert bit_diff(snapshot(by_rows.loader.module), snapshot(want)) == []
    assert any(strided)  # whole parameters (TP 1) and row slices (TP 3) alike


@pytest.mark.parametrize("piece", [None, 1000], ids=["whole", "pieces"])
@pytest.mark.parametrize("encoding", [Encoding.OVERWRITE, Encoding.ULP])
def test_row_spans_through_a_plain_module_write_blocks_and_list_no_index(
    monkeypatch: pytest.MonkeyPatch, encoding: Encoding, piece: int | None
) -> None:
    """Half the columns of every row of a 2048 x 2048 matrix: one two-dimensional block
    plan, no index per entry, the other half untouched -- also cut into block tasks of 1000
    elements (a row's 1024 columns in two pieces)."""
    import dcr.apply.writes as writes

    if piece is not None:
        monkeypatch.setattr(writes, "BLOCK", piece)
    rows = cols = 2048
    w0 = {"w": torch.randn(rows, cols).to(torch.bfloat16)}
    w1 = {"w": torch.randn(rows, cols).to(torch.bfloat16)}
    receiver = Applier(TorchModuleLoader(module_from_state_dict(w0)), catalog_of(w0))
    receiver.prewarm()
    relative = frozenset({"w"}) if encoding is Encoding.ULP else frozenset()
    _, second = _row_spans(w0, w1, relative, parts=2)
    assert second.span == Span(cols // 2, cols // 2, cols // 2)
    report, peak, blocks = _apply_traced(monkeypatch, receiver, second)
    entries = rows * cols // 2
    assert blocks and report.written == entries
    # Listed indices alone would take 8 bytes per entry; a relative block on numpy holds
    # temporaries of a piece's words.
    assert peak < (entries if encoding is Encoding.OVERWRITE else 8 * entries)
    got = bits(dict(receiver.loader.module.named_parameters())["w"].detach())
    want = bits(w0["w"]).copy()
    want[:, cols // 2 :] = bits(w1["w"])[:, cols // 2 :]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("encoding", [Encoding.OVERWRITE, Encoding.ULP])
def test_row_spans_of_both_ranks_in_one_payload_join_into_one_run(
    monkeypatch: pytest.MonkeyPatch, encoding: Encoding
) -> None:
    """Both training ranks' column blocks of a matrix in one apply call: they interleave into
    one run of every element, with the bits of a dense load."""
    import dcr.apply.admission as admission

    joined: list[bool] = []
    real = admission._interleaved
    monkeypatch.setattr(admission, "_interleaved", lambda spans: joined.append(True) or real(spans))
    rows, cols = 64, 1024
    w0 = {"w": torch.randn(rows, cols).to(torch.bfloat16)}
    w1 = {"w": torch.randn(rows, cols).to(torch.bfloat16)}
    receiver = Applier(TorchModuleLoader(module_from_state_dict(w0)), catalog_of(w0))
    receiver.prewarm()
    relative = frozenset({"w"}) if encoding is Encoding.ULP else frozenset()
    items = _row_spans(w0, w1, relative, parts=2)
    assert all(i.span is not None and i.span.gap for i in items)
    report = receiver.apply_items(items[::-1], attempt=1)  # in either order
    assert joined and all(j is not None for j in joined)  # one run, not listed indices
    assert report.written == rows * cols and report.items[0].merged == 2
    got = bits(dict(receiver.loader.module.named_parameters())["w"].detach())
    np.testing.assert_array_equal(got, bits(w1["w"]))
