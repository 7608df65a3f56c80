"""Receivers in a vLLM engine take the catalog of the checkpoint it serves.

* A worker checks the catalog against its model at prewarm: a catalog lacking a tensor the
  model holds, or naming one it cannot load, is refused with the tensor named.
* ``dcr fleet`` starts an engine (``[[engine]]``) whose fleet reads its catalog from a sharded
  checkpoint directory (``[model] checkpoint``); the engine joins serving that checkpoint,
  takes one refit in place, and equals, bit for bit, an engine started fresh on the new
  version's checkpoint (parameters, greedy tokens, log probabilities); the launcher's own
  check (the fingerprint of each rank's stored bits) agrees, and the engine's process group
  is gone when the launcher stops.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import (
    OVERRIDES,
    EngineServer,
    ReferenceRuns,
    bit_mismatches,
    fixed_prompts,
    group_members,
    same_floats,
)
from vllm_helpers import Checkpoint

from dcr.errors import ConfigError
from dcr.fleet.config import free_port, load_fleet
from dcr.fleet.launcher import Launcher
from dcr.fleet.model import FleetModel, sized_config
from dcr.models.hf import write_checkpoint
from dcr.models.synthetic import SyntheticRun
from dcr.tensors.records import TensorSpec

pytestmark = pytest.mark.vllm

FAMILY = "qwen3"
MAX_TOKENS = 8
SEED, RATE = 3, 0.05


def _fleet_file(directory: Path, checkpoint: Path, *, engine: str = "") -> Path:
    """A fleet of one rollout node with receiver ``r0``, whose model is ``checkpoint``."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "fleet.toml"
    path.write_text(f"""[fleet]
run_dir = "run"

[model]
checkpoint = "{checkpoint}"
seed = {SEED}
rate = {RATE}
refits = 1

[trainer]
tp = 1
dp = 1
chunk_mb = 0.03125
bucket_mb = 0.0625

[coordinator]
standbys = 0
join_wait_s = 300

[coordinator.timeouts]
prepare_s = 60
arrival_s = 60
gate_s = 120
flush_s = 120
commit_s = 5
stop_s = 60
baseline_s = 3

[control]
peer_timeout_s = 15

[transport]
peer_timeout_s = 15

[[rollout]]
name = "node0"
port = {free_port()}
receivers = [{{ name = "r0", tp = 1, rank = 0 }}]
{engine}""")
    return path


def test_a_worker_refuses_a_catalog_that_does_not_fit_its_model(
    tmp_path: Path, write_tiny: Callable[..., Checkpoint], build_model: Callable[[Path], Any]
) -> None:
    from safetensors.torch import save_file

    from dcr.integrations.vllm.worker import DcrWorkerExtension

    ck = write_tiny(FAMILY)
    model = build_model(ck.path)

    class Worker(DcrWorkerExtension):
        def get_model(self) -> torch.nn.Module:
            return model

    def prewarm(state: dict[str, torch.Tensor]) -> Any:
        """Prewarm over the catalog of a checkpoint directory holding ``state``."""
        directory = tmp_path / f"catalog-{len(state)}"
        directory.mkdir()
        save_file(state, str(directory / "model.safetensors"))
        cfg = load_fleet(_fleet_file(directory / "fleet", directory))
        return Worker()._dcr_prewarm(cfg, None)

    receiver, report = prewarm(dict(ck.state_dict))
    assert dict(receiver.catalog) == {n: TensorSpec.of(n, t) for n, t in ck.state_dict.items()}
    assert report.names == len(ck.state_dict) == report.preserving
    gone = "model.layers.1.mlp.up_proj.weight"
    with pytest.raises(ConfigError, match="does not fill 1 parameters") as info:
        prewarm({n: t for n, t in ck.state_dict.items() if n != gone})
    assert (info.value.check, info.value.tensor) == (
        "catalog",
        "model.layers.1.mlp.gate_up_proj.weight",
    )
    extra = "model.layers.0.mlp.extra.weight"
    with pytest.raises(ConfigError, match="vLLM cannot load") as info:
        prewarm({**ck.state_dict, extra: torch.zeros(2, dtype=torch.bfloat16)})
    assert (info.value.check, info.value.tensor) == ("catalog", extra)


ENGINE = """
[[engine]]
name = "e0"
receivers = ["r0"]
plain_weights = true
checkpoint_version = 0
env = { VLLM_CPU_OMP_THREADS_BIND = "nobind", VLLM_CPU_KVCACHE_SPACE = "1", \
DCR_EXPOSE_PARAMETERS = "1" }
"""


def test_an_engine_started_by_the_launcher_refits_the_checkpoint_it_serves(
    tmp_path: Path,
) -> None:
    # Versions 0 and 1 of a synthetic run of a tiny Qwen3, as sharded checkpoints: the
    # engine serves version 0, the fleet's catalog is read from its safetensors headers, and
    # the trainer steps the same run (same seed and rate) from there.
    config = sized_config(FAMILY, 0, **OVERRIDES[FAMILY])
    run = SyntheticRun(config=config, family=FAMILY, seed=SEED, rate=RATE)
    checkpoints = [
        write_checkpoint(tmp_path / f"v{v}", config, FAMILY, run.state(v), shard_bytes=1 << 15)
        for v in (0, 1)
    ]
    assert len(list(checkpoints[0].glob("*.safetensors"))) > 1
    cfg = load_fleet(_fleet_file(tmp_path / "fleet", checkpoints[0], engine=ENGINE))
    assert FleetModel(cfg).synthetic_problem is None
    references = ReferenceRuns.start(
        tmp_path / "reference", checkpoints[1:], tp=1, max_tokens=MAX_TOKENS
    )
    launcher = Launcher(cfg, deadline_s=900)
    seen: dict[str, Any] = {}

    def inspect() -> None:
        """The running engine, once version 1 is committed and checked by the launcher."""
        engine = EngineServer.launched(launcher)
        seen["pid"] = engine.popen.pid
        seen["state"] = engine.state()
        seen["parameters"] = engine.parameters()
        seen["outputs"] = [engine.generate(p, MAX_TOKENS) for p in fixed_prompts()]

    try:
        report = launcher.run(before_stop=inspect)
        ((params, outputs),) = references.result()
    finally:
        references.stop()
    assert report["bit_exact"] is True, report["mismatches"]
    (row,) = report["refits"]
    assert (row["receivers_checked"], row["attempts"]) == (["r0"], ["mixed"])
    # Joined serving version 0 (no dense restore) and took the refit in place.
    assert not [e for e in _events(cfg.run_dir) if e["event"] in ("dense", "restored")]
    assert not seen["state"]["closed"] and seen["state"]["workers"][0]["held"][0] == 1
    assert seen["state"]["workers"][0]["applied_payloads"] > 0
    assert bit_mismatches(seen["parameters"], params) == []
    for out, want in zip(seen["outputs"], outputs, strict=True):
        assert out["token_ids"] == want["token_ids"] and out["version"] == 1
        assert same_floats(out["logprobs"], want["logprobs"])
    # The launcher stopped the engine's whole process group.
    assert group_members(seen["pid"]) == []


def _events(run_dir: Path) -> list[dict[str, Any]]:
    return [
        json.loads(line)
        for path in sorted((run_dir / "events").glob("*.jsonl"))
        for line in path.read_text().splitlines()
    ]
