"""A real trainer joins a fleet with one call (``dcr.join_trainer``), from the fleet file alone.

``dcr fleet`` starts a trainer of a user's own (``[trainer] kind = "module:function"``, two
FSDP2 ranks over gloo, fp32 master weights served in bf16) and two plain torch receivers
(``runtime = "torch"``, a factory of the user's).  One rank is SIGKILLed mid-refit: the
launcher restarts the trainer, every rank resumes from its own checkpoint of the committed
version and joins again, the step in flight is recomputed and published, and the receivers end
holding exactly the trainer's served weights -- the same bits as a run without the fault.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from dcr import join_trainer
from dcr.errors import ConfigError
from dcr.fleet.checks import check_fingerprints, proof_from_json
from dcr.fleet.config import free_port, load_fleet
from dcr.fleet.faults import Fault
from dcr.fleet.launcher import Launcher
from dcr.tensors.bits import bits

PLUGINS = Path(__file__).parent / "plugins"
STEPS = 3


def _fleet(directory: Path, *, steps: int = STEPS) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "fleet.toml"
    path.write_text(f"""[fleet]
run_dir = "run"

[trainer]
kind = "dcr_toy_trainer:trainer"
ranks = 2
chunk_mb = 0.004
bucket_mb = 0.004

[trainer.options]
steps = {steps}

[coordinator]
standbys = 0

[coordinator.timeouts]
prepare_s = 60
arrival_s = 60
gate_s = 60
flush_s = 120
commit_s = 5
stop_s = 30
baseline_s = 3

[[rollout]]
name = "node0"
port = {free_port()}
receivers = [
  {{ name = "r0", runtime = "torch", options = {{ factory = "dcr_toy_trainer:receiver_module" }} }},
  {{ name = "r1", runtime = "torch", options = {{ factory = "dcr_toy_trainer:receiver_module" }} }},
]
""")
    return path


def _events(run_dir: Path) -> list[dict[str, Any]]:
    return [
        json.loads(line)
        for path in sorted((run_dir / "events").glob("*.jsonl"))
        for line in path.read_text().splitlines()
    ]


def _served(run_dir: Path, version: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "trainer" / f"canonical-v{version}.safetensors"))


def _run(directory: Path, faults: list[Fault]) -> tuple[dict[str, Any], Path]:
    cfg = load_fleet(_fleet(directory))
    report = Launcher(cfg, faults=faults, deadline_s=600).run()
    return report, cfg.run_dir


@pytest.fixture
def plugins_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer and runtime modules importable here and in every process started."""
    paths = [str(PLUGINS), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))
    monkeypatch.syspath_prepend(str(PLUGINS))


def test_a_killed_trainer_rank_rejoins_and_every_receiver_ends_exact(
    tmp_path: Path, plugins_on_path: None
) -> None:
    report, run_dir = _run(tmp_path / "faulty", [Fault(version=2, target="o1", after="sent")])
    assert report["sigkills"] == [{"version": 2, "process": "o1"}], report
    assert [r["version"] for r in report["refits"]] == [1, 2, 3]
    events = _events(run_dir)
    # The trainer was restarted as a whole and resumed at the committed version.
    starts = [(e["who"], e["version"]) for e in events if e["event"] == "started"
              and e.get("role") == "owner"]  # fmt: skip
    assert sorted(starts) == [("o0", 0), ("o0", 1), ("o1", 0), ("o1", 1)]
    trained = {e["who"]: e["version"] for e in events if e["event"] == "trained"}
    assert trained == {"o0": STEPS, "o1": STEPS}
    # Versions committed once each, in order.
    committed = [e["version"] for e in events if e["event"] == "committed" and e["who"] == "o0"]
    assert committed == [1, 2, 3]
    # Every receiver holds exactly the trainer's served weights of every version it reported.
    served = {v: _served(run_dir, v) for v in range(1, STEPS + 1)}
    holds = [e for e in events if e["event"] == "holds" and e["version"] >= 1]
    assert {e["who"] for e in holds if e["version"] == STEPS} == {"r0", "r1"}
    for e in holds:
        failed = check_fingerprints(
            e["version"], served[e["version"]], {e["who"]: proof_from_json(e["proof"])}
        )
        assert failed == {}, (e["who"], e["version"], failed)
    # The restarted trainer computed the same weights as one that never stopped.
    clean_report, clean_dir = _run(tmp_path / "clean", [])
    assert clean_report["sigkills"] == []
    for v in range(1, STEPS + 1):
        want = _served(clean_dir, v)
        got = served[v]
        assert sorted(want) == sorted(got)
        for name in want:
            assert (bits(got[name]) == bits(want[name])).all(), (v, name)


