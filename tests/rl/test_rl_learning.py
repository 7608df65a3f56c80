"""A short RL run on the symbol task: the mean reward rises within 20 steps.

Two gloo ranks train a 2-layer Qwen3 policy from a random initialisation; each step's batch is
sampled by the seeded torch sampler from the weights the trainer serves.  Measured on seeds
0-5 with this config, the mean reward of the last five steps exceeds that of the first five
by 0.10 to 0.19 (about 0.21 -> 0.31-0.41); the test asserts a margin of 0.05.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch
from rl_helpers import sample_rollouts

from dcr.rl.config import RLConfig
from dcr.rl.policy import load_model, write_initial_checkpoint
from dcr.rl.trainer import FsdpPolicy
from dcr.testing.trainer import spawn

STEPS = 20
# A 0.5 M-parameter model and a learning rate ten times the default: a quick, steep climb.
CONFIG = RLConfig(num_layers=2, hidden_size=128, intermediate_size=384, lr=3e-4)


def _learn(rank: int, world: int, checkpoint: str, seed: int) -> dict[str, Any]:
    policy = FsdpPolicy(checkpoint, CONFIG)
    rewards, kls = [], []
    for step in range(STEPS):
        sampler = load_model(
            checkpoint, dtype=torch.bfloat16, state_dict=policy.served_state_dict()
        )
        metrics = policy.step(sample_rollouts(sampler, CONFIG, seed=seed, step=step))
        rewards.append(metrics.reward)
        kls.append(metrics.kl)
    return {"rewards": rewards, "kl": kls}


def test_reward_rises_within_twenty_steps(tmp_path: Path) -> None:
    seed = 0
    checkpoint = write_initial_checkpoint(tmp_path / "v0", seed=seed, config=CONFIG)
    result = spawn(_learn, 2, str(checkpoint), seed)
    rewards = result[0]["rewards"]
    assert result[1]["rewards"] == rewards
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"rewards {[round(r, 3) for r in rewards]}: first five {first:.3f}, last five {last:.3f}")
    assert last > first + 0.05
