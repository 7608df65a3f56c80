"""The trainer side of a GRPO RL loop whose rollout engines dcr refits after every step.

- :mod:`dcr.rl.config`: :class:`~dcr.rl.config.RLConfig`, every hyperparameter in one place;
- :mod:`dcr.rl.task`: :class:`~dcr.rl.task.SymbolTask`, a verifiable symbol task (sort, copy,
  reverse) with partial-credit rewards; prompts and sampling seeds are pure functions of
  ``(seed, step)``;
- :mod:`dcr.rl.policy`: the Qwen3 policy, its seeded initial Hugging Face checkpoint
  (:func:`~dcr.rl.policy.write_initial_checkpoint`) and models built from checkpoints;
- :mod:`dcr.rl.grpo`: the GRPO objective (group advantages, PPO clip against the engine's
  log probabilities, k3 KL to the reference) as pure torch functions;
- :mod:`dcr.rl.trainer`: :class:`~dcr.rl.trainer.FsdpPolicy`, one FSDP2 trainer rank (fp32
  masters, bf16 compute), bit-deterministic, with the dcr source of its served shards, a
  dense checkpoint export and an atomic, resumable saved state.

Pure training math and state: no engine, fleet or transport code.  ``transformers`` and
``safetensors`` are imported only when a function that needs them runs.
"""

from __future__ import annotations

from dcr.rl.config import RLConfig
from dcr.rl.grpo import Rollouts
from dcr.rl.task import SymbolTask

__all__ = ["RLConfig", "Rollouts", "SymbolTask"]
