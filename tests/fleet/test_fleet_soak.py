"""Heavy: SIGKILLs of every role at random points across more than 30 refits."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from fleet_helpers import alive, small_fleet
from test_fleet_run import committed_versions

from dcr.fleet.faults import random_faults
from dcr.fleet.launcher import Launcher

REFITS = 33


def role(process: str) -> str:
    if process.startswith("relay-"):
        return "relay"
    if process.startswith("coordinator"):
        return "coordinator"
    return "receiver" if process.startswith("r") else "owner"


@pytest.mark.deep
@pytest.mark.timeout(1500)
def test_random_sigkills_across_thirty_refits_leave_every_receiver_bit_exact(
    tmp_path: Path,
) -> None:
    cfg = small_fleet(tmp_path, refits=REFITS, rate=0.03)
    plan = random_faults(cfg, seed=20261201)
    assert {role(f.target) for f in plan} == {"receiver", "owner", "coordinator", "relay"}
    launcher = Launcher(cfg, faults=plan, deadline_s=1200)
    report = launcher.run()
    summary = {
        "refits": REFITS,
        "sigkills": Counter(role(k["process"]) for k in report["sigkills"]),
        "starts": report["starts"],
        "seconds": report["seconds"],
        "attempts": sum(len(r["attempts"]) for r in report["refits"]),
    }
    print(json.dumps(summary))  # the figures the closing note quotes (pytest -s)
    assert report["bit_exact"] is True, report["mismatches"]
    assert all(r["bit_exact"] and len(r["receivers_checked"]) == 3 for r in report["refits"])
    assert committed_versions(cfg.run_dir) == [(v - 1, v) for v in range(1, REFITS + 1)]
    assert len(report["sigkills"]) >= 30
    assert set(summary["sigkills"]) == {"receiver", "owner", "coordinator", "relay"}
    pids = [p.popen.pid for p in launcher.procs.values() if p.popen is not None]
    assert not [pid for pid in pids if alive(pid)]
