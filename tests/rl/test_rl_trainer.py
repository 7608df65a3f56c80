"""The FSDP2 GRPO trainer in two gloo processes: bit-determinism, resume, served weights,
delta refits.

Every run samples its batches with the seeded torch sampler of ``rl_helpers`` from the weights
the trainer serves, so a run is a pure function of the initial checkpoint, the config and the
seed: two runs must agree bit for bit on the served weights, the sampled tokens and the metric
floats after every step, and a run stopped after step 2 and resumed in fresh processes from
its saved state must agree with both on step 3.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch
import torch.distributed as dist
from rl_helpers import digest, sample_rollouts, tokens_digest

from dcr.adapters.loaders.torch_module import TorchModuleLoader
from dcr.apply.applier import Applier
from dcr.delta.mapping import Direct, SubTensor
from dcr.errors import CheckpointError
from dcr.models.modules import module_from_state_dict
from dcr.rl.config import RLConfig
from dcr.rl.files import read_safetensors, write_safetensors
from dcr.rl.policy import load_model, read_weights, write_initial_checkpoint
from dcr.rl.trainer import FsdpPolicy
from dcr.testing.trainer import apply_payloads, build_payloads, spawn

SEED = 11
STEPS = 3
# Uneven FSDP splits over two ranks: 7 vocabulary rows (4 + 3), 97 MLP rows (49 + 48).
SMALL = RLConfig(
    symbols=5,
    prompt_symbols=4,
    hidden_size=64,
    intermediate_size=97,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=32,
    prompts_per_step=4,
    group_size=4,
    lr=1e-3,
)


def _assemble(source: Any, shared: Path, world: int) -> dict[str, torch.Tensor]:
    """The canonical tensors put together from every rank's FsdpSource shards (as files)."""
    shards: dict[str, torch.Tensor] = {}
    for r in range(world):
        shards.update(read_safetensors(shared / f"shards-rank{r}.safetensors")[0])
    out = {name: torch.empty(spec.shape, dtype=spec.dtype) for name, spec in source.catalog.items()}
    for spec in source.plan.shards:
        m = spec.mapping
        value = shards[spec.key]
        if isinstance(m, SubTensor):
            box = tuple(slice(o, o + n) for o, n in zip(m.offset, m.shape, strict=True))
            out[m.name][box] = value
        else:
            assert isinstance(m, Direct)
            out[m.name][...] = value
    return out


class _DeltaRefit:
    """A receiver on rank 0 that gets nothing but each step's delta payloads, built by every
    rank's owner from its own FsdpSource shards."""

    def __init__(self, policy: FsdpPolicy, source: Any, shared: Path) -> None:
        self.policy, self.source, self.shared = policy, source, shared
        self.group = source.training_group()
        module = module_from_state_dict(policy.served_state_dict())
        self.receiver = Applier(TorchModuleLoader(module), source.catalog)
        self.receiver.prewarm()  # on every rank: every owner needs the same XOR set

    def refit(self, step: int) -> bool:
        """Refit the receiver to the trainer's weights after ``step``; whether it then holds
        exactly the served weights."""
        self.group.stage(self.source.candidate_shards())
        payloads, _ = build_payloads(
            self.group, attempt=step, xor_allowed=self.receiver.xor_allowed()
        )
        folder = self.shared / f"payloads-{step}"
        folder.mkdir(parents=True, exist_ok=True)
        for i, data in enumerate(payloads):
            (folder / f"rank{dist.get_rank()}-{i}.bin").write_bytes(data)
        dist.barrier()
        served = self.policy.served_state_dict()
        exact = True
        if dist.get_rank() == 0:
            received = [f.read_bytes() for f in sorted(folder.iterdir())]
            apply_payloads([self.receiver], self.source.catalog, received)
            held = dict(self.receiver.loader.module.named_parameters())
            exact = digest(held) == digest(served)
        self.group.commit()
        dist.barrier()
        return exact


def _refusals(policy: FsdpPolicy, checkpoint: str, saved: str, shared: Path) -> list[str]:
    """Loads that every rank must refuse, leaving the trainer as it was: no state, a rank's
    file missing, a trainer of another config."""
    before = digest(policy.served_state_dict())
    broken = shared / "broken"
    if dist.get_rank() == 0:
        shutil.copytree(saved, broken)
        (broken / "v00000002" / "rank00001-of-00002.safetensors").unlink()
    dist.barrier()
    other = FsdpPolicy(checkpoint, dataclasses.replace(SMALL, lr=2e-3))
    messages = []
    for trainer, directory in ((policy, shared / "nothing"), (policy, broken), (other, saved)):
        with pytest.raises(CheckpointError) as info:
            trainer.load(directory)
        messages.append(str(info.value))
    assert digest(policy.served_state_dict()) == before
    return messages


