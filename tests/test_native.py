"""The C kernels (``dcr._kernels``) against the numpy implementations that define them.

Every kernel is compared with its numpy counterpart on every word width, at every
instruction-set level this machine has (the results must not depend on the CPU), on lengths
around the vector widths, unaligned views, every Rice parameter and odd stream offsets; and
every kernel refuses buffers it could overrun before it writes anything.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any, cast

import numpy as np
import pytest

import dcr.native
from dcr.tensors.bits import changed_values, changed_words
from dcr.tensors.ordered import ordered, ulp_delta, unordered
from dcr.tensors.records import Encoding
from dcr.wire.split import GAP_CAP, VALUE_CAP, pack_bits, pack_nibbles, remainder_bytes, split
from dcr.wire.split import zigzag as np_zigzag

kernels: Any = dcr.native.kernels
pytestmark = pytest.mark.skipif(kernels is None, reason="dcr._kernels is not built here")

WORDS = (np.uint8, np.uint16, np.uint32, np.uint64)
LEVELS = range(3)


def test_kernels_are_built_where_the_build_requires_them() -> None:
    """``make test`` sets DCR_REQUIRE_NATIVE=1: a build that lost its kernels fails here."""
    if os.environ.get("DCR_REQUIRE_NATIVE") == "1":
        dcr.native.require()
    assert dcr.native.available() == (kernels is not None)


@pytest.fixture(params=LEVELS, ids=["portable", "avx2", "avx512"])
def level(request: pytest.FixtureRequest) -> Iterator[int]:
    """Each instruction-set level up to the machine's highest (lower levels run everywhere)."""
    want = int(request.param)
    highest = kernels.isa()[1]
    previous = kernels.set_isa(min(want, highest))
    try:
        yield min(want, highest)
    finally:
        kernels.set_isa(previous)


