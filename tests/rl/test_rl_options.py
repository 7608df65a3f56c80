"""``dcr rl`` options that need no engine: what an FP8 rollout changes in the fleet file, the
run spec and the comparison of two runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from dcr.errors import ConfigError
from dcr.fleet.config import load_fleet
from dcr.rl.loop import RunSpec
from dcr.rl.run import RLOptions, _fleet_file, _spec, compare_runs
from dcr.tensors.fp8 import Fp8Scheme


def _cfg(tmp_path: Path, opts: RLOptions):  # type: ignore[no-untyped-def]
    checkpoint = tmp_path / "checkpoint-v0"
    spec = _spec(opts, tmp_path, checkpoint, tmp_path / "ready.json")
    return load_fleet(_fleet_file(opts, spec, checkpoint, tmp_path, None)), checkpoint


def test_an_fp8_run_serves_the_fp8_export_of_version_0(tmp_path: Path) -> None:
    opts = RLOptions(rollout_dtype="fp8", directory=tmp_path, keys=False)
    assert opts.fp8 == Fp8Scheme(None)
    cfg, checkpoint = _cfg(tmp_path, opts)
    assert cfg.model.fp8 == Fp8Scheme(None)
    assert Path(cfg.model.checkpoint) == checkpoint
    (engine,) = cfg.engines
    assert engine.model == str(checkpoint.with_name("checkpoint-v0-fp8"))
    spec = RunSpec.from_dict(dict(cfg.trainer.options))
    assert spec.rollout_dtype == "fp8" and spec.fp8 == Fp8Scheme(None)

    blocks = RLOptions(rollout_dtype="fp8", fp8_block=64, directory=tmp_path, keys=False)
    cfg, _ = _cfg(tmp_path, blocks)
    assert cfg.model.fp8 == Fp8Scheme(64)
    assert RunSpec.from_dict(dict(cfg.trainer.options)).fp8 == Fp8Scheme(64)


def test_a_bf16_run_serves_the_checkpoint_itself(tmp_path: Path) -> None:
    opts = RLOptions(directory=tmp_path, keys=False)
    cfg, _ = _cfg(tmp_path, opts)
    assert opts.fp8 is None and cfg.model.fp8 is None
    (engine,) = cfg.engines
    assert engine.model is None
    assert RunSpec.from_dict(dict(cfg.trainer.options)).fp8 is None


def test_fp8_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="--rollout-dtype"):
        RLOptions(rollout_dtype="int4")
    with pytest.raises(ConfigError, match="add --rollout-dtype fp8"):
        RLOptions(fp8_block=128)
    with pytest.raises(ConfigError, match="rollout_dtype"):
        RunSpec(steps=1, checkpoint="c", engine_ready="r", state_dir="s", events_dir="e",
                rollout_dtype="fp16")  # fmt: skip


def test_runs_that_served_different_rollouts_are_not_equal() -> None:
    row = {"step": 1, "reward": 0.5, "kl": 0.0, "loss": 0.1, "tokens_sha256": "ab"}
    bf16 = {"steps": [row], "final_weights_sha256": "x", "refit": "dense"}
    fp8 = {**bf16, "rollout_dtype": "fp8", "fp8_block": "channel"}
    assert compare_runs(bf16, dict(bf16, rollout_dtype="bf16", fp8_block=None))["equal"]
    assert compare_runs(fp8, dict(fp8))["equal"]
    verdict = compare_runs(fp8, bf16)
    assert not verdict["equal"] and not verdict["same_rollout_dtype"]
    assert not compare_runs(fp8, dict(fp8, fp8_block=128))["equal"]


def test_a_step_committed_while_the_trainer_was_down_is_marked_replayed() -> None:
    """The trainer died after version 2 committed, before it learned of it: on restart it
    replays step 2, and nothing reports that refit."""
    from dcr.rl.report import _Steps
    from dcr.testing.rl import reported_refits

    lines: list[str] = []
    steps = _Steps(lines.append)
    for step in (1, 2, 3):
        steps.on_event({"event": "rl-step", "step": step, "reward": 0.5, "kl": 0.0, "loss": 0.1,
                        "tokens_sha256": "ab", "staleness": 0})  # fmt: skip
    for step in (1, 3):
        steps.on_event({"event": "rl-refit", "step": step, "refit_s": 0.2, "payload_bytes": 10})
    steps.on_event({"event": "rl-replayed", "step": 2})
    rows = steps.rows(3)
    assert [r["replayed"] for r in rows] == [False, True, False]
    assert rows[1]["payload_bytes"] is None and rows[1]["refit_s"] is None
    assert [r["step"] for r in reported_refits(rows)] == [1, 3]
    rows[0]["payload_bytes"] = None  # a step without a report that was not replayed
    with pytest.raises(AssertionError):
        reported_refits(rows)


def test_the_table_names_an_fp8_rollout_and_marks_agreement() -> None:
    from dcr.rl.report import format_rl_table

    row = {"step": 1, "reward": 0.5, "kl": 0.0, "loss": 0.1, "tokens_sha256": "ab" * 32,
           "refit_s": 0.2, "gate_closed_s": 0.1, "dense_refit_s": None, "payload_bytes": 10,
           "changed_elements": 5, "staleness": 0, "replayed": False}  # fmt: skip
    run = {"refit": "delta", "mode": "sync", "tp": 1, "rollout_dtype": "fp8",
           "fp8_block": "channel", "steps": [row], "killed": [],
           "final_weights_sha256": "x"}  # fmt: skip
    text = format_rl_table(run, dict(run, refit="dense"))
    assert "FP8 rollouts (channel scales)" in text and "✓" in text
    assert "FP8" not in format_rl_table(dict(run, rollout_dtype="bf16", fp8_block=None))
