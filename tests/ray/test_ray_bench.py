"""``dcr bench refit --backend process,ray``: the same fleet as processes and as actors on a
local Ray cluster, in one run and one table; every refit bit-exact on both, the Ray cluster's
start-up reported, nothing of it left afterwards."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import TINY

from dcr.bench.refit import BenchLayout, format_refit_table, run_refit_bench


def test_the_refit_benchmark_on_ray_beside_the_process_fleet(tmp_path: Path) -> None:
    result = run_refit_bench(
        rates=(0.03,),
        transports=("relay",),
        repeats=2,
        link_gbps=0.5,
        layout=BenchLayout(tp=2, nodes=2, serving_tp=2, chunk_mb=0.03125, bucket_mb=0.0625),
        directory=tmp_path,
        model_dims=TINY,
        backends=("process", "ray"),
    )
    result = json.loads(json.dumps(result))  # what --json prints
    assert result["bit_exact"] is True and result["backends"] == ["process", "ray"]
    process, ray = result["results"]
    assert (process["backend"], ray["backend"]) == ("process", "ray")
    for row in (process, ray):
        assert row["transport"] == "relay" and row["rate"] == 0.03 and row["bit_exact"]
        assert row["repeats"] == 2 and row["latency_s"] > 0 and row["payload_bytes"] > 0
    # The same fleet and model: the same versions, so the same payload bytes.
    assert ray["payload_bytes"] == process["payload_bytes"]
    assert process["ray_start_s"] is None and ray["ray_start_s"] > 0
    assert set(result["refits"]) == {"relay", "relay@ray"}
    assert (tmp_path / "relay@ray" / "run" / "events" / "coordinator.jsonl").is_file()
    table = format_refit_table(result)
    assert "relay@ray" in table and "the Ray cluster started in" in table
