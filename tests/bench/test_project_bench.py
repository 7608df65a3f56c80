"""``dcr bench project``: the projection's arithmetic against values computed by hand from a
made-up measurement, and its report (the paper's figures and every assumption)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dcr.bench.project import format_projection, project
from dcr.cli import main


def _row(kind: str, rate: float, payload: float, transport_s: float, floor: float) -> dict:
    return {
        "transport": kind,
        "rate": rate,
        "model_bytes": 1e9,
        "payload_bytes": payload,
        "construction_bound_s": 0.5,
        "transport_bound_s": transport_s,
        "latency_s": 1.0,
        "reference_s": 10.0,
        "reference_floor_s": floor,
        "cpu_s": {"owners": 0.5, "receivers": 0.7},
    }


def _measured() -> dict[str, Any]:
    """1 GB measured at 1 Gbit/s on 2 CPUs with 4 owners: 0.5 CPU seconds of owners per
    refit (2 GB/s per core), 0.5 s of overhead, references at 0.8 (relay) and 0.9 (S3) of
    their link time."""
    return {
        "link_gbps": 1.0,
        "cpus": 2,
        "layout": {"tp": 4, "dp": 1},
        "layout_text": "made up",
        "results": [
            _row("relay", 0.03, 2e7, 0.32, 8.0),
            _row("relay", 0.05, 3e7, 0.48, 8.0),
            _row("s3", 0.03, 2e7, 0.32, 9.0),
            _row("s3", 0.05, 3e7, 0.48, 9.0),
        ],
    }


def test_projection_arithmetic_by_hand() -> None:
    out = project(_measured())
    rows = {(r["model"], r["transport"], r["rate"]): r for r in out["rows"]}
    assert len(rows) == 5 * 2 * 2  # five checkpoints, two transports, two rates
    relay = rows[("120B", "relay", 0.03)]
    # V = 0.02 x 247.2 GB; C = 247.2 GB / 32 / 2 GB/s; T = V / (0.8 x 0.625 GB/s); f = 0.5
    assert relay["payload_bytes"] == pytest.approx(4.944e9)
    assert relay["construction_s"] == pytest.approx(3.8625)
    assert relay["transport_s"] == pytest.approx(9.888)
    assert relay["latency_s"] == pytest.approx(10.388)
    assert relay["reference_s"] == pytest.approx(247.2e9 / 0.625e9 / 0.8)  # 494.4 s
    assert relay["speedup"] == pytest.approx(494.4 / 10.388)
    obj = rows[("1T", "object storage", 0.05)]
    assert obj["measured_as"] == "s3"
    assert obj["transport_s"] == pytest.approx(0.03 * 2242e9 / (0.9 * 0.625e9))
    assert obj["latency_s"] == pytest.approx(obj["transport_s"] + 0.5)
    # each of 8 training nodes uploads an eighth, then every node downloads it all
    assert obj["reference_s"] == pytest.approx(1.125 * 2242e9 / 0.625e9 / 0.9)
    assert rows[("120B", "relay", 0.03)]["paper"]["relay_3pct_s"] == 22.6
    # owners 80x busier (40 CPU s): 25 MB/s per core, the 30B refit waits on construction
    slow = _measured()
    for r in slow["results"]:
        r["cpu_s"]["owners"] = 40.0
    small = next(r for r in project(slow)["rows"]
                 if (r["model"], r["transport"], r["rate"]) == ("30B", "relay", 0.03))  # fmt: skip
    assert small["construction_s"] == pytest.approx(63.2e9 / 32 / 2.5e7)  # 79 s
    assert small["latency_s"] == pytest.approx(79.0 + 0.5)
    # without CPU clocks: the construction bound on every core the owners could use
    bare = _measured()
    for r in bare["results"]:
        del r["cpu_s"]
    row = next(r for r in project(bare)["rows"] if r["model"] == "120B")
    assert row["construction_s"] == pytest.approx(247.2e9 / 32 / (1e9 / (0.5 * 2)))


def test_object_storage_uploads_and_downloads_have_shares_of_their_own() -> None:
    """The reference uploaded at half the link (4 s for 2 s of link time per owner) and
    downloaded at 0.8 of it (10 s for 8 s)."""
    measured = _measured()
    for r in measured["results"]:
        if r["transport"] == "s3":
            r.update(reference_upload_s=4.0, reference_download_s=10.0)
    out = project(measured)
    inputs = out["measured"]["inputs"]["object storage"]
    assert inputs["upload_share"] == pytest.approx(0.5)
    assert inputs["download_share"] == pytest.approx(0.8)
    key = ("120B", "object storage", 0.03)
    row = next(r for r in out["rows"] if (r["model"], r["transport"], r["rate"]) == key)
    # uploads of V/8 per node at 0.5 x 0.625 GB/s overlap downloads of V at 0.8 x 0.625 GB/s
    assert row["transport_s"] == pytest.approx(max(4.944e9 / 8 / 3.125e8, 4.944e9 / 5e8))
    assert row["reference_s"] == pytest.approx(247.2e9 / 8 / 3.125e8 + 247.2e9 / 5e8)


def test_a_rate_not_measured_is_scaled_and_said_so() -> None:
    measured = _measured()
    measured["results"] = [r for r in measured["results"] if r["rate"] == 0.05]
    out = project(measured)
    row = next(r for r in out["rows"] if r["model"] == "30B" and r["rate"] == 0.03)
    assert row["payload_bytes"] == pytest.approx(0.03 * 0.6 * 63.2e9)
    assert sum("scaled" in a for a in out["assumptions"]) == 2  # once per transport


def test_report_states_the_paper_and_the_assumptions(tmp_path: Path, capsys: Any) -> None:
    source = tmp_path / "refit.json"
    source.write_text(json.dumps(_measured()))
    assert main(["bench", "project", "--from", str(source)]) == 0
    text = capsys.readouterr().out
    for needed in ("22.6", "87.5 min", "12-40x", "5 Gbit/s", "235B", "assumptions:"):
        assert needed in text
    assert main(["bench", "project", "--from", str(source), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["testbed"]["owners"] == 32 and len(out["assumptions"]) >= 8
    assert format_projection(out).count("\n") > 20
