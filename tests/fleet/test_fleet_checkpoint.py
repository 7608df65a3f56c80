"""Fleets whose model is a checkpoint directory (``[model] checkpoint``) and fleets whose
receivers are the workers of engines (``[[engine]]``): the catalog comes from the checkpoint's
safetensors headers for every role, the fleet file is checked with clear errors, and the
launcher checks engine-hosted ranks by the fingerprint of their stored bits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fleet_helpers import small_fleet

from dcr.adapters.loaders.sharded import ShardedServingLoader
from dcr.apply.applier import Applier
from dcr.apply.proof import receiver_proof
from dcr.errors import CheckpointError, ConfigError
from dcr.fleet.checks import holds_request
from dcr.fleet.config import load_fleet
from dcr.fleet.launcher import Launcher
from dcr.fleet.model import FleetModel
from dcr.models.hf import write_checkpoint
from dcr.tensors.bits import bits

ENGINE = """
[[engine]]
name = "e0"
receivers = ["r1", "r2"]
plain_weights = true
"""


def _checkpoint_fleet(tmp_path: Path, dtype: torch.dtype, *, refits: int = 1) -> Path:
    """A small fleet whose ``[model]`` is a checkpoint of the demo's tiny Llama in ``dtype``,
    with the same trainer, rollout nodes and synthetic run."""
    synthetic = small_fleet(tmp_path / "synthetic", refits=refits)
    model = FleetModel(synthetic)
    state = {n: t.to(dtype) for n, t in model.run.state(0).items()}
    write_checkpoint(tmp_path / "ckpt", model.config, model.family, state, shard_bytes=1 << 18)
    text = synthetic.path.read_text()
    text = text.replace('family = "llama"\nsize_mb = 0\n', 'checkpoint = "../ckpt"\n')
    text = text[: text.index("[model.overrides]")] + text[text.index("[trainer]") :]
    (tmp_path / "fleet").mkdir()
    path = tmp_path / "fleet" / "fleet.toml"
    path.write_text(text)
    return path


def _same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[n].dtype == b[n].dtype and (bits(a[n]) == bits(b[n])).all() for n in a
    )


def test_a_checkpoint_gives_every_role_the_model(tmp_path: Path) -> None:
    """A checkpoint of the synthetic model: the same catalog, plan, XOR set and versions as
    the fleet that describes it by family and config."""
    synthetic = FleetModel(small_fleet(tmp_path / "synthetic", refits=1))
    model = FleetModel(load_fleet(_checkpoint_fleet(tmp_path, torch.bfloat16)))
    assert model.fleet.model.checkpoint == str(tmp_path / "fleet" / ".." / "ckpt")
    assert (model.family, model.synthetic_problem, model.dtype) == ("llama", None, torch.bfloat16)
    assert model.catalog == synthetic.catalog
    assert repr(model.plan.shards) == repr(synthetic.plan.shards)
    assert model.xor_names == synthetic.xor_names and model.xor_names
    assert _same_bits(model.run.state(1), synthetic.run.state(1))


def test_a_float32_checkpoint_trains_and_serves_in_float32(tmp_path: Path) -> None:
    model = FleetModel(load_fleet(_checkpoint_fleet(tmp_path, torch.float32)))
    assert model.dtype == torch.float32
    assert {s.dtype for s in model.catalog.values()} == {torch.float32}
    assert {t.dtype for t in model.run.state(1).values()} == {torch.float32}
    # The sharded ranks store float32 too: the final norm is no longer a cast.
    assert "model.norm.weight" in model.xor_names


def test_a_checkpoint_the_synthetic_trainer_cannot_model(tmp_path: Path) -> None:
    """Another model type, or mixed dtypes: receivers hosted by an engine can take its
    catalog, the synthetic trainer and sharded ranks refuse it, mixed mode XORs nothing."""
    path = _checkpoint_fleet(tmp_path, torch.bfloat16)
    config = tmp_path / "ckpt" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "model_type": "mistral"}))
    model = FleetModel(load_fleet(path))
    assert "'mistral'" in str(model.synthetic_problem)
    assert len(model.catalog) == len(model.plan.catalog) > 0  # replicated whole, no family rules
    assert model.xor_names == frozenset()
    with pytest.raises(ConfigError, match="cannot model the checkpoint") as info:
        model.run  # noqa: B018
    assert info.value.check == "checkpoint"
    config.unlink()
    model = FleetModel(load_fleet(path))
    assert "config.json: no such file" in str(model.synthetic_problem)
    with pytest.raises(CheckpointError, match="no such file"):
        model.plan  # noqa: B018


CONFIG_ERRORS = {
    "checkpoint and family": (
        'checkpoint = "ckpt"\n',
        "leave out \\['family', 'overrides', 'size_mb'\\]",
    ),
    "engine without a model": (ENGINE, "model \\(or \\[model\\] checkpoint\\)"),
    "engine ranks out of order": (
        ENGINE.replace('["r1", "r2"]', '["r2", "r1"]') + '\nmodel = "ckpt"\n',
        "must be declared as ranks 0..1",
    ),
    "engine across nodes": (
        ENGINE.replace('["r1", "r2"]', '["r0"]').replace('name = "e0"', 'name = "e0"\nmodel = "x"')
        + '\n[[engine]]\nname = "e1"\nmodel = "x"\nreceivers = ["r0"]\n',
        "a worker of one engine only",
    ),
    "unknown engine key": (ENGINE + 'model = "x"\ngpus = 2\n', "unknown keys \\['gpus'\\]"),
    "pause mode": (ENGINE + 'model = "x"\npause_mode = "later"\n', "pause_mode must be"),
}


@pytest.mark.parametrize("case", list(CONFIG_ERRORS))
def test_fleet_files_with_checkpoints_and_engines_are_checked(tmp_path: Path, case: str) -> None:
    extra, message = CONFIG_ERRORS[case]
    cfg = small_fleet(tmp_path, refits=1)
    text = cfg.path.read_text()
    if extra.startswith("checkpoint"):
        text = text.replace("[model]\n", "[model]\n" + extra)
    else:
        text += extra
    cfg.path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_fleet(cfg.path)


def test_an_engine_s_receivers_are_its_workers(tmp_path: Path) -> None:
    cfg = small_fleet(tmp_path, refits=1)
    cfg.path.write_text(cfg.path.read_text() + ENGINE + 'model = "ckpt"\nenv = { A = 1 }\n')
    cfg = load_fleet(cfg.path)
    (engine,) = cfg.engines
    assert engine.receivers == ("r1", "r2") and engine.model == str(cfg.path.parent / "ckpt")
    assert engine.env == {"A": "1"} and engine.checkpoint_version is None
    assert cfg.engine_of("r2") == engine and cfg.engine_of("r0") is None
    launcher = Launcher(cfg)
    argv = launcher._engine_argv(engine)
    assert argv[1:3] == ["-m", "dcr.integrations.vllm"]
    joined = " ".join(argv)
    assert "--tp 2" in joined and "--receivers r1,r2" in joined and "--plain-weights" in joined
    assert "--report-fingerprints" in joined and "--stop-with-parent" in joined
    assert launcher._process_of("r1") == "engine-e0" and launcher._process_of("r0") == "r0"


def test_the_fingerprint_check_catches_a_single_flipped_bit(tmp_path: Path) -> None:
    """An engine's ranks are checked together, once each reported its fingerprint of the
    version: shards add up to the canonical tensors' fingerprints; one flipped bit in one
    rank fails the check and names the tensor."""
    cfg = small_fleet(tmp_path, refits=1)
    cfg.path.write_text(cfg.path.read_text() + ENGINE + 'model = "ckpt"\n')
    cfg = load_fleet(cfg.path)
    model = FleetModel(cfg)
    state = model.run.state(1)
    ranks = []
    for rank in (0, 1):
        loader = ShardedServingLoader.dense(
            model.config, model.family, state, tp_size=2, tp_rank=rank
        )
        receiver = Applier(loader, model.catalog)
        receiver.prewarm()
        ranks.append(receiver)

    def report(launcher: Launcher) -> None:
        for name, receiver in zip(("r1", "r2"), ranks, strict=True):
            launcher._check_fingerprint(name, 1, receiver_proof(receiver, holds_request(1)))

    launcher = Launcher(cfg)
    launcher._check_fingerprint("r1", 1, receiver_proof(ranks[0], holds_request(1)))
    assert launcher.rows == {}  # waits for every rank of the engine
    launcher._check_fingerprint("r2", 1, receiver_proof(ranks[1], holds_request(1)))
    assert launcher.mismatches == [] and launcher.rows[1].checks == {"r1": True, "r2": True}
    w = ranks[1].loader.module.get_parameter("model.layers.1.mlp.down_proj.weight")
    bits(w.detach()).reshape(-1)[7] ^= 1
    launcher = Launcher(cfg)
    report(launcher)
    assert launcher.rows[1].checks == {"r1": False, "r2": False}
    assert "down_proj" in launcher.mismatches[0]


@pytest.mark.heavy
def test_a_fleet_trains_and_serves_a_float16_checkpoint_bit_exactly(tmp_path: Path) -> None:
    """Owners and sharded ranks in processes of their own, all with the catalog read from
    a sharded float16 checkpoint: a refit, every receiver checked bit for bit."""
    cfg = load_fleet(_checkpoint_fleet(tmp_path, torch.float16, refits=1))
    report = Launcher(cfg, deadline_s=600).run()
    assert report["bit_exact"] is True, report["mismatches"]
    assert [r["receivers_checked"] for r in report["refits"]] == [["r0", "r1", "r2"]]
    assert report["checkpoint_bytes"] == sum(s.nbytes for s in FleetModel(cfg).catalog.values())
    assert all(s.dtype == torch.float16 for s in FleetModel(cfg).catalog.values())
