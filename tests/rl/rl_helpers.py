"""A seeded torch sampler standing in for the rollout engine, and the spawned trainer runs the
RL tests compare."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch

from dcr.rl.config import RLConfig
from dcr.rl.grpo import Rollouts
from dcr.rl.task import SymbolTask
from dcr.tensors.bits import bits_dtype


def sample_rollouts(model: torch.nn.Module, config: RLConfig, *, seed: int, step: int) -> Rollouts:
    """Step ``step``'s batch sampled from ``model`` (bf16), as an engine would return it: every
    prompt ``group_size`` times, responses of ``response_len`` tokens, the log probability of
    every sampled token, the task's rewards.  A pure function of the weights, seed and step."""
    task = SymbolTask.of(config)
    prompts = task.prompts(seed, step, config.prompts_per_step)
    g = config.group_size
    tokens = torch.tensor([p for p in prompts for _ in range(g)], dtype=torch.int64)
    gen = torch.Generator().manual_seed(task.sampling_seed(seed, step, -1, -1))
    logprobs = []
    with torch.no_grad():
        for _ in range(config.response_len):
            logits = model(input_ids=tokens, use_cache=False).logits[:, -1].float()
            logp = torch.log_softmax(logits / config.temperature, dim=-1)
            nxt = torch.multinomial(logp.exp(), 1, generator=gen)
            logprobs.append(logp.gather(-1, nxt))
            tokens = torch.cat([tokens, nxt], dim=1)
    responses = tokens[:, task.prompt_len :]
    rewards = [task.reward(prompts[i // g], responses[i].tolist()) for i in range(tokens.shape[0])]
    return Rollouts(
        tokens=tokens,
        prompt_len=task.prompt_len,
        behaviour_logprobs=torch.cat(logprobs, dim=1),
        rewards=torch.tensor(rewards, dtype=torch.float32),
        group_size=g,
    )


def digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 of every tensor's name, shape, dtype and stored bits, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous()
        h.update(f"{name}|{list(t.shape)}|{t.dtype}|".encode())
        h.update(t.view(bits_dtype(t.dtype)).numpy().tobytes())
    return h.hexdigest()


def tokens_digest(batch: Rollouts) -> str:
    """SHA-256 of a batch's tokens, behaviour log probabilities and rewards (their bits)."""
    return digest(
        {
            "tokens": batch.tokens,
            "logprobs": batch.behaviour_logprobs,
            "rewards": batch.rewards,
        }
    )
