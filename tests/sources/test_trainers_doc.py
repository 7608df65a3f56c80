"""The FSDP2 example of docs/trainers.md runs: ``dcr fleet`` starts the page's trainer
(``my_trainer.py``, two FSDP2 ranks over gloo) and two torch receivers from the page's fleet
file, with ``--faults`` (a receiver and a trainer rank SIGKILLed mid-refit), and every receiver
ends holding exactly the weights the trainer served; the restarted trainer computed the same
bits as one that never stopped."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from dcr.fleet.checks import check_fingerprints, proof_from_json
from dcr.tensors.bits import bits

DOC = Path(__file__).resolve().parents[2] / "docs" / "trainers.md"
STEPS = 3


def block(language: str, marker: str) -> str:
    blocks = re.findall(rf"```{language}\n(.*?)```", DOC.read_text(), re.S)
    (found,) = [b for b in blocks if marker in b]
    return found


def run_fleet(directory: Path, *faults: str) -> dict[str, Any]:
    """The page's trainer and fleet file in ``directory``, run by ``dcr fleet --json``."""
    directory.mkdir()
    (directory / "my_trainer.py").write_text(block("python", "async def train("))
    (directory / "fleet.toml").write_text(block("toml", 'factory = "my_trainer:rollout_model"'))
    paths = [str(directory), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    done = subprocess.run(
        [sys.executable, "-m", "dcr.cli", "fleet", "--fleet", "fleet.toml", "--json", *faults],
        capture_output=True, text=True, timeout=300, cwd=directory, env=env,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    report: dict[str, Any] = json.loads(done.stdout)
    return report


def events(run_dir: Path) -> list[dict[str, Any]]:
    return [
        json.loads(line)
        for path in sorted((run_dir / "events").glob("*.jsonl"))
        for line in path.read_text().splitlines()
    ]


def served(run_dir: Path, version: int) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = torch.load(
        run_dir / "trainer" / f"served-{version}.pt", weights_only=True
    )
    return state


def test_the_fsdp_trainer_of_the_page_refits_its_receivers_exactly(tmp_path: Path) -> None:
    report = run_fleet(tmp_path / "faulty", "--faults")
    run_dir = tmp_path / "faulty" / "run"
    assert report["bit_exact"] and report["mismatches"] == []
    assert [r["version"] for r in report["refits"]] == list(range(1, STEPS + 1))
    assert report["sigkills"] == [{"version": 2, "process": "r1"}, {"version": 3, "process": "o1"}]
    found = events(run_dir)

    # The trainer restarted as a whole after o1 died and resumed at the committed version.
    starts = sorted((e["who"], e["version"]) for e in found
                    if e["event"] == "started" and e.get("role") == "owner")  # fmt: skip
    assert starts == [("o0", 0), ("o0", 2), ("o1", 0), ("o1", 2)]
    assert {e["who"]: e["version"] for e in found if e["event"] == "trained"} == {
        "o0": STEPS, "o1": STEPS,
    }  # fmt: skip
    steps = [e for e in found if e["event"] == "step" and e["who"] == "o0-trainer"]
    assert [e["version"] for e in steps] == list(range(1, STEPS + 1))
    assert all(e["payload_bytes"] > 0 and e["changed_elements"] > 0 for e in steps)

    # bf16 modules copied by name keep every tensor's bits: everything may travel relative.
    receivers = [e for e in found if e["event"] == "started" and e.get("role") == "receiver"]
    assert {e["who"] for e in receivers} == {"r0", "r1"}
    assert all(e["relative"] == 5 and e["refused"] == [] for e in receivers)
    assert all(e["refused_count"] == 0 for e in found if e["event"] == "transition")

    # Every version either receiver held is the trainer's served weights, bit for bit.
    holds = [e for e in found if e["event"] == "holds" and e["version"] >= 1]
    assert {e["who"] for e in holds if e["version"] == STEPS} == {"r0", "r1"}
    for e in holds:
        proof = {e["who"]: proof_from_json(e["proof"])}
        assert check_fingerprints(e["version"], served(run_dir, e["version"]), proof) == {}

    # The restarted trainer (model and optimizer from its checkpoint) computed the same bits
    # as one that never stopped.
    clean = run_fleet(tmp_path / "clean")
    assert clean["sigkills"] == [] and clean["bit_exact"]
    for version in range(1, STEPS + 1):
        want, got = served(tmp_path / "clean" / "run", version), served(run_dir, version)
        assert sorted(want) == sorted(got)
        assert all((bits(got[n]) == bits(want[n])).all() for n in want), version
