"""``dcr bench refit --backend ray``: the benchmark's fleet as actors on a local Ray cluster it
starts: every refit bit-exact, timed as the process fleet's are (from the roles' events), the
cluster's start-up reported; beside a process fleet's row in one table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import TINY

from dcr.bench.refit import BenchLayout, format_refit_table, run_refit_bench


def test_the_refit_benchmark_on_ray(tmp_path: Path) -> None:
    result = run_refit_bench(
        rates=(0.03,),
        transports=("relay",),
        repeats=1,
        link_gbps=0.5,
        layout=BenchLayout(tp=2, nodes=2, serving_tp=2, chunk_mb=0.03125, bucket_mb=0.0625),
        directory=tmp_path,
        model_dims=TINY,
        backends=("ray",),
    )
    result = json.loads(json.dumps(result))  # what --json prints
    assert result["bit_exact"] is True and result["backends"] == ["ray"]
    (row,) = result["results"]
    assert row["backend"] == "ray" and row["transport"] == "relay" and row["rate"] == 0.03
    assert row["bit_exact"] and row["repeats"] == 1 and row["ray_start_s"] > 0
    assert row["payload_bytes"] > 0 and row["cross_bytes"] == row["payload_bytes"]
    assert 0 < row["construction_bound_s"] <= row["latency_s"]
    assert 0 < row["transport_bound_s"] <= row["latency_s"]
    cpu = sum(v for v in row["cpu_s"].values() if v is not None)
    assert cpu > 0 and row["cpu_bound_s"] == pytest.approx(cpu / result["cpus"])
    assert set(result["refits"]) == {"relay@ray"}
    assert (tmp_path / "relay@ray" / "run" / "events" / "coordinator.jsonl").is_file()
    # One table for both backends (a process row as `dcr bench refit --backend process,ray`
    # would have put it first).
    process = {**row, "backend": "process", "ray_start_s": None}
    table = format_refit_table({**result, "results": [process, row]})
    lines = table.splitlines()
    assert any(line.startswith("relay ") for line in lines)
    assert any(line.startswith("relay@ray ") for line in lines)
    assert f"relay@ray: the Ray cluster started in {row['ray_start_s']:.1f} s" in lines
