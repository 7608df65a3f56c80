"""An engine that joins claiming the committed version is fingerprinted before it takes part.

vLLM serves a checkpoint of version 0 in which three elements of
``model.layers.0.mlp.up_proj.weight`` are one ULP off (a slightly wrong export, a stale shard).
It joins the fleet with ``checkpoint_version = 0``, the committed version, so it restores
nothing.  The first transition fingerprints every receiver completely, whatever it claims:
the engine's rank is disproved, restored by dense refit and takes version 1, and every one of
its stored bits then equals version 1 (the launcher checks the fingerprint of its storage).
The seeded sample of the proof alone would not see three elements.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import OVERRIDES
from test_vllm_catalog import ENGINE, _fleet_file

from dcr.fleet.config import load_fleet
from dcr.fleet.launcher import Launcher
from dcr.fleet.model import sized_config
from dcr.models.hf import write_checkpoint
from dcr.models.synthetic import SyntheticRun
from dcr.tensors.bits import bits

pytestmark = pytest.mark.vllm

FAMILY = "qwen3"
SEED, RATE = 3, 0.05
OFF = "model.layers.0.mlp.up_proj.weight"


def _events(run_dir: Path) -> list[dict[str, Any]]:
    return [
        json.loads(line)
        for path in sorted((run_dir / "events").glob("*.jsonl"))
        for line in path.read_text().splitlines()
    ]


def test_an_engine_joining_with_a_slightly_wrong_checkpoint_is_disproved_and_restored(
    tmp_path: Path,
) -> None:
    config = sized_config(FAMILY, 0, **OVERRIDES[FAMILY])
    run = SyntheticRun(config=config, family=FAMILY, seed=SEED, rate=RATE)
    state = run.state(0)
    good = write_checkpoint(tmp_path / "v0", config, FAMILY, state)
    wrong = {name: t.clone() for name, t in state.items()}
    flat = bits(wrong[OFF]).reshape(-1)
    positions = [7, flat.size // 2, flat.size - 3]
    flat[positions] += 1  # one ULP each: the next representable value
    assert int((bits(wrong[OFF]) != bits(state[OFF])).sum()) == 3
    served = write_checkpoint(tmp_path / "v0-wrong", config, FAMILY, wrong)
    # The fleet's catalog and trainer are version 0 as it should be; the engine serves the
    # wrong export and claims version 0.
    engine = ENGINE.replace("plain_weights = true", f'plain_weights = true\nmodel = "{served}"')
    cfg = load_fleet(_fleet_file(tmp_path / "fleet", good, engine=engine))
    assert cfg.proof is not None and not cfg.proof.fingerprint_each_commit
    report = Launcher(cfg, deadline_s=900).run()
    assert report["bit_exact"] is True, report["mismatches"]
    (row,) = report["refits"]
    assert row["receivers_checked"] == ["r0"] and row["disproved"] == ["r0"]
    events = _events(cfg.run_dir)
    first = [e for e in events if e["event"] == "proved" and e["base"] == 0]
    assert first and first[0]["fingerprinted"] > 0 and first[0]["failed"] == ["r0"]
    reasons = [e["reasons"] for e in events if e["event"] == "disproved"]
    assert reasons and "fingerprint" in json.dumps(reasons) and OFF in json.dumps(reasons)
    restored = [(e["receiver"], e["version"]) for e in events if e["event"] == "restored"]
    assert ("r0", 0) in restored
