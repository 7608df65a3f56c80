"""The codec benchmarks on small inputs: the right workload, the right keys, sane sizes."""

from __future__ import annotations

import torch
import zstandard

from dcr.bench.codec import (
    format_codec_table,
    format_floor_table,
    format_sparse_table,
    run_codec_bench,
    run_floor_bench,
    run_layout_bench,
    run_sparse_bench,
)
from dcr.delta.entropy import gap_xor_floor_bytes
from dcr.tensors.bits import bits


def _changed_words(n: int, a: float) -> tuple[int, bytes]:
    """Table 2's workload computed independently: count and overwrite stream of changed words."""
    alpha = torch.randn(n, generator=torch.Generator().manual_seed(42), dtype=torch.bfloat16)
    noise = torch.randn(n, generator=torch.Generator().manual_seed(44))
    scaled = noise * torch.tensor(a, dtype=torch.float32)
    beta = (alpha.to(torch.float32) + scaled).to(torch.bfloat16)
    changed = alpha.view(torch.int16) != beta.view(torch.int16)
    return int(changed.sum()), beta.view(torch.int16)[changed].numpy().astype("<i2").tobytes()


def test_codec_bench_follows_table_2() -> None:
    result = run_codec_bench(n=200_000, amplitudes=(1e-4, 1e-2))
    assert list(result) == ["results"]
    rows = result["results"]
    assert [r["a"] for r in rows] == [1e-4, 1e-2]
    for row in rows:
        assert {"a", "changed", "overwrite_bytes", "xor_bytes", "xor_byteplane_bytes"} <= set(row)
        changed, overwrite = _changed_words(200_000, row["a"])
        assert row["changed"] == changed
        assert row["overwrite_bytes"] == len(zstandard.ZstdCompressor(level=1).compress(overwrite))
        assert row["xor_byteplane_bytes"] < row["xor_bytes"] < row["overwrite_bytes"]
        assert row["payload_byteplane_bytes"] < row["payload_plain_bytes"]
    assert rows[0]["changed"] < rows[1]["changed"]
    table = format_codec_table(result)
    assert len(table.splitlines()) == 3
    assert f"{rows[0]['overwrite_over_xor']:.2f}" in table


def test_sparse_bench_orders_the_layouts() -> None:
    result = run_sparse_bench(n=400_000)
    assert 0.015 < result["changed_fraction"] < 0.03
    b = result["bytes_per_changed"]
    assert b["order0_entropy_of_planes"] < b["byteplane_gaps_and_masks"] < b["byteplane_masks"]
    assert b["byteplane_masks"] < b["paper_layout"]
    assert b["payload_byteplane"] < b["payload_plain"]
    assert b["payload_v2_ulp"] < b["gap_xor_floor"] < b["payload_v2_xor"] <= b["payload_byteplane"]
    assert "paper_layout" in format_sparse_table(result)


def test_floor_bench_rows_compare_payloads_with_the_floor() -> None:
    result = run_floor_bench(n=300_000, fractions=(0.01, 0.05))
    rows = result["results"]
    assert [(r["fraction"], r["encoding"], r["version"]) for r in rows] == [
        (f, e, v) for f in (0.01, 0.05) for e, v in (("XOR", 1), ("XOR", 2), ("ULP", 2))
    ]
    # The floor is that of the workload's changed entries, computed independently here.
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(300_000, generator=gen, dtype=torch.bfloat16)
    chosen = torch.randperm(300_000, generator=gen)[:15_000]
    eps = torch.randn(15_000, generator=gen)
    new = w.clone()
    new[chosen] = (w[chosen].float() * (1 + 0.01 * eps)).to(torch.bfloat16)
    old_bits, new_bits = bits(w), bits(new)
    idx = (old_bits != new_bits).nonzero()[0]
    floor = gap_xor_floor_bytes([(idx, old_bits[idx] ^ new_bits[idx])])
    five = [r for r in rows if r["fraction"] == 0.05]
    assert all(r["changed"] == idx.shape[0] and r["floor_bytes"] == floor for r in five)
    for r in rows:
        assert r["ratio"] == r["payload_bytes"] / r["floor_bytes"]
        assert r["positions_bytes"] < r["payload_bytes"]
        assert r["gap_floor_bytes"] < r["floor_bytes"]
    ulp = [r["ratio"] for r in rows if r["encoding"] == "ULP"]
    xor1 = [r["ratio"] for r in rows if r["version"] == 1]
    assert all(u < x for u, x in zip(ulp, xor1, strict=True))
    assert len(format_floor_table(result).splitlines()) == 1 + len(rows)


def test_layout_bench_compares_whole_models() -> None:
    result = run_layout_bench(fraction=0.05)
    assert result["items"] > 10
    for encoding in ("xor", "overwrite"):
        sizes = result[encoding]
        assert sizes["changed"] > 0
        assert sizes["byteplane"] < sizes["plain"]