def _pair(
    word: Any, n: int, density: float, seed: int, special: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    top = np.iinfo(word).max
    old = rng.integers(0, top, n, dtype=word, endpoint=True)
    if special and n:
        # +-0, all-ones (NaN payloads), the sign bit alone, the largest positive pattern.
        sign = word(1 << (8 * np.dtype(word).itemsize - 1))
        picks = np.array([0, sign, top, sign - word(1), word(1)], dtype=word)
        old[rng.integers(0, n, max(1, n // 8))] = rng.choice(picks, max(1, n // 8))
    new = old.copy()
    hit = rng.random(n) < density
    new[hit] = rng.integers(0, top, int(hit.sum()), dtype=word, endpoint=True)
    if special and n:
        flip = rng.random(n) < density
        new[flip] ^= np.array(1 << (8 * np.dtype(word).itemsize - 1), dtype=word)
    return new, old


@pytest.mark.parametrize("word", WORDS)
@pytest.mark.parametrize("n", [0, 1, 31, 32, 33, 63, 64, 65, 127, 128, 129, 1000, 4099])
@pytest.mark.parametrize("density", [0.0, 0.02, 0.5, 1.0])
def test_scan_equals_the_numpy_scan(level: int, word: Any, n: int, density: float) -> None:
    new, old = _pair(word, n + 3, density, seed=n + int(density * 100), special=True)
    for lo in (0, 1, 3):  # unaligned views
        a, b = new[lo : lo + n], old[lo : lo + n]
        ref_pos, ref_xor, ref_new = changed_words(a, b, new_values=True)
        assert ref_new is not None
        for kind in ("xor", "ulp", "new", "xor+new"):
            pos, values, second = changed_values(a, b, kind, offset=lo)
            np.testing.assert_array_equal(pos, ref_pos + lo)
            expect = {
                "xor": ref_xor,
                "ulp": ulp_delta(ref_new, ref_new ^ ref_xor),
                "new": ref_new,
                "xor+new": ref_xor,
            }[kind]
            assert values.dtype == a.dtype
            np.testing.assert_array_equal(values, expect)
            if kind == "xor+new":
                assert second is not None
                np.testing.assert_array_equal(second, ref_new)
            else:
                assert second is None


@pytest.mark.parametrize("word", WORDS)
def test_scan_equals_numpy_across_windows_of_changing_density(level: int, word: Any) -> None:
    """Long enough for the adaptive scans to switch between skipping unchanged steps and
    compacting every step (windows of 8,192 words), both ways, with a seam inside a window."""
    rng = np.random.default_rng(7)
    densities = [0.03, 0.5, 0.001, 0.0, 1.0, 0.3, 0.0002, 0.05]
    parts = [_pair(word, 8192 + 77 * j, d, seed=j) for j, d in enumerate(densities)]
    new = np.concatenate([p[0] for p in parts])
    old = np.concatenate([p[1] for p in parts])
    new[rng.integers(0, new.shape[0], 50)] ^= word(1)
    ref_pos, ref_xor, ref_new = changed_words(new, old, new_values=True)
    assert ref_new is not None and ref_pos.shape[0] > 10_000
    for kind, expect in (
        ("xor", ref_xor),
        ("ulp", ulp_delta(ref_new, ref_new ^ ref_xor)),
        ("new", ref_new),
        ("xor+new", ref_xor),
    ):
        pos, values, second = changed_values(new, old, kind, offset=5)
        np.testing.assert_array_equal(pos, ref_pos + 5)
        np.testing.assert_array_equal(values.view(np.uint8), expect.view(np.uint8))
        if kind == "xor+new":
            assert second is not None
            np.testing.assert_array_equal(second, ref_new)


def test_scan_refuses_what_it_could_overrun() -> None:
    a = np.zeros(100, np.uint16)
    pos = np.zeros(200, np.uint32)
    out = np.zeros(200, np.uint16)
    with pytest.raises(ValueError, match="too short"):
        kernels.scan(a, a, 0, pos[:150], out, out)
    with pytest.raises(ValueError, match="item size or length"):
        kernels.scan(a, a[:99], 0, pos, out, out)
    with pytest.raises(ValueError, match="item size or length"):
        kernels.scan(a, a.view(np.uint8), 0, pos, out, out)
    with pytest.raises(ValueError, match="4-byte items"):
        kernels.scan(a, a, 0, np.zeros(200, np.int64), out, out)
    with pytest.raises(ValueError, match="bad kind"):
        kernels.scan(a, a, 7, pos, out, out)
    with pytest.raises(ValueError, match="writable"):
        kernels.scan(a, a, 0, bytes(800), out, out)


def _np_split_stream(
    arrays: list[np.ndarray], ks: list[int], gaps: bool
) -> tuple[np.ndarray, dict[int, np.ndarray], np.ndarray]:
    """The numpy reference: symbols (bytes or packed nibbles), one stream per k, escapes."""
    cap = GAP_CAP if gaps else VALUE_CAP
    syms, escs, rems = [], [], {}
    for a, k in zip(arrays, ks, strict=True):
        words = (np.diff(a).view(np.uint64) - np.uint64(1)) if gaps else np_zigzag(a)
        s, e, r = split(words, k, cap)
        syms.append(s)
        escs.append(e)
        if k:
            rems.setdefault(k, []).append(r)
    sym = np.concatenate(syms) if syms else np.empty(0, np.uint8)
    streams = {k: pack_bits(np.concatenate(v), k) for k, v in rems.items()}
    return (sym if gaps else pack_nibbles(sym)), streams, np.concatenate(escs)


def _native_split_stream(
    arrays: list[np.ndarray], ks: list[int], gaps: bool
) -> tuple[np.ndarray, dict[int, np.ndarray], np.ndarray]:
    cap = GAP_CAP if gaps else VALUE_CAP
    sizes = [a.shape[0] - 1 if gaps else a.shape[0] for a in arrays]
    per_k: dict[int, int] = {}
    for k, n in zip(ks, sizes, strict=True):
        if k:
            per_k[k] = per_k.get(k, 0) + n
    total = sum(sizes)
    sym = np.zeros(total if gaps else (total + 1) // 2, np.uint8)
    streams = {k: np.zeros(remainder_bytes(n, k), np.uint8) for k, n in per_k.items()}
    at_rem = dict.fromkeys(per_k, 0)
    escs = []
    at = 0
    fn = kernels.split_gaps if gaps else kernels.split_ulp
    for a, k, n in zip(arrays, ks, sizes, strict=True):
        esc = np.zeros(max(n, 1), np.uint64)
        stream = streams.get(k, np.zeros(0, np.uint8))
        got = fn(a, k, cap, sym, at, stream, per_k.get(k, 0), at_rem.get(k, 0), esc)
        assert got >= 0
        escs.append(esc[:got])
        at += n
        if k:
            at_rem[k] += n
    return sym, streams, np.concatenate(escs)


@pytest.mark.parametrize("k", [0, 1, 3, 7, 8, 9, 13, 16, 21, 31, 40, 63])
def test_split_gaps_equals_numpy(k: int) -> None:
    rng = np.random.default_rng(k)
    # Items of odd lengths share the streams, so items start at odd bit and symbol offsets.
    arrays = []
    for n in (2, 3, 17, 1001, 64):
        step = rng.geometric(1.0 / min(2.0 ** (k + 2), 2.0**50), n).astype(np.int64)
        arrays.append(np.cumsum(step) + int(rng.integers(0, 1000)))
    ks = [k, max(0, k - 1), k, k, max(0, k - 2)]
    ref = _np_split_stream(arrays, ks, gaps=True)
    got = _native_split_stream(arrays, ks, gaps=True)
    np.testing.assert_array_equal(got[0], ref[0])
    assert got[1].keys() == ref[1].keys()
    for key in ref[1]:
        np.testing.assert_array_equal(got[1][key], ref[1][key])
    np.testing.assert_array_equal(got[2], ref[2])


@pytest.mark.parametrize(
    ("word", "k"),
    [(w, k) for w in WORDS for k in (0, 1, 2, 5, 8, 11) if k < 8 * np.dtype(w).itemsize],
)
def test_split_ulp_equals_numpy(word: Any, k: int) -> None:
    rng = np.random.default_rng(k * 7 + np.dtype(word).itemsize)
    arrays = []
    for n in (1, 3, 0, 1001, 64):
        small = rng.integers(-(2 ** (k + 3)), 2 ** (k + 3), n)
        big = rng.integers(np.iinfo(word).min, np.iinfo(word).max, n, dtype=word, endpoint=True)
        mix = np.where(rng.random(n) < 0.02, big, small.astype(word))
        arrays.append(mix.astype(word))
    ks = [k] * len(arrays)
    ref = _np_split_stream(arrays, ks, gaps=False)
    got = _native_split_stream(arrays, ks, gaps=False)
    np.testing.assert_array_equal(got[0], ref[0])
    for key in ref[1]:
        np.testing.assert_array_equal(got[1][key], ref[1][key])
    np.testing.assert_array_equal(got[2], ref[2])


def test_split_refuses_short_streams_and_unsorted_indices() -> None:
    idx = np.array([1, 5, 9, 30], np.int64)
    sym = np.zeros(3, np.uint8)
    esc = np.zeros(3, np.uint64)
    rem = np.zeros(remainder_bytes(3, 3), np.uint8)
    assert kernels.split_gaps(idx, 3, GAP_CAP, sym, 0, rem, 3, 0, esc) == 0
    with pytest.raises(ValueError, match="symbol stream"):
        kernels.split_gaps(idx, 3, GAP_CAP, sym, 1, rem, 3, 0, esc)
    with pytest.raises(ValueError, match="remainder stream"):
        kernels.split_gaps(idx, 3, GAP_CAP, sym, 0, rem, 3, 1, esc)
    with pytest.raises(ValueError, match="Rice parameter"):
        kernels.split_gaps(idx, 64, GAP_CAP, sym, 0, rem, 3, 0, esc)
    unsorted = np.array([1, 5, 5, 30], np.int64)
    assert kernels.split_gaps(unsorted, 0, GAP_CAP, sym, 0, rem[:0], 0, 0, esc) == -1
    big = np.array([0, 10_000], np.int64)
    with pytest.raises(ValueError, match="escape buffer"):
        kernels.split_gaps(big, 0, GAP_CAP, sym, 0, rem[:0], 0, 0, esc[:0])


def _np_apply(flat: np.ndarray, pos: np.ndarray, values: np.ndarray, enc: Encoding) -> None:
    if enc is Encoding.XOR:
        flat[pos] ^= values
    elif enc is Encoding.ULP:
        o = ordered(flat[pos])
        o += values
        flat[pos] = unordered(o)
    else:
        flat[pos] = values


@pytest.mark.parametrize("word", WORDS)
@pytest.mark.parametrize("enc", list(Encoding))
def test_rmw_equals_numpy(word: Any, enc: Encoding) -> None:
    rng = np.random.default_rng(int(enc) * 10 + np.dtype(word).itemsize)
    flat = rng.integers(0, np.iinfo(word).max, 5000, dtype=word, endpoint=True)
    pos = np.sort(rng.choice(5000, 700, replace=False)).astype(np.int64)
    values = rng.integers(0, np.iinfo(word).max, 700, dtype=word, endpoint=True)
    ref = flat.copy()
    _np_apply(ref, pos, values, enc)
    assert kernels.rmw(flat, pos, values, int(enc), True) == 0
    np.testing.assert_array_equal(flat, ref)


def test_rmw_checks_every_position_before_writing() -> None:
    flat = np.arange(10, dtype=np.uint16)
    before = flat.copy()
    with pytest.raises(ValueError, match="outside the storage"):
        kernels.rmw(flat, np.array([1, 2, 10], np.int64), np.ones(3, np.uint16), 0, False)
    with pytest.raises(ValueError, match="outside the storage"):
        kernels.rmw(flat, np.array([-1, 2], np.int64), np.ones(2, np.uint16), 0, False)
    np.testing.assert_array_equal(flat, before)
    with pytest.raises(ValueError, match="2-byte items"):
        kernels.rmw(flat, np.array([1], np.int64), np.ones(1, np.uint32), 0, False)
    with pytest.raises(ValueError, match="bad encoding"):
        kernels.rmw(flat, np.array([1], np.int64), np.ones(1, np.uint16), 3, False)


@pytest.mark.parametrize("enc", list(Encoding))
def test_the_post_apply_check_counts_words_that_do_not_hold_the_expected_bits(
    enc: Encoding,
) -> None:
    """The check re-reads every word after all writes: two entries that land on one word
    (never sent by dcr; the receiver refuses them) leave each other's bits wrong."""
    flat = np.arange(1, 33, dtype=np.uint16)
    pos = np.array([3, 3, 5, 7, 7], np.int64)
    values = np.array([9, 4, 1, 2, 2], np.uint16)
    wrong = kernels.rmw(flat, pos, values, int(enc), True)
    # The earlier entry of each pair no longer finds its bits; overwrites of one word with
    # the same value (7: 2 and 2) agree.
    assert wrong == (1 if enc is Encoding.OVERWRITE else 2)
    assert kernels.rmw(flat, np.array([1, 2], np.int64), values[:2], int(enc), True) == 0


@pytest.mark.parametrize(
    ("dims", "src_offset", "dst_offset"),
    [
        ([(1, 50, 1)], 10, 3),  # a run
        ([(1, 50, 2)], 0, 0),  # a run written every other element
        ([(20, 5, 40), (1, 8, 1)], 4, 7),  # rows of 8 of a 20-wide source into a 40-wide storage
        ([(60, 2, 30), (20, 3, 8), (2, 4, 1)], 1, 0),  # nested, innermost stride 2
        ([], 17, 5),  # a single element
    ],
)
@pytest.mark.parametrize("enc", list(Encoding))
def test_rmw_mapped_equals_the_index_map(
    dims: list[tuple[int, int, int]], src_offset: int, dst_offset: int, enc: Encoding
) -> None:
    from dcr.apply.geometry import IndexMap

    imap = IndexMap(src_offset=src_offset, src_span=sum((s - 1) * t for t, s, _ in dims),
                    dst_offset=dst_offset, dims=tuple(dims))  # fmt: skip
    rng = np.random.default_rng(len(dims) + int(enc))
    indices = np.sort(rng.choice(200, 120, replace=False)).astype(np.int64)
    values = rng.integers(0, 65535, 120, dtype=np.uint16, endpoint=True)
    flat = rng.integers(0, 65535, 400, dtype=np.uint16, endpoint=True)
    ref = flat.copy()
    # Chunks of one item, of one entry up to several dozen.
    for lo, hi in ((0, 5), (5, 37), (37, 38), (38, 38), (38, 120)):
        sel, where = imap.select(indices[lo:hi])
        _np_apply(ref, where, values[lo:hi][sel], enc)
        d = np.array(dims, dtype=np.int64).reshape(-1)
        written, wrong = kernels.rmw_mapped(
            flat, indices, values, lo, hi, src_offset, dst_offset, d, int(enc), True
        )
        assert wrong == 0
        assert written == len(where)
    np.testing.assert_array_equal(flat, ref)


def _mapped_reference(index: int, src_offset: int, dst_offset: int, dims: Any) -> int:
    """Where one canonical index lands through a nested view, or -1 (digit by digit)."""
    r = index - src_offset
    if r < 0:
        return -1
    at = dst_offset
    for stride, size, dst_stride in dims:
        digit, r = divmod(r, stride)
        if digit >= size:
            return -1
        at += digit * dst_stride
    return at if r == 0 else -1


@pytest.mark.parametrize(
    "order",
    ["every element", "a few per row", "jumps over rows", "descending", "shuffled"],
)
def test_rmw_mapped_follows_rows_in_any_order(order: str) -> None:
    """A view of rows (row-parallel columns) maps entry by entry like the digit-by-digit
    reference, whichever way its indices move: before the view, inside one row, across
    several rows at once, past the last row, backwards."""
    dims = [(20, 6, 40), (1, 8, 1)]  # 6 rows of 8 columns of a 20-wide source
    src_offset, dst_offset = 33, 5
    rng = np.random.default_rng(7)
    every = np.arange(0, 200, dtype=np.int64)
    indices = {
        "every element": every,
        "a few per row": every[::7].copy(),
        "jumps over rows": np.array([0, 34, 35, 78, 79, 120, 160, 199], np.int64),
        "descending": every[::-3].copy(),
        "shuffled": rng.permutation(every)[:90],
    }[order]
    n = indices.shape[0]
    values = rng.integers(1, 65535, n, dtype=np.uint16, endpoint=True)
    flat = np.zeros(400, np.uint16)
    d = np.array(dims, dtype=np.int64).reshape(-1)
    written, _ = kernels.rmw_mapped(
        flat, indices, values, 0, n, src_offset, dst_offset, d, int(Encoding.OVERWRITE), False
    )
    ref = np.zeros(400, np.uint16)
    landed = 0
    for i, v in zip(indices.tolist(), values.tolist(), strict=True):
        at = _mapped_reference(i, src_offset, dst_offset, dims)
        if at >= 0:
            ref[at] = v
            landed += 1
    assert landed > 0
    assert written == landed
    np.testing.assert_array_equal(flat.view(np.int16), ref.view(np.int16))


def _one_by_one(flat: np.ndarray, pos: np.ndarray, values: np.ndarray, enc: Encoding) -> None:
    """Entries in order, each reading what the ones before it wrote."""
    for p, v in zip(pos.tolist(), values, strict=True):
        _np_apply(flat, np.array([p], np.int64), values=np.array([v]), enc=enc)


@pytest.mark.parametrize("word", WORDS)
@pytest.mark.parametrize("enc", list(Encoding))
def test_rmw_over_many_blocks_equals_entry_by_entry_writes(word: Any, enc: Encoding) -> None:
    """Chunks of thousands of entries, written in entry order whatever the path: explicit
    positions (rising, or with a repeated position and a run out of order), blocks of a linear
    view inside it and partly outside it, a nested view and a view with stride 0."""
    rng = np.random.default_rng(np.dtype(word).itemsize * 7 + int(enc))
    top = np.iinfo(word).max
    n = 5000
    flat = rng.integers(0, top, 20_000, dtype=word, endpoint=True)
    values = rng.integers(0, top, n, dtype=word, endpoint=True)
    rising = np.sort(rng.choice(20_000, n, replace=False)).astype(np.int64)
    jumbled = rising.copy()
    jumbled[2100:2300] = rng.permutation(jumbled[2100:2300])
    jumbled[3000] = jumbled[3001]  # two entries on one word
    for pos in (rising, jumbled):
        ref = flat.copy()
        _one_by_one(ref, pos, values, enc)
        kernels.rmw(flat, pos, values, int(enc), False)
        np.testing.assert_array_equal(flat, ref)
    views = (
        ([(1, 15_000, 1)], 2_000, 100),  # linear: the first and last entries fall outside
        ([(1, 9_000, 2)], 0, 1),  # linear, every other word
        ([(100, 90, 200), (1, 80, 1)], 3, 11),  # rows of 80 of a 100-wide source
        ([(1, 20_000, 0)], 0, 7),  # every index onto one word
    )
    for dims, src, dst in views:
        from dcr.apply.geometry import IndexMap

        imap = IndexMap(src_offset=src, src_span=sum((s - 1) * t for t, s, _ in dims),
                        dst_offset=dst, dims=tuple(dims))  # fmt: skip
        d = np.array(dims, dtype=np.int64).reshape(-1)
        ref = flat.copy()
        expected = 0
        for lo, hi in ((0, 1500), (1500, 4999), (4999, 5000)):
            sel, where = imap.select(rising[lo:hi])
            _one_by_one(ref, np.asarray(where, np.int64), values[lo:hi][sel], enc)
            written, _ = kernels.rmw_mapped(
                flat, rising, values, lo, hi, src, dst, d, int(enc), False
            )
            assert written == len(where)
            expected += len(where)
        assert expected
        np.testing.assert_array_equal(flat, ref)


def _task_world(word: Any, enc: Encoding) -> tuple[np.ndarray, list[tuple[Any, ...]], np.ndarray]:
    """A storage, two mapped plans and one of explicit positions, and their chunks."""
    rng = np.random.default_rng(np.dtype(word).itemsize + 3 * int(enc))
    top = np.iinfo(word).max
    flat = rng.integers(0, top, 30_000, dtype=word, endpoint=True)
    a = np.sort(rng.choice(12_000, 4000, replace=False)).astype(np.int64)
    b = np.sort(rng.choice(9_000, 2500, replace=False)).astype(np.int64)
    pos = np.sort(rng.choice(np.arange(25_000, 30_000), 1200, replace=False)).astype(np.int64)
    plans = [
        (flat, a, rng.integers(0, top, a.size, dtype=word, endpoint=True), 0, 0,
         np.array([1, 12_000, 1], np.int64)),
        # rows of 30 of a 100-wide source into a 130-wide storage
        (flat, b, rng.integers(0, top, b.size, dtype=word, endpoint=True), 100, 12_000,
         np.array([100, 90, 130, 1, 30, 1], np.int64)),
        (flat, pos, rng.integers(0, top, pos.size, dtype=word, endpoint=True), 0, 0, None),
    ]  # fmt: skip
    rows = [
        (p, lo, min(lo + 700, plans[p][1].size), int(enc))
        for p in range(3)
        for lo in range(0, plans[p][1].size, 700)
    ]
    return flat, plans, np.array(rows, np.int64)


def _tasks_reference(flat: np.ndarray, plans: list[tuple[Any, ...]], enc: Encoding) -> np.ndarray:
    from dcr.apply.geometry import IndexMap

    ref = flat.copy()
    for _, idx, values, src, dst, dims in plans:
        if dims is None:
            _np_apply(ref, idx, values, enc)
            continue
        triples = tuple(tuple(int(x) for x in t) for t in dims.reshape(-1, 3))
        imap = IndexMap(src_offset=src, src_span=sum((n - 1) * t for t, n, _ in triples),
                        dst_offset=dst, dims=triples)  # fmt: skip
        sel, where = imap.select(idx)
        _np_apply(ref, np.asarray(where, np.int64), values[sel], enc)
    return ref


@pytest.mark.parametrize("word", WORDS)
@pytest.mark.parametrize("enc", list(Encoding))
def test_rmw_tasks_shared_by_threads_equal_the_writes_one_by_one(word: Any, enc: Encoding) -> None:
    """Three threads draw chunks of three plans from one task list: every chunk is written
    exactly once, the per-plan sums are right and the storage ends as the numpy writes."""
    import threading

    flat, plans, rows = _task_world(word, enc)
    ref = _tasks_reference(flat, plans, enc)
    state = np.zeros(2 + 2 * len(plans), np.int64)
    threads = [
        threading.Thread(target=kernels.rmw_tasks, args=(plans, rows, state, True))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    np.testing.assert_array_equal(flat, ref)
    assert state[1] == 0
    assert state[5:].tolist() == [0, 0, 0]  # no post-apply check failure
    assert state[2] == plans[0][1].size and state[4] == plans[2][1].size
    assert 0 < state[3] < plans[1][1].size  # some indices lie outside the nested view


def test_rmw_tasks_validate_before_writing_and_stop_at_a_bad_position() -> None:
    flat, plans, rows = _task_world(np.uint16, Encoding.XOR)
    before = flat.copy()
    state = np.zeros(2 + 2 * len(plans), np.int64)
    for bad_rows, match in (
        (np.array([[3, 0, 1, 0]], np.int64), "bad task"),
        (np.array([[0, 0, 4001, 0]], np.int64), "bad task"),
        (np.array([[0, 0, 1, 7]], np.int64), "bad encoding"),
        (rows[:1, :3].copy(), "4 values per task"),
    ):
        with pytest.raises(ValueError, match=match):
            kernels.rmw_tasks(plans, bad_rows, state, False)
    outside = (*plans[0][:5], np.array([1, 40_000, 1], np.int64))
    with pytest.raises(ValueError, match="outside the storage"):
        kernels.rmw_tasks([outside], rows[:1], state[:4].copy(), False)
    with pytest.raises(ValueError, match="2 \\+ 2 per plan"):
        kernels.rmw_tasks(plans, rows, state[:3].copy(), False)
    np.testing.assert_array_equal(flat, before)
    # A position outside the storage in the second of three chunks: the first lands, the bad
    # one writes nothing and no caller takes another chunk.
    pos = np.arange(0, 3000, dtype=np.int64)
    pos[1500] = 30_000
    plan = (flat, pos, np.ones(3000, np.uint16), 0, 0, None)
    three = np.array([[0, 0, 1000, 0], [0, 1000, 2000, 0], [0, 2000, 3000, 0]], np.int64)
    state = np.zeros(4, np.int64)
    with pytest.raises(ValueError, match="outside the storage"):
        kernels.rmw_tasks([plan], three, state, False)
    assert state[1] == 1 and state[2] == 1000
    np.testing.assert_array_equal(flat[:1000], before[:1000] ^ 1)
    np.testing.assert_array_equal(flat[1000:], before[1000:])


def test_rmw_mapped_refuses_a_view_outside_the_storage() -> None:
    flat = np.zeros(10, np.uint16)
    d = np.array([1, 11, 1], np.int64)
    with pytest.raises(ValueError, match="outside the storage"):
        kernels.rmw_mapped(flat, np.arange(3), np.ones(3, np.uint16), 0, 3, 0, 0, d, 0, False)
    with pytest.raises(ValueError, match="entry range"):
        kernels.rmw_mapped(flat, np.arange(3), np.ones(3, np.uint16), 0, 4, 0, 0, d[:3], 0, False)
    assert not flat.any()


BLOCKS = [
    ((3, ()), 40),  # one element
    ((5, ((30, 1, 1),)), 40),  # a contiguous run
    ((2, ((4, 9, 5), (5, 1, 1))), 60),  # rows of a wider storage, contiguous inside
    ((1, ((3, 20, 4), (4, 2, 1))), 80),  # every other element of each row
    ((7, ((2, 30, 12), (3, 8, 4), (4, 1, 1))), 90),  # three dimensions
]


def _block_reference(
    flat: np.ndarray, dst: int, values: np.ndarray, src: int, dims: Any, enc: Encoding
) -> None:
    """The block entry by entry, through the numpy writer of one position array."""
    pos, at = [dst], [src]
    for size, ds, ss in dims:
        pos = [p + i * ds for p in pos for i in range(size)]
        at = [a + i * ss for a in at for i in range(size)]
    _np_apply(flat, np.array(pos, np.int64), values[np.array(at, np.int64)], enc)


@pytest.mark.parametrize("word", WORDS)
@pytest.mark.parametrize("enc", list(Encoding))
@pytest.mark.parametrize(("block", "src"), BLOCKS)
def test_write_block_equals_numpy(word: Any, enc: Encoding, block: Any, src: int) -> None:
    from dcr.apply.rmw import _block_numpy

    dst, dims = block
    rng = np.random.default_rng(np.dtype(word).itemsize + int(enc))
    flat = rng.integers(0, np.iinfo(word).max, 200, dtype=word, endpoint=True)
    values = rng.integers(0, np.iinfo(word).max, 120, dtype=word, endpoint=True)
    ref, by_numpy = flat.copy(), flat.copy()
    _block_reference(ref, dst, values, src, dims, enc)
    d = np.array(dims, dtype=np.int64).reshape(-1)
    written, wrong = kernels.write_block(flat, dst, values, src, d, int(enc), True)
    assert (written, wrong) == (int(np.prod([n for n, _, _ in dims])), 0)
    np.testing.assert_array_equal(flat, ref)
    assert _block_numpy(by_numpy, values, (dst, src, dims), enc, True) == 0
    np.testing.assert_array_equal(by_numpy, ref)


@pytest.mark.parametrize("word", WORDS)
@pytest.mark.parametrize("shift", [0, 1, 7])
def test_large_overwrite_blocks_stream_exactly(word: Any, shift: int) -> None:
    """Contiguous overwrites of 256 KiB and more are written with streamed stores: from any
    alignment of either buffer, with a tail shorter than a line, rows of a wider storage too,
    every word lands and nothing beside the block changes."""
    size = np.dtype(word).itemsize
    n = (300 << 10) // size + 5  # past the streaming threshold, with an odd tail
    rng = np.random.default_rng(size + shift)
    flat = rng.integers(0, np.iinfo(word).max, 2 * n + 64, dtype=word, endpoint=True)
    values = rng.integers(0, np.iinfo(word).max, 2 * n + 64, dtype=word, endpoint=True)
    ref = flat.copy()
    ref[shift + 3 : shift + 3 + n] = values[shift : shift + n]
    d = np.array([(n, 1, 1)], np.int64).reshape(-1)
    assert kernels.write_block(flat, shift + 3, values, shift, d, 1, True) == (n, 0)
    np.testing.assert_array_equal(flat.view(np.uint8), ref.view(np.uint8))
    # two rows of the block, each streamed, into rows of a wider storage
    half = n // 2
    d = np.array([(2, half + 11, half), (half, 1, 1)], np.int64).reshape(-1)
    assert kernels.write_block(flat, 1, values, 7, d, 1, False) == (2 * half, 0)
    ref[1 : 1 + half] = values[7 : 7 + half]
    ref[12 + half : 12 + 2 * half] = values[7 + half : 7 + 2 * half]
    np.testing.assert_array_equal(flat.view(np.uint8), ref.view(np.uint8))


@pytest.mark.parametrize("enc", list(Encoding))
def test_write_block_check_counts_words_written_twice(enc: Encoding) -> None:
    """The check re-reads the whole block after its writes, like ``rmw``'s: rows that land on
    one destination row (stride 0; never planned by dcr) leave each other's bits wrong."""
    from dcr.apply.rmw import _block_numpy

    values = np.arange(1, 13, dtype=np.uint16)
    dims = ((3, 0, 4), (4, 1, 1))
    flat = np.zeros(10, np.uint16)
    by_numpy = flat.copy()
    d = np.array(dims, np.int64).reshape(-1)
    written, wrong = kernels.write_block(flat, 2, values, 0, d, int(enc), True)
    assert written == 12 and wrong == 8
    assert _block_numpy(by_numpy, values, (2, 0, dims), enc, True) == 8
    if enc is Encoding.OVERWRITE:  # the last row wins in both (relative rows compound in C)
        np.testing.assert_array_equal(flat, by_numpy)


def test_write_block_checks_its_reach_before_writing() -> None:
    flat = np.zeros(10, np.uint16)
    values = np.ones(10, np.uint16)
    for dst, src, dims in (
        (0, 0, [(11, 1, 1)]),  # past the storage
        (7, 0, [(2, 4, 1)]),  # the second element lies past the storage
        (0, 3, [(8, 1, 1)]),  # past the values
        (-1, 0, [(2, 1, 1)]),
        (0, 0, [(0, 1, 1)]),  # an empty dimension
        (0, 0, [(2, -1, 1)]),  # a negative stride
        (0, 0, [(1 << 62, 1 << 62, 1)]),  # overflowing reach
    ):
        d = np.array(dims, np.int64).reshape(-1)
        with pytest.raises(ValueError, match=r"outside its buffers|bad dims"):
            kernels.write_block(flat, dst, values, src, d, 1, False)
    with pytest.raises(ValueError, match="bad encoding"):
        kernels.write_block(flat, 0, values, 0, np.array([2, 1, 1], np.int64), 3, False)
    with pytest.raises(ValueError, match="2-byte items"):
        kernels.write_block(
            flat, 0, values.view(np.uint8), 0, np.array([2, 1, 1], np.int64), 1, False
        )
    with pytest.raises(ValueError, match="bad dims"):
        kernels.write_block(flat, 0, values, 0, np.array([2, 1], np.int64), 1, False)
    assert not flat.any()


def test_increasing() -> None:
    assert kernels.increasing(np.array([], np.int64))
    assert kernels.increasing(np.array([5], np.int64))
    assert kernels.increasing(np.array([1, 2, 9], np.int64))
    assert not kernels.increasing(np.array([1, 2, 2], np.int64))
    assert not kernels.increasing(np.array([3, 2, 9], np.int64))


@pytest.mark.parametrize("word", WORDS)
@pytest.mark.parametrize("shift", [0, 7])
def test_copy_at_copies_exactly_the_positions(word: Any, shift: int) -> None:
    new, old = _pair(word, 1000, 0.1, seed=3)
    positions = np.flatnonzero(new != old)[::2].astype(np.int64) + shift
    want = old.copy()
    want[positions - shift] = new[positions - shift]
    got = old.copy()
    kernels.copy_at(got, new, positions, shift)
    assert np.array_equal(got, want)
    assert not np.array_equal(got, new)  # only the listed positions moved


def test_copy_at_refuses_positions_outside_the_views_before_writing() -> None:
    new, old = _pair(np.uint16, 100, 0.5, seed=4)
    for bad, shift in (([3, 100], 0), ([3, 4], 5), ([-1], 0)):
        got = old.copy()
        with pytest.raises(ValueError, match="outside"):
            kernels.copy_at(got, new, np.array(bad, np.int64), shift)
        assert np.array_equal(got, old)
    with pytest.raises(ValueError, match="differ"):
        kernels.copy_at(old.copy(), new[:50], np.array([1], np.int64), 0)


@pytest.mark.parametrize("period,gap", [(1, 0), (1, 3), (7, 0), (96, 160), (4096, 1)])
def test_spread_rows_equals_numpy_in_any_order(period: int, gap: int) -> None:
    rng = np.random.default_rng(period + gap)
    n = 50_000
    for local in (
        np.sort(rng.choice(10 * n, n, replace=False)),  # a scan's sorted positions
        rng.integers(0, 10 * n, 2_000),  # any order, repeats, rows revisited
        np.array([0, period - 1, period, 2 * period - 1, 0], np.int64),  # row edges
        np.empty(0, np.int64),
    ):
        local = local.astype(np.int64)
        want = local + (local // period) * gap + 11
        got = np.full(local.shape[0] + 1, -7, np.int64)
        kernels.spread_rows(local, period, gap, 11, got)
        assert np.array_equal(got[:-1], want)
        assert got[-1] == -7  # nothing written past the input's length


def test_spread_rows_refuses_bad_arguments() -> None:
    local = np.arange(10, dtype=np.int64)
    with pytest.raises(ValueError, match="too short"):
        kernels.spread_rows(local, 4, 1, 0, np.empty(9, np.int64))
    with pytest.raises(ValueError, match="period"):
        kernels.spread_rows(local, 0, 1, 0, np.empty(10, np.int64))
    with pytest.raises(ValueError, match="negative"):
        kernels.spread_rows(np.array([3, -1], np.int64), 4, 1, 0, np.empty(2, np.int64))
    with pytest.raises(ValueError):
        kernels.spread_rows(local.astype(np.int32), 4, 1, 0, np.empty(10, np.int64))


def _streams_for(
    arrays: list[np.ndarray], ks: list[int], gaps: bool
) -> tuple[np.ndarray, list[Any], np.ndarray]:
    sym, streams, esc = _native_split_stream(arrays, ks, gaps)
    as_list: list[Any] = [None] * 64
    for k, stream in streams.items():
        as_list[k] = stream
    return sym, as_list, esc


@pytest.mark.parametrize("k", [0, 2, 3, 7, 8, 12, 33])
def test_join_locations_inverts_split_gaps(k: int) -> None:
    rng = np.random.default_rng(k + 100)
    rice_items = [
        np.cumsum(rng.geometric(1.0 / 2.0 ** (k + 1), n)).astype(np.int64) for n in (2, 9, 500)
    ]
    ks = [k, k, max(0, k - 1)]
    sym, streams, esc = _streams_for(rice_items, ks, gaps=True)
    # A run between the Rice items, and an empty item.
    counts = [2, 0, 9, 4, 500]
    rice = [1, 0, 1, 0, 1]
    k_col = [ks[0], 0, ks[1], 0, ks[2]]
    starts = [int(rice_items[0][0]), 0, int(rice_items[1][0]), 7, int(rice_items[2][0])]
    numel = [int(a[-1]) + 1 for a in rice_items]
    numel = [numel[0], 5, numel[1], 11, numel[2]]
    out = np.empty(sum(counts), np.int64)
    args = [np.array(c, np.int64) for c in (counts, rice, k_col)]
    status, item = kernels.join_locations(
        sym, streams, esc, *args, np.array(starts, np.uint64), np.array(numel, np.int64), out
    )
    assert (status, item) == (0, -1)
    expect = np.concatenate([rice_items[0], rice_items[1], np.arange(7, 11), rice_items[2]])
    np.testing.assert_array_equal(out, expect)
    # One element short of the last position: the item is outside its tensor.
    numel[4] -= 1
    status, item = kernels.join_locations(
        sym, streams, esc, *args, np.array(starts, np.uint64), np.array(numel, np.int64), out
    )
    assert status in (1, 2) and item == 4
    # Streams that do not match the items.
    status, _ = kernels.join_locations(
        sym[:-1], streams, esc, *args, np.array(starts, np.uint64), np.array(numel, np.int64), out
    )
    assert status == 3


@pytest.mark.parametrize("k", [0, 1, 3, 5, 7])
def test_join_locations_with_escapes_and_long_items(k: int) -> None:
    """The per-k decoding of small parameters: escaped quotients, items that share one
    remainder stream at unaligned bit offsets, items long enough for every refill width."""
    rng = np.random.default_rng(k)
    items = []
    for n in (3, 700, 1_001):
        gaps = rng.geometric(1.0 / 2.0 ** (k + 1), n).astype(np.int64)
        if n > 11:
            gaps[rng.integers(11, n, n // 50)] += (300 << k) + rng.integers(0, 1 << 20)
        gaps[min(10, n - 1)] += 1 << 22  # the middle item: small gaps, then an escaped one
        items.append(np.cumsum(gaps))
    ks = [k, k, k]
    sym, streams, esc = _streams_for(items, ks, gaps=True)
    assert esc.shape[0] >= 3
    counts = np.array([a.shape[0] for a in items], np.int64)
    starts = np.array([int(a[0]) for a in items], np.uint64)
    numel = np.array([int(a[-1]) + 1 for a in items], np.int64)
    args = (counts, np.ones(3, np.int64), np.array(ks, np.int64))
    out = np.empty(int(counts.sum()), np.int64)
    assert kernels.join_locations(sym, streams, esc, *args, starts, numel, out) == (0, -1)
    np.testing.assert_array_equal(out, np.concatenate(items))
    # The middle item's tensor ends right after its first ten positions: the escaped gap
    # that follows is larger than the tensor.
    short = numel.copy()
    short[1] = int(items[1][9]) + 1
    status, item = kernels.join_locations(sym, streams, esc, *args, starts, short, out)
    assert status == 1 and item == 1
    # Its tensor ends at its last position (every gap fits): a position outside the tensor.
    short[1] = int(items[1][-1])
    status, item = kernels.join_locations(sym, streams, esc, *args, starts, short, out)
    assert status == 2 and item == 1
    # One escape word missing, or one too many.
    for bad in (esc[:-1], np.concatenate([esc, esc[-1:]])):
        status, _ = kernels.join_locations(sym, streams, bad, *args, starts, numel, out)
        assert status == 3
    # An escaped quotient whose gap wraps around 64 bits (to a small, valid-looking gap).
    wrap = esc.copy()
    wrap[0] = np.uint64(1 << (64 - k)) if k else np.uint64(1 << 63)
    status, item = kernels.join_locations(sym, streams, wrap, *args, starts, numel, out)
    assert status == 1 and item == 0


@pytest.mark.parametrize("k", [0, 3])
def test_join_locations_rejects_positions_past_the_tensor_however_they_come(k: int) -> None:
    """Unescaped gaps are checked once, at the item's end: positions that leave the tensor
    and an escaped gap that would wrap them around 2**64 back inside are still rejected."""
    numel = (1 << 63) - 1
    start = numel - 5
    streams: list[Any] = [None] * 64

    def join(symbols: list[int], escapes: list[int], remainders: int = 0) -> tuple[int, int]:
        if k:
            streams[k] = np.array([remainders], np.uint8)  # every remainder 0 (k = 3: 2 words)
        n = len(symbols) + 1
        return cast(
            tuple[int, int],
            kernels.join_locations(
                np.array(symbols, np.uint8), streams, np.array(escapes, np.uint64),
                np.array([n], np.int64), np.ones(1, np.int64), np.array([k], np.int64),
                np.array([start], np.uint64), np.array([numel], np.int64),
                np.empty(n, np.int64),
            ),
        )  # fmt: skip

    # Small gaps that end past the tensor: rejected at the item's end.
    assert join([1, 2], []) == (2, 0)
    assert join([0, 0], []) == (0, -1)  # positions numel - 4 and - 3: inside
    # Past the tensor, then an escaped gap as large as the tensor allows: its sum would wrap
    # around 2**64 to a small position; it is rejected before it is added.
    assert join([254, 255], [(numel - 1) >> k]) == (2, 0)


@pytest.mark.parametrize("k", [0, 1, 4, 9])
def test_join_values_inverts_split_ulp(k: int) -> None:
    rng = np.random.default_rng(k + 200)
    arrays = [rng.integers(-(2 ** (k + 4)), 2 ** (k + 4), n).astype(np.int16) for n in (3, 0, 70)]
    arrays = [a.view(np.uint16) for a in arrays]
    sym, streams, esc = _streams_for(arrays, [k] * 3, gaps=False)
    out = np.empty(73, np.uint64)
    counts = np.array([3, 0, 70], np.int64)
    limit = np.full(3, 0xFFFF, np.uint64)
    status, _ = kernels.join_values(sym, streams, esc, counts, np.full(3, k, np.int64), limit, out)
    assert status == 0
    np.testing.assert_array_equal(out, np_zigzag(np.concatenate(arrays)).astype(np.uint64))
    status, _ = kernels.join_values(
        sym, streams, esc, counts, np.full(3, k, np.int64), np.full(3, 3, np.uint64), out
    )
    assert status == 1


@pytest.mark.parametrize("word", WORDS)
@pytest.mark.parametrize("k", [0, 2, 5, 7, 9])
def test_join_values_unzigzags_at_word_width(level: int, word: Any, k: int) -> None:
    """``unzigzag=True`` writes the ULP deltas themselves at their width: escapes, items that
    share one remainder stream at unaligned bit offsets, long items."""
    rng = np.random.default_rng(k + 300)
    bits = 8 * np.dtype(word).itemsize
    signed = np.dtype(f"i{np.dtype(word).itemsize}")
    spread = min(k + 2, bits - 1)  # quotients below the cap: escapes only where planted
    arrays = []
    for n in (5, 0, 900):
        a = rng.integers(-(2**spread), 2**spread, n).astype(signed)
        if n:
            a[rng.integers(0, n, max(1, n // 40))] = np.iinfo(signed).min  # escaped quotients
        arrays.append(a.view(word))
    counts = np.array([a.shape[0] for a in arrays], np.int64)
    ks = np.full(3, k, np.int64)
    sym, streams, esc = _streams_for(arrays, [k] * 3, gaps=False)
    limit = np.full(3, (1 << bits) - 1, np.uint64)
    out = np.empty(int(counts.sum()), word)
    assert kernels.join_values(sym, streams, esc, counts, ks, limit, out, True) == (0, -1)
    np.testing.assert_array_equal(out, np.concatenate(arrays))
    wide = np.empty(int(counts.sum()), np.uint64)
    assert kernels.join_values(sym, streams, esc, counts, ks, limit, wide) == (0, -1)
    np.testing.assert_array_equal(wide, np_zigzag(np.concatenate(arrays)).astype(np.uint64))
    # A word above its item's limit, and a limit the output width cannot hold.
    small = limit.copy()
    small[2] = 3
    status, item = kernels.join_values(sym, streams, esc, counts, ks, small, out, True)
    assert status == 1 and item == 2
    # An escaped quotient whose word wraps around 64 bits (to a small, valid-looking word).
    if esc.shape[0] and k:
        wrap = esc.copy()
        wrap[0] = np.uint64(1 << (64 - k))
        status, item = kernels.join_values(sym, streams, wrap, counts, ks, limit, out, True)
        assert status == 1 and item in (0, 2)
    if bits < 64:
        with pytest.raises(ValueError, match="bad item record"):
            kernels.join_values(sym, streams, esc, counts, ks, limit + np.uint64(1), out, True)


@pytest.mark.parametrize("cap", [1, 2, 3, 15, 255, 1000, (1 << 63) + 1, (1 << 64) - 1])
def test_value_k_classes_each_word_as_the_bit_length_of_its_quotient(cap: int) -> None:
    """One sampled word: k is bit_length(z // cap) (0 below the cap), at and around every
    power-of-two multiple of the cap."""
    from dcr.wire.split import unzigzag

    zs = {0, 1, cap - 1, cap, cap + 1, (1 << 64) - 1, (1 << 63), (1 << 63) - 1}
    for d in range(64):
        edge = cap << d
        zs.update(z for z in (edge - 1, edge, edge + 1) if 0 <= z < 1 << 64)
    for z in sorted(z for z in zs if z < 1 << 64):
        values = unzigzag(np.array([z], np.uint64))
        expect = 0 if z < cap else (z // cap).bit_length()
        assert kernels.value_k(values, 1, cap) == expect, z


@pytest.mark.parametrize("word", WORDS)
def test_value_k_equals_numpy(word: Any) -> None:
    from dcr.wire.split import value_k

    rng = np.random.default_rng(np.dtype(word).itemsize)
    for trial in range(300):
        n = int(rng.integers(0, 200_000 if trial % 20 == 0 else 3_000))
        scale = int(rng.integers(0, 8 * np.dtype(word).itemsize))
        values = rng.integers(-(2**scale), 2**scale, n, dtype=np.int64).astype(word)
        if trial % 3 == 0 and n:
            top = np.iinfo(word).max
            spikes = rng.integers(0, top, 1 + n // 100, dtype=word, endpoint=True)
            values[rng.integers(0, n, 1 + n // 100)] = spikes
        step = max(1, n // 65536)
        assert kernels.value_k(values, step, VALUE_CAP) == value_k(np_zigzag(values[::step]))
