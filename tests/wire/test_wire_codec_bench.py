"""The codec benchmarks on small inputs: the right workload, the right keys, sane sizes."""

from __future__ import annotations

import torch
import zstandard

from dcr.bench.codec import (
    format_codec_table,
    format_sparse_table,
    run_codec_bench,
    run_layout_bench,
    run_sparse_bench,
)


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
    assert "paper_layout" in format_sparse_table(result)


def test_layout_bench_compares_whole_models() -> None:
    result = run_layout_bench(fraction=0.05)
    assert result["items"] > 10
    for encoding in ("xor", "overwrite"):
        sizes = result[encoding]
        assert sizes["changed"] > 0
        assert sizes["byteplane"] < sizes["plain"]