def test_a_rank_whose_weights_are_not_the_committed_version_is_refused(
    tmp_path: Path, plugins_on_path: None
) -> None:
    from dcr.adapters.sources.state_dict import StateDictSource

    cfg = load_fleet(_fleet(tmp_path))
    cfg.run_dir.mkdir(parents=True)
    source = StateDictSource({"w": torch.zeros(4, 4, dtype=torch.bfloat16)})

    async def join(version: int) -> None:
        async with join_trainer(source, cfg, version=version):
            pass

    with pytest.raises(ConfigError, match="committed version 0") as caught:
        anyio.run(join, 3, backend="asyncio")
    assert "resume the trainer from its checkpoint of version 0" in str(caught.value)


def test_a_one_process_source_of_several_ranks_is_refused(
    tmp_path: Path, plugins_on_path: None
) -> None:
    from dcr.adapters.sources.state_dict import StateDictSource
    from dcr.delta.layout import TrainLayout

    cfg = load_fleet(_fleet(tmp_path))
    cfg.run_dir.mkdir(parents=True)
    source = StateDictSource(
        {"w": torch.zeros(4, 4, dtype=torch.bfloat16)}, layout=TrainLayout(dp=2)
    )

    async def join() -> None:
        async with join_trainer(source, cfg, version=0):
            pass

    with pytest.raises(ConfigError, match="lays out 2 training ranks in one process"):
        anyio.run(join, backend="asyncio")


def test_a_trainer_joining_an_fp8_fleet_quantizes_for_its_receivers(
    tmp_path: Path, plugins_on_path: None
) -> None:
    """``[model] rollout_dtype = "fp8"``: the rank's plan takes the fleet's FP8 scheme (its
    receivers' catalog holds float8 values and scales); a group built for another rollout is
    refused before it joins."""
    from dataclasses import replace

    from dcr.adapters.sources.state_dict import StateDictSource
    from dcr.delta.build import BuildConfig
    from dcr.delta.group import LocalTrainingGroup
    from dcr.delta.layout import TrainLayout, build_plan
    from dcr.fleet.trainer import _group
    from dcr.tensors.fp8 import FP8_DTYPE, Fp8Scheme

    base = load_fleet(_fleet(tmp_path))
    base = replace(base, trainer=replace(base.trainer, ranks=1))
    fp8 = replace(base, model=replace(base.model, rollout_dtype="fp8", fp8_block="channel"))
    q = "model.layers.0.self_attn.q_proj.weight"
    weights = {q: torch.randn(8, 16).to(torch.bfloat16), "model.norm.weight": torch.ones(16)}
    weights["model.norm.weight"] = weights["model.norm.weight"].to(torch.bfloat16)

    group = _group(StateDictSource(weights), fp8, BuildConfig(), 60.0)
    assert group.plan.fp8 == Fp8Scheme(None) and group.plan.quantized == {q}
    assert group.catalog[q].dtype == FP8_DTYPE
    assert group.catalog[q + "_scale"].dtype == torch.float32
    assert group.catalog["model.norm.weight"].dtype == torch.bfloat16
    # The BF16 fleet keeps the catalog as it is.
    assert _group(StateDictSource(weights), base, BuildConfig(), 60.0).catalog[q].dtype == (
        torch.bfloat16
    )

    catalog = StateDictSource(weights).plan.catalog
    bf16_group = LocalTrainingGroup(build_plan(catalog, TrainLayout()), weights)
    with pytest.raises(ConfigError, match="serves FP8 with per-output-channel scales") as caught:
        _group(bf16_group, fp8, BuildConfig(), 60.0)
    assert caught.value.check == "fp8"
    fp8_group = LocalTrainingGroup(build_plan(catalog, TrainLayout(), fp8=Fp8Scheme(4)), weights)
    with pytest.raises(ConfigError, match="serves BF16"):
        _group(fp8_group, base, BuildConfig(), 60.0)