def _train(
    rank: int,
    world: int,
    checkpoint: str,
    shared: str,
    resume: str | None = None,
    save: str | None = None,
    check_served: bool = False,
) -> dict[str, Any]:
    """Train up to step ``STEPS`` (from the saved state in ``resume`` if given); save after
    steps 1 and 2 into ``save``; with ``check_served``, also compare the forward the trainer
    runs with the bf16 model of its served weights and export and assemble the served
    weights at the end."""
    policy = FsdpPolicy(checkpoint, SMALL)
    source = policy.source()
    out: dict[str, Any] = {"metrics": [], "served": [], "batches": [], "forward": [], "delta": []}
    refit = _DeltaRefit(policy, source, Path(shared)) if check_served else None
    start = 0
    if resume is not None:
        out["refused"] = _refusals(policy, checkpoint, resume, Path(shared))
        start = policy.load(resume)
        out["resumed_at"] = start
    out["served"].append(digest(policy.served_state_dict()))
    for step in range(start, STEPS):
        served = policy.served_state_dict()
        sampler = load_model(checkpoint, dtype=torch.bfloat16, state_dict=served)
        batch = sample_rollouts(sampler, SMALL, seed=SEED, step=step)
        out["batches"].append(tokens_digest(batch))
        if check_served:
            rows = policy.rows(batch.size)
            x = batch.tokens[rows.start : rows.stop]
            with torch.no_grad():
                trained = policy.model(input_ids=x, use_cache=False).logits
                served_logits = sampler(input_ids=x, use_cache=False).logits
            out["forward"].append(
                torch.equal(trained.view(torch.int16), served_logits.view(torch.int16))
            )
        metrics = policy.step(batch)
        out["metrics"].append({k: float(v).hex() for k, v in metrics.as_dict().items()})
        out["served"].append(digest(policy.served_state_dict()))
        if refit is not None:
            out["delta"].append(refit.refit(metrics.step))
        if save is not None and metrics.step in (1, 2):
            policy.save(save, version=metrics.step)
    if check_served:
        exported = policy.export_checkpoint(Path(shared, "export"))
        write_safetensors(Path(shared, f"shards-rank{rank}.safetensors"), source.candidate_shards())
        dist.barrier()
        if rank == 0:
            from_shards = _assemble(source, Path(shared), world)
            from_file = read_weights(exported)
            out["export_names"] = sorted(from_file)
            out["export_vs_shards"] = digest(from_file) == digest(from_shards)
            out["export_vs_served"] = digest(from_file) == out["served"][-1]
            out["export_dtypes"] = sorted({str(t.dtype) for t in from_file.values()})
            out["catalog"] = sorted(source.catalog)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run A (saves after steps 1 and 2, checks the served weights), run B (the same again)
    and run C (resumes A's saved state in fresh processes), each over two ranks."""
    root = tmp_path_factory.mktemp("rl-trainer")
    checkpoint = str(write_initial_checkpoint(root / "v0", seed=SEED, config=SMALL))
    state = str(root / "state")
    first = spawn(_train, 2, checkpoint, str(root / "a"), None, state, True)
    second = spawn(_train, 2, checkpoint, str(root / "b"))
    resumed = spawn(_train, 2, checkpoint, str(root / "c"), state)
    return {"first": first, "second": second, "resumed": resumed, "state": state}


def test_two_runs_are_bit_identical(runs: dict[str, Any]) -> None:
    first, second = runs["first"], runs["second"]
    assert len(first[0]["metrics"]) == STEPS
    for rank in (0, 1):
        # Served weights after every step, the sampled batches, every metric float.
        assert first[rank]["served"] == second[rank]["served"]
        assert first[rank]["batches"] == second[rank]["batches"]
        assert first[rank]["metrics"] == second[rank]["metrics"]
    # Every rank reports the same metrics and serves the same weights.
    assert first[0]["metrics"] == first[1]["metrics"]
    assert first[0]["served"] == first[1]["served"]
    # The policy moved at every step.
    assert len(set(first[0]["served"])) == STEPS + 1


def test_first_step_kl_is_zero_and_later_steps_move_away(
    runs: dict[str, Any],
) -> None:
    kl = [float.fromhex(m["kl"]) for m in runs["first"][0]["metrics"]]
    assert kl[0] == 0.0  # the reference and the policy run the same bf16 forward at step 1
    assert all(k > 0 for k in kl[1:])


def test_resumed_run_continues_bit_for_bit(runs: dict[str, Any]) -> None:
    first, resumed = runs["first"], runs["resumed"]
    for rank in (0, 1):
        assert resumed[rank]["resumed_at"] == 2
        assert resumed[rank]["served"] == first[rank]["served"][2:]
        assert resumed[rank]["batches"] == first[rank]["batches"][2:]
        assert resumed[rank]["metrics"] == first[rank]["metrics"][2:]
    refused = [r["refused"] for r in resumed]
    assert all("no readable LATEST" in m for m in (refused[0][0], refused[1][0]))
    assert "failed on rank(s) [1]" in refused[0][1] and "no file" in refused[1][1]
    assert all("another config" in r[2] for r in refused)
    state = Path(runs["state"])
    assert sorted(p.name for p in state.iterdir()) == ["LATEST", "v00000002"]
    files = sorted((state / "v00000002").iterdir())
    assert [f.name for f in files] == [
        "rank00000-of-00002.safetensors",
        "rank00001-of-00002.safetensors",
    ]
    tensors, metadata = read_safetensors(files[0])
    assert metadata["version"] == "2" and metadata["steps"] == "2"
    assert {k.split("/")[0] for k in tensors} == {"param", "exp_avg", "exp_avg_sq", "step"}
    assert {t.dtype for k, t in tensors.items() if not k.startswith("step/")} == {torch.float32}


def test_export_equals_the_served_shards(runs: dict[str, Any]) -> None:
    head = runs["first"][0]
    assert head["export_vs_shards"] is True
    assert head["export_vs_served"] is True
    assert head["export_dtypes"] == ["torch.bfloat16"]
    assert head["catalog"] == head["export_names"]
    assert "lm_head.weight" in head["catalog"] and "model.embed_tokens.weight" in head["catalog"]


def test_delta_refits_give_a_receiver_the_served_weights(runs: dict[str, Any]) -> None:
    assert runs["first"][0]["delta"] == [True] * STEPS


def test_the_trainer_forward_runs_on_the_served_weights(
    runs: dict[str, Any],
) -> None:
    for rank in (0, 1):
        assert runs["first"][rank]["forward"] == [True] * STEPS
