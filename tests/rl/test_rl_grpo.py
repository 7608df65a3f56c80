"""The GRPO objective against a hand computation: advantages, the PPO clip in both directions,
the k3 KL, the token mean and its gradient."""

from __future__ import annotations

import math

import pytest
import torch

from dcr.errors import ConfigError
from dcr.rl.grpo import (
    Rollouts,
    group_advantages,
    grpo_loss,
    grpo_token_terms,
    k3_kl,
    token_logprobs,
)

LN = math.log
A = 1 / math.sqrt(2)  # (1 - 0.5) / sample std of {1, 0} (= sqrt(0.5))


def test_group_advantages_by_hand() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.25, 0.5, 0.75])
    with pytest.raises(ConfigError):
        group_advantages(rewards, 2, eps=0.0)  # 7 rewards are no groups of 2
    adv = group_advantages(rewards[:6], 2, eps=0.0)
    assert adv[:2].tolist() == pytest.approx([A, -A])
    adv = group_advantages(rewards[:4], 2, eps=1e-6)
    assert adv.tolist() == pytest.approx(
        [0.5 / (math.sqrt(0.5) + 1e-6), -0.5 / (math.sqrt(0.5) + 1e-6), 0, 0]
    )
    # A group of three: mean 0.5, sample std 0.25.
    three = group_advantages(torch.tensor([0.25, 0.5, 0.75]), 3, eps=0.0)
    assert three.tolist() == pytest.approx([-1.0, 0.0, 1.0])


def test_k3_kl_by_hand() -> None:
    logp = torch.tensor([LN(0.5), -1.0, -2.0])
    ref = torch.tensor([LN(0.5) + 0.1, -1.0, -2.5])
    expected = [math.exp(0.1) - 0.1 - 1, 0.0, math.exp(-0.5) + 0.5 - 1]
    assert k3_kl(logp, ref).tolist() == pytest.approx(expected, abs=1e-7)
    assert (k3_kl(torch.randn(100), torch.randn(100)) >= 0).all()


def test_token_logprobs_by_hand() -> None:
    logits = torch.tensor([[[0.0, LN(3.0)], [LN(2.0), LN(2.0)]]], dtype=torch.bfloat16)
    tokens = torch.tensor([[1, 0]])
    assert token_logprobs(logits, tokens).tolist()[0] == pytest.approx(
        [LN(0.75), LN(0.5)],
        abs=1e-2,  # bf16 logits
    )
    assert token_logprobs(logits, tokens).dtype == torch.float32


def test_the_objective_by_hand() -> None:
    # Two groups of two, two tokens each; clip 0.2, beta 0.05.  Group 1: rewards 1 and 0
    # (advantages +A, -A); group 2: rewards 0.5 and 0.5 (advantage 0).
    clip, beta = 0.2, 0.05
    logp = torch.tensor(
        [[LN(0.5), LN(0.25)], [LN(0.5), LN(0.1)], [-1.0, -2.0], [-0.5, -0.3]], requires_grad=True
    )
    behaviour = torch.tensor([[LN(0.4), LN(0.25)], [LN(0.5), LN(0.2)], [-1.0, -2.0], [-0.5, -0.3]])
    ref = torch.tensor(
        [[LN(0.5) + 0.1, LN(0.25)], [LN(0.5), LN(0.1) - 0.2], [-1.0, -2.0], [-0.5, -0.3]]
    )
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.5, 0.5]), 2, eps=1e-6)
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    # Ratios: row 0 (1.25, 1), row 1 (1, 0.5); rows 2 and 3: 1.
    # Row 0, token 0: A > 0, ratio 1.25 > 1.2: the clipped branch, -1.2 * a.
    # Row 1, token 1: A < 0, ratio 0.5 < 0.8: the clipped branch, -(0.8 * -a) = 0.8 * a.
    pg = [[-1.2 * a, -a], [a, 0.8 * a], [0.0, 0.0], [0.0, 0.0]]
    kl = [[math.exp(0.1) - 1.1, 0.0], [0.0, math.exp(-0.2) + 0.2 - 1], [0.0, 0.0], [0.0, 0.0]]
    terms = grpo_token_terms(logp, behaviour, ref, adv, clip_eps=clip, beta=beta)
    assert terms.pg.tolist() == [pytest.approx(r, abs=1e-6) for r in pg]
    assert terms.kl.tolist() == [pytest.approx(r, abs=1e-7) for r in kl]
    assert terms.clipped.tolist() == [[1.0, 0.0], [0.0, 1.0], [0.0, 0.0], [0.0, 0.0]]
    expected = sum(pg[b][t] + beta * kl[b][t] for b in range(4) for t in range(2)) / 8
    loss = grpo_loss(logp, behaviour, ref, adv, clip_eps=clip, beta=beta)
    assert loss.item() == pytest.approx(expected, abs=1e-7)

    # Gradient: clipped tokens get none from the policy term; unclipped ones -ratio * A; the
    # k3 term gives beta * (1 - exp(ref - logp)); everything over the 8 tokens.
    loss.backward()
    assert logp.grad is not None
    grad = [
        [0.0 + beta * (1 - math.exp(0.1)), -1.0 * a],
        [-1.0 * -a, 0.0 + beta * (1 - math.exp(-0.2))],
        [0.0, 0.0],
        [0.0, 0.0],
    ]
    assert (logp.grad * 8).tolist() == [pytest.approx(r, abs=1e-6) for r in grad]


def test_rollouts_build_and_check() -> None:
    batch = Rollouts.build(
        [[0, 2, 1], [0, 3, 1]],
        [[2, 2], [3, 2], [3, 3], [2, 3]],
        [[-0.1, -0.2], [-0.3, -0.4], [-0.5, -0.6], [-0.7, -0.8]],
        [1.0, 0.5, 0.0, 0.5],
        group_size=2,
    )
    assert batch.tokens.tolist()[1] == [0, 2, 1, 3, 2]
    assert batch.tokens.tolist()[2] == [0, 3, 1, 3, 3]
    assert (batch.size, batch.prompt_len, batch.response_len) == (4, 3, 2)
    assert batch.responses.tolist() == [[2, 2], [3, 2], [3, 3], [2, 3]]
    assert batch.behaviour_logprobs.dtype == torch.float32
    with pytest.raises(ConfigError):  # three responses are no whole groups of two
        Rollouts.build(
            [[0, 2, 1], [0, 3, 1]], [[2, 2]] * 3, [[0.0, 0.0]] * 3, [0.0] * 3, group_size=2
        )
    with pytest.raises(ConfigError):  # ragged responses
        Rollouts.build([[0, 2, 1]], [[2, 2], [2]], [[0.0, 0.0], [0.0]], [0.0, 0.0], group_size=2)
    with pytest.raises(ConfigError):  # logprobs of the wrong shape
        Rollouts(
            tokens=batch.tokens,
            prompt_len=3,
            behaviour_logprobs=torch.zeros(4, 3),
            rewards=batch.rewards,
            group_size=2,
        )
