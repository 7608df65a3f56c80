"""``dcr bench refit``: the union arithmetic of the lower bounds (paper App. C), the timings
drawn from a fleet's events, and one small run of the whole benchmark -- a tiny model, one
rate, the relay tree behind an emulated link -- whose JSON rows carry every field, whose
receivers were checked bit for bit, and whose numbers are consistent with each other."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dcr.bench.refit import (
    BenchLayout,
    fleet_text,
    format_refit_table,
    plot_refit,
    run_refit_bench,
    schedule,
)
from dcr.bench.window import covered, cpu_by_role, refit_timings
from dcr.cli import _parser
from dcr.errors import ConfigError
from dcr.fleet.config import load_fleet

TINY = dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32)  # fmt: skip
FIELDS = {"transport", "rate", "model_bytes", "latency_s", "reference_s", "speedup",
          "payload_bytes", "cross_bytes", "construction_bound_s", "transport_bound_s",
          "bound_ratio", "phases", "cpu_s", "cpu_share", "cpu_bound_s", "bit_exact"}  # fmt: skip


def test_covered_counts_overlaps_once_and_clips_to_the_window() -> None:
    assert covered([(1, 3), (2, 4), (6, 7)], 0, 10) == 4
    assert covered([(1, 3), (2, 4), (6, 7)], 2.5, 6.5) == pytest.approx(2.0)
    assert covered([(1, 10), (2, 3)], 0, 10) == 9
    assert covered([(5, 6)], 0, 4) == 0
    assert covered([], 0, 4) == 0
    assert covered([(3, 3), (4, 2)], 0, 9) == 0  # empty intervals add nothing


def _event(who: str, event: str, t: float, **fields: Any) -> dict[str, Any]:
    return {"who": who, "event": event, "t": t, **fields}


def _events() -> list[dict[str, Any]]:
    """Two owners, one receiver, one committed transition (attempt 5) to version 1; an
    interval of another attempt (4) that must not count."""
    return [
        _event("coordinator", "transition", 10.1, base=0),
        _event(
            "coordinator",
            "ended",
            12.3,
            base=0,
            record=1,
            outcome="committed",
            attempts=[{"attempt": 5, "mode": "mixed"}],
        ),
        _event("o0", "publish", 10.0, version=1),
        _event("o1", "publish", 10.05, version=1),
        _event("o0", "built", 10.6, attempt=5, rank=0, start=10.3, end=10.6),
        _event("o0", "built", 10.9, attempt=5, rank=0, start=10.5, end=10.9),
        _event("o0", "built", 10.9, attempt=4, rank=0, start=10.0, end=12.0),
        _event("o1", "built", 10.4, attempt=5, rank=1, start=10.3, end=10.4),
        _event("o0", "sent", 11.0, attempt=5, payload=0, size=100, start=10.6),
        _event("o0", "sent", 11.2, attempt=5, payload=1, size=50, start=10.9),
        _event("o1", "sent", 10.8, attempt=5, payload=0, size=70, start=10.4),
        _event("o0", "baseline", 12.0, rank=0, start=11.9, end=12.0),
        _event("o1", "baseline", 12.2, rank=1, start=11.95, end=12.2),
        _event("o0", "committed", 12.5, version=1, stage_s=0.2),
        _event("o1", "committed", 12.5, version=1, stage_s=0.1),
        _event("r0", "applied", 11.5, attempt=5, owner="o0", payload=1),
        _event("relay-node0", "traffic", 11.3, attempts={"5": [220, 220], "4": [9, 9]}),
    ]


def test_timings_of_a_relay_refit_from_its_events() -> None:
    (row,) = refit_timings(_events(), owners=("o0", "o1"), relayed=True)
    assert row["version"] == 1 and row["attempts"] == 1
    assert row["latency_s"] == pytest.approx(2.2)  # t0 = first publish, t1 = last baseline
    # o0: staging [10.0, 10.2] + buckets [10.3, 10.6] u [10.5, 10.9]; o1: 0.1 + 0.1
    assert row["construction_bound_s"] == pytest.approx(0.8)
    # o0's sends [10.6, 11.0] u [10.9, 11.2]; o1's [10.4, 10.8]
    assert row["transport_bound_s"] == pytest.approx(0.6)
    assert row["bound_ratio"] == pytest.approx(2.2 / 0.8)
    assert row["payload_bytes"] == 220 and row["payloads"] == 3 and row["cross_bytes"] == 220
    phases = row["phases"]
    assert phases == pytest.approx(
        {"stage_s": 0.2, "admit_s": 0.1, "stream_s": 1.2, "finalize_s": 0.7}
    )
    assert sum(phases.values()) == pytest.approx(row["latency_s"])


def test_phases_stay_consecutive_when_an_owner_builds_before_another_staged() -> None:
    """o1 built its first bucket ahead of the prepare (10.15) before o0 finished staging
    (10.2): admission is 0, streaming starts when staging ended, the phases still add up."""
    events = [e for e in _events() if not (e["event"] == "built" and e["who"] == "o1")] + [
        _event("o1", "built", 10.3, attempt=5, rank=1, start=10.15, end=10.3)
    ]
    (row,) = refit_timings(events, owners=("o0", "o1"), relayed=True)
    phases = row["phases"]
    assert phases == pytest.approx(
        {"stage_s": 0.2, "admit_s": 0.0, "stream_s": 1.3, "finalize_s": 0.7}
    )
    assert min(phases.values()) >= 0
    assert sum(phases.values()) == pytest.approx(row["latency_s"])


def test_object_storage_adds_each_nodes_fetches_and_counts_them_as_v_cross() -> None:
    events = [e for e in _events() if e["event"] != "traffic"]
    events += [
        _event("r0", "fetched", 11.1, attempt=5, size=150, start=10.7, end=11.1),
        _event("r0", "fetched", 11.6, attempt=5, size=70, start=11.1, end=11.6),
        _event("r1", "fetched", 11.6, attempt=5, size=220, start=11.0, end=11.4),
        _event("r1", "fetched", 11.6, attempt=4, size=999, start=10.0, end=12.0),
    ]
    (row,) = refit_timings(events, owners=("o0", "o1"), relayed=False)
    assert row["transport_bound_s"] == pytest.approx(0.9)  # r0's downloads
    assert row["payload_bytes"] == 220 and row["cross_bytes"] == 440


def test_cpu_seconds_by_role_between_the_events_around_the_window() -> None:
    events = [
        _event("o0", "publish", 10.0, cpu=5.0),
        _event("o0", "baseline", 12.0, cpu=6.5),
        _event("o0", "committed", 12.5, cpu=9.0),  # after t1: not counted
        _event("r0", "holds", 9.0, cpu=2.0),  # polling storage until t0: not counted
        _event("r0", "fetched", 10.5, cpu=3.0),
        _event("r0", "applied", 11.5, cpu=3.8),
        _event("r0", "holds", 13.0, cpu=5.0),
        _event("coordinator", "ended", 9.5, cpu=0.2),  # idle work between refits: not counted
        _event("coordinator", "transition", 10.1, cpu=1.0),
        _event("coordinator", "ended", 12.3, cpu=1.3),  # the coordinator's end counts
        _event("relay-node0", "state", 8.0, cpu=0.1),
        _event("relay-node0", "traffic", 10.5, cpu=0.5),
        _event("relay-node0", "state", 12.4, cpu=0.7),
        # relay-node1 went idle before t1 and next reports in the following refit
        _event("relay-node1", "traffic", 10.2, cpu=1.0),
        _event("relay-node1", "state", 11.0, cpu=1.1),
        _event("relay-node1", "traffic", 40.0, cpu=3.0),
        _event("r1", "started", 9.0),  # no clock: ignored
        # o1 publishes after t0 (o0's publish): its training step before is not counted
        _event("o1", "stepped", 4.0, cpu=1.0),
        _event("o1", "publish", 10.1, cpu=3.0),
        _event("o1", "baseline", 11.9, cpu=3.4),
    ]
    cpu = cpu_by_role(events, 10.0, 12.0, ("o0", "o1"))
    assert cpu == pytest.approx({"owners": 1.9, "receivers": 0.8, "coordinator": 0.3, "relay": 0.3})


def test_uncommitted_transitions_have_no_row() -> None:
    events = [e for e in _events() if e["event"] != "ended"]
    events.append(_event("coordinator", "ended", 12.3, base=0, record=0, outcome="aborted",
                         attempts=[{"attempt": 5, "mode": "mixed"}]))  # fmt: skip
    assert refit_timings(events, owners=("o0", "o1"), relayed=True) == []


def test_layout_schedule_and_fleet_file(tmp_path: Path) -> None:
    assert schedule([0.01, 0.03, 0.05], 2) == [0.03, 0.01, 0.03, 0.05, 0.01, 0.03, 0.05]
    with pytest.raises(ConfigError):
        BenchLayout(nodes=3, serving_tp=2)
    with pytest.raises(ConfigError):
        schedule([], 1)
    layout = BenchLayout(tp=2, nodes=4, serving_tp=2)
    for kind in ("relay", "directory", "s3"):
        extra = 'bucket = "b"\nendpoint_url = "http://127.0.0.1:1"\n' if kind == "s3" else ""
        path = tmp_path / kind / "fleet.toml"
        path.parent.mkdir()
        text = fleet_text(transport=kind, size_bytes=2e9, steps=[0.03, 0.01], layout=layout,
                          link_gbps=1.5, transport_extra=extra)  # fmt: skip
        path.write_text(text)
        cfg = load_fleet(path)
        assert cfg.transport["kind"] == kind and cfg.transport["link_gbps"] == 1.5
        assert cfg.model.rates == (0.03, 0.01) and cfg.model.refits == 2
        assert cfg.model.overrides["hidden_size"] == 2048  # dcr bench construct's model
        assert cfg.trainer.lockstep and cfg.world_size == 2 and cfg.model.preloaded
        assert [(r.name, r.tp, r.rank) for r in cfg.receivers] == [
            ("r0", 2, 0), ("r1", 2, 1), ("r2", 2, 0), ("r3", 2, 1)
        ]  # fmt: skip
        assert [len(n.receivers) for n in cfg.rollout] == [1, 1, 1, 1]


def test_cli_options() -> None:
    args = _parser().parse_args(["bench", "refit", "--transports", "relay,directory",
                                 "--rates", "0.03", "--link-gbps", "5", "--json"])  # fmt: skip
    assert args.transports == ["relay", "directory"] and args.rates == [0.03]
    assert args.link_gbps == 5.0 and args.size_gb == 2.0 and args.tp == 4
    with pytest.raises(SystemExit):
        _parser().parse_args(["bench", "refit", "--transports", "nfs"])
    assert args.backend == ["process"]
    both = _parser().parse_args(["bench", "refit", "--backend", "process,ray"])
    assert both.backend == ["process", "ray"]
    with pytest.raises(SystemExit):
        _parser().parse_args(["bench", "refit", "--backend", "k8s"])


def test_a_small_run_over_the_relay_tree(tmp_path: Path) -> None:
    result = run_refit_bench(
        rates=(0.05,),
        transports=("relay",),
        repeats=1,
        link_gbps=0.5,
        layout=BenchLayout(tp=2, nodes=2, serving_tp=2, chunk_mb=0.03125, bucket_mb=0.0625),
        directory=tmp_path,
        model_dims=TINY,
    )
    result = json.loads(json.dumps(result))  # what --json prints
    assert result["bit_exact"] is True
    (row,) = result["results"]
    assert set(row) >= FIELDS
    assert row["transport"] == "relay" and row["rate"] == 0.05 and row["bit_exact"]
    assert row["payload_bytes"] > 0 and row["cross_bytes"] == row["payload_bytes"]
    assert 0 < row["construction_bound_s"] <= row["latency_s"]
    assert 0 < row["transport_bound_s"] <= row["latency_s"]
    assert row["speedup"] == pytest.approx(row["reference_s"] / row["latency_s"])
    assert sum(row["phases"].values()) == pytest.approx(row["latency_s"])
    # The CPU seconds the roles used in the window, spread over the CPUs they share.
    cpu = sum(v for v in row["cpu_s"].values() if v is not None)
    assert cpu > 0 and row["cpu_bound_s"] == pytest.approx(cpu / result["cpus"])
    events = (tmp_path / "relay" / "run" / "events" / "coordinator.jsonl").read_text()
    assert '"dense"' not in events  # receivers loaded version 0 themselves ([model] preloaded)
    fetched = (tmp_path / "relay" / "run" / "events" / "r0.jsonl").read_text()
    assert '"fetched"' not in fetched  # fetch intervals are an object-storage matter
    refits = result["refits"]["relay"]
    assert [r["version"] for r in refits] == [1, 2] and refits[0]["warmup"]
    assert result["references"]["relay"][0]["bytes_per_node"] == row["model_bytes"]
    assert "relay" in format_refit_table(result)
    plot_refit(result, tmp_path / "refit.png")
    assert (tmp_path / "refit.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.heavy
def test_a_small_run_over_a_directory(tmp_path: Path) -> None:
    """Object storage: both nodes fetch every payload (V_cross = 2 x V_payload), their
    fetches join the transport bound, the reference uploads then downloads (once per repeat:
    each transfer under an attempt of its own, as the storage refuses a cleaned one)."""
    result = run_refit_bench(
        rates=(0.05,),
        transports=("directory",),
        repeats=2,
        link_gbps=0.5,
        layout=BenchLayout(tp=2, nodes=2, serving_tp=2, chunk_mb=0.03125, bucket_mb=0.0625),
        directory=tmp_path,
        model_dims=TINY,
    )
    assert result["bit_exact"] is True
    (row,) = result["results"]
    assert row["cross_bytes"] == 2 * row["payload_bytes"] > 0
    assert 0 < row["transport_bound_s"] <= row["latency_s"]
    refs = result["references"]["directory"]
    assert len(refs) == 2
    for ref in refs:
        assert ref["upload_s"] > 0 and ref["download_s"] > 0
        assert ref["seconds"] == pytest.approx(ref["upload_s"] + ref["download_s"])
    events = (tmp_path / "directory" / "run" / "events" / "r1.jsonl").read_text()
    assert '"fetched"' in events
