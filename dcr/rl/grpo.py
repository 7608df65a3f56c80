"""The GRPO objective on a batch of rollouts, as pure torch functions.

A step's batch holds ``G`` completions of each of ``N`` prompts (group-major: completions
``i * G .. i * G + G - 1`` answer prompt ``i``), each completion's reward, and the log
probability the rollout engine reported for every sampled token (the *behaviour* policy).  The
objective, per response token ``t`` of completion ``b``::

    A_b    = (r_b - mean_group(r)) / (std_group(r) + adv_eps)     group-normalised advantage
    ratio  = exp(logp_bt - behaviour_bt)                           current / behaviour policy
    pg     = -min(ratio * A_b, clip(ratio, 1 - clip_eps, 1 + clip_eps) * A_b)
    kl     = exp(ref_bt - logp_bt) - (ref_bt - logp_bt) - 1        k3 estimate of KL(pi || ref)
    loss   = mean over every response token of (pg + beta * kl)

``std_group`` is the sample standard deviation (Bessel's correction, as TRL and verl use); a
group whose rewards are all equal gets advantage 0 and contributes only its KL term.  The
ratio is taken against the engine's log probabilities, not against a second forward pass of
the trainer, so the clip also bounds the (small) numerical gap between the engine's and the
trainer's kernels.  Everything is computed in fp32 from the model's bf16 logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dcr.errors import ConfigError

__all__ = [
    "Rollouts",
    "TokenTerms",
    "grpo_loss",
    "grpo_token_terms",
    "group_advantages",
    "k3_kl",
    "token_logprobs",
]


@dataclass(frozen=True, kw_only=True, eq=False)
class Rollouts:
    """One step's batch: ``B = n_prompts * group_size`` sequences of equal length.

    ``tokens`` is ``[B, prompt_len + T]`` (int64): each prompt followed by its sampled
    response of ``T`` tokens; ``behaviour_logprobs`` is ``[B, T]`` (fp32), the engine's log
    probability of every sampled token; ``rewards`` is ``[B]`` (fp32).  Rows are group-major.
    """

    tokens: torch.Tensor
    prompt_len: int
    behaviour_logprobs: torch.Tensor
    rewards: torch.Tensor
    group_size: int

    def __post_init__(self) -> None:
        if self.tokens.dim() != 2 or self.tokens.dtype != torch.int64:
            raise ConfigError("tokens must be a 2-D int64 tensor", check="rollouts")
        b, length = self.tokens.shape
        t = length - self.prompt_len
        if self.prompt_len < 1 or t < 1:
            raise ConfigError("every sequence needs a prompt and a response", check="rollouts")
        if self.group_size < 2 or b % self.group_size:
            raise ConfigError(
                f"{b} sequences are no whole number of groups of {self.group_size}",
                check="rollouts",
            )
        if tuple(self.behaviour_logprobs.shape) != (b, t):
            raise ConfigError(
                f"behaviour_logprobs is {list(self.behaviour_logprobs.shape)}, expected {[b, t]}",
                check="rollouts",
            )
        if tuple(self.rewards.shape) != (b,):
            raise ConfigError(f"rewards must have shape [{b}]", check="rollouts")
        if self.behaviour_logprobs.dtype != torch.float32 or self.rewards.dtype != torch.float32:
            raise ConfigError("logprobs and rewards must be float32", check="rollouts")

    @classmethod
    def build(
        cls,
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        logprobs: Sequence[Sequence[float]],
        rewards: Sequence[float],
        *,
        group_size: int,
    ) -> Rollouts:
        """The batch of ``len(prompts)`` groups: ``responses[i * group_size + j]`` (with its
        per-token ``logprobs`` and its reward) is completion ``j`` of ``prompts[i]``."""
        if len(responses) != len(prompts) * group_size:
            raise ConfigError(
                f"{len(responses)} responses for {len(prompts)} prompts x {group_size}",
                check="rollouts",
            )
        rows = [[*prompts[i // group_size], *response] for i, response in enumerate(responses)]
        if len({len(p) for p in prompts}) != 1 or len({len(r) for r in rows}) != 1:
            raise ConfigError("prompts and responses must each have one length", check="rollouts")
        return cls(
            tokens=torch.tensor(rows, dtype=torch.int64),
            prompt_len=len(prompts[0]),
            behaviour_logprobs=torch.tensor([list(x) for x in logprobs], dtype=torch.float32),
            rewards=torch.tensor(list(rewards), dtype=torch.float32),
            group_size=group_size,
        )

    @property
    def size(self) -> int:
        """Sequences in the batch."""
        return int(self.tokens.shape[0])

    @property
    def response_len(self) -> int:
        """Response tokens of every sequence."""
        return int(self.tokens.shape[1]) - self.prompt_len

    @property
    def responses(self) -> torch.Tensor:
        """``[B, T]``: the sampled tokens."""
        return self.tokens[:, self.prompt_len :]


def group_advantages(rewards: torch.Tensor, group_size: int, *, eps: float) -> torch.Tensor:
    """``(r - group mean) / (group sample std + eps)`` for group-major ``rewards`` ``[B]``
    (fp32 result, shape ``[B]``)."""
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ConfigError(
            f"{list(rewards.shape)} rewards are no whole number of groups of {group_size}",
            check="rollouts",
        )
    r = rewards.to(torch.float32).reshape(-1, group_size)
    mean = r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, keepdim=True, correction=1)
    return ((r - mean) / (std + eps)).reshape(-1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits)`` at ``tokens``: logits ``[B, T, V]`` (any float dtype, taken to
    fp32 first), tokens ``[B, T]``; result ``[B, T]`` fp32."""
    logp = torch.log_softmax(logits.to(torch.float32), dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """The k3 estimator of ``KL(pi || ref)`` per sampled token: ``exp(d) - d - 1`` with
    ``d = ref_logprobs - logprobs``; non-negative, zero where the two agree."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1


@dataclass(frozen=True, kw_only=True, eq=False)
class TokenTerms:
    """Per-token terms of the objective, each ``[B, T]`` fp32: ``loss = pg + beta * kl``;
    ``clipped`` is 1 where the clipped branch of the PPO objective is the active one."""

    loss: torch.Tensor
    pg: torch.Tensor
    kl: torch.Tensor
    clipped: torch.Tensor


def grpo_token_terms(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_eps: float,
    beta: float,
) -> TokenTerms:
    """The objective's per-token terms (see the module docstring).

    ``logprobs`` ``[B, T]`` carry the gradient; ``behaviour_logprobs`` and ``ref_logprobs``
    ``[B, T]`` and ``advantages`` ``[B]`` are constants.
    """
    adv = advantages.to(torch.float32).unsqueeze(-1)
    ratio = torch.exp(logprobs - behaviour_logprobs)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
    pg = -torch.minimum(unclipped, clipped)
    kl = k3_kl(logprobs, ref_logprobs)
    return TokenTerms(
        loss=pg + beta * kl,
        pg=pg,
        kl=kl,
        clipped=(clipped < unclipped).to(torch.float32),
    )


def grpo_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_eps: float,
    beta: float,
) -> torch.Tensor:
    """The objective, averaged over every token of the batch (a scalar with gradient)."""
    terms = grpo_token_terms(
        logprobs, behaviour_logprobs, ref_logprobs, advantages, clip_eps=clip_eps, beta=beta
    )
    return terms.loss.mean()
