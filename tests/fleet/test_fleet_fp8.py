"""A fleet whose receivers serve FP8 (``[model] rollout_dtype = "fp8"``): the trainer's owners
send only the re-quantized tiles that changed, every role is SIGKILLed mid-refit once, and
every receiver -- serving TP 1 and 2 -- holds exactly a dense load of the FP8 export of each
version."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fleet_helpers import alive, small_fleet

from dcr.errors import ConfigError
from dcr.fleet.config import FleetConfig, load_fleet
from dcr.fleet.faults import Fault, default_faults
from dcr.fleet.launcher import Launcher
from dcr.fleet.model import FleetModel
from dcr.tensors.fp8 import FP8_DTYPE, Fp8Scheme


def _fp8(cfg: FleetConfig, block: int | str) -> FleetConfig:
    path = cfg.path
    text = path.read_text()
    model = "[model]\n"
    block_text = f'"{block}"' if isinstance(block, str) else str(block)
    path.write_text(
        text.replace(model, f'{model}rollout_dtype = "fp8"\nfp8_block = {block_text}\n', 1)
    )
    return load_fleet(path)


def test_an_fp8_fleet_recovers_every_sigkill_bit_exactly(tmp_path: Path) -> None:
    cfg = _fp8(small_fleet(tmp_path, refits=4), 32)
    model = FleetModel(cfg)
    assert cfg.model.fp8 == Fp8Scheme(32)
    fp8 = {n for n, s in model.wire_catalog.items() if s.dtype == FP8_DTYPE}
    assert fp8 == set(model.plan.quantized) and len(model.wire_catalog) == len(model.catalog) + len(
        fp8
    )
    faults = default_faults(cfg)
    launcher = Launcher(cfg, faults=faults, deadline_s=600)
    report = launcher.run()
    assert report["bit_exact"] is True, report["mismatches"]
    rows = report["refits"]
    assert [r["version"] for r in rows] == [1, 2, 3, 4]
    assert all(r["receivers_checked"] == ["r0", "r1", "r2"] and r["bit_exact"] for r in rows)
    killed = {k["process"].split("-")[0] for k in report["sigkills"]}
    assert {"r1", "o1", "coordinator"} <= killed
    pids = [p.popen.pid for p in launcher.procs.values() if p.popen is not None]
    assert pids and not [pid for pid in pids if alive(pid)]


def test_fp8_settings_are_checked(tmp_path: Path) -> None:
    cfg = small_fleet(tmp_path, refits=1)
    text = cfg.path.read_text()
    for bad, match in (('rollout_dtype = "int4"', "rollout_dtype"), ("fp8_block = 0", "fp8_block"),
                       ('fp8_block = "rows"', "fp8_block")):  # fmt: skip
        cfg.path.write_text(text.replace("[model]\n", f"[model]\n{bad}\n", 1))
        with pytest.raises(ConfigError, match=match):
            load_fleet(cfg.path)
    # The trainer's TP 2 splits o_proj and down_proj by columns: their rows' channel scales
    # are shared by the two ranks holding each row's halves.
    cfg.path.write_text(text)
    channel = FleetModel(_fp8(load_fleet(cfg.path), "channel")).plan
    shared = set(channel.fp8_shared_tiles().offsets)
    assert shared and all(n.endswith(("o_proj.weight", "down_proj.weight")) for n in shared)


def test_preloaded_fp8_receivers_are_fingerprinted_and_a_flipped_fp8_bit_is_restored(
    tmp_path: Path,
) -> None:
    """FP8 receivers that start holding the export of version 0 (``[model] preloaded``) claim
    the record without a dense refit; r0 flips one stored bit of a float8 projection weight
    right after loading.  The owners' proof covers their committed FP8 values and scales: the
    first transition disproves r0 alone, restores it by a dense FP8 refit, and every receiver
    ends bit-exact.  Per-channel scales: the trainer's TP 2 splits the row-parallel weights'
    rows, whose shared scales the owner processes agree on by an all-reduce at staging."""
    cfg = _fp8(small_fleet(tmp_path, refits=2), "channel")
    text = cfg.path.read_text().replace("refits = 2\n", "refits = 2\npreloaded = true\n", 1)
    cfg.path.write_text(text)
    cfg = load_fleet(cfg.path)
    assert cfg.model.preloaded and cfg.model.fp8 == Fp8Scheme(None)
    launcher = Launcher(cfg, faults=[Fault(version=0, target="r0", after="flip")], deadline_s=600)
    report = launcher.run()
    assert report["bit_exact"] is True, report["mismatches"]
    assert [r["disproved"] for r in report["refits"]] == [["r0"], []]
    events = [
        json.loads(line)
        for path in sorted((cfg.run_dir / "events").glob("*.jsonl"))
        for line in path.read_text().splitlines()
    ]
    (flipped,) = [e for e in events if e["event"] == "flipped"]
    assert flipped["who"] == "r0" and "proj" in flipped["tensor"]
    restored = [e["receiver"] for e in events if e["event"] == "restored" and e["version"] == 0]
    assert restored == ["r0"]
