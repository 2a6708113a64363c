"""Advantage estimators: the functions ``services/common/algorithms.py`` declares, with their
traits, in ``ADVANTAGE_ESTIMATORS`` by the name a JobSpec uses (``algorithm.advantage``).

Two kinds. An *outcome* estimator (``get_advantage``: grpo, dr_grpo, rloo) takes
the rewards of a rollout batch as a ``[groups, group_size]`` tensor (the samples
of one prompt in a row) and returns one advantage per sample, the same shape;
every token of a response gets its sample's advantage. A *token* estimator
(``get_token_advantage``: reinforce_pp, reinforce_pp_baseline, gae) sees
per-token tensors (``TokenAdvantageInputs``) and returns an advantage and a
return per token; ``get_token_advantage`` also serves every outcome estimator,
broadcast over the tokens, so a caller can use one path for all of them.

The steps of a token estimator are the action tokens (the mask): tokens off the
mask (padding, tool output between turns) are skipped, neither discounted nor
credited, and get 0. A sample's outcome reward is credited at its last action token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch

from services.common.algorithms import ADVANTAGE_ESTIMATORS

AdvantageFn = Callable[[torch.Tensor], torch.Tensor]

EPS = 1e-6
"""Keeps a group whose rewards are all equal from dividing by zero (its advantages are 0)."""


def get_advantage(name: str) -> AdvantageFn:
    """The outcome estimator registered as ``name``; ValueError naming the available ones otherwise."""
    estimator = ADVANTAGE_ESTIMATORS.get(name)
    if estimator.token_level:
        raise ValueError(
            f"{ADVANTAGE_ESTIMATORS.field} {name!r} is a token-level estimator: it needs get_token_advantage"
        )
    return cast(AdvantageFn, estimator.fn)


def _check(rewards: torch.Tensor) -> None:
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be [groups, group_size >= 2], got {tuple(rewards.shape)}")


def grpo(rewards: torch.Tensor) -> torch.Tensor:
    """GRPO: (r - group mean) / (group std + eps), with the unbiased (n - 1) std."""
    _check(rewards)
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, correction=1)
    return (rewards - mean) / (std + EPS)


def dr_grpo(rewards: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO: r - group mean; no division by the std, which favours easy and hard prompts."""
    _check(rewards)
    return rewards - rewards.mean(dim=1, keepdim=True)


def rloo(rewards: torch.Tensor) -> torch.Tensor:
    """RLOO: r minus the mean reward of the other samples of the group."""
    _check(rewards)
    n = rewards.shape[1]
    others_mean = (rewards.sum(dim=1, keepdim=True) - rewards) / (n - 1)
    return rewards - others_mean


# --- token-level estimators -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TokenAdvantageInputs:
    """What a token estimator sees. Sample b is row b // group_size, column b % group_size of rewards."""

    rewards: torch.Tensor
    """[groups, group_size]: the outcome reward of each sample."""
    mask: torch.Tensor
    """[groups * group_size, tokens] bool: the action tokens (response tokens with loss_mask true)."""
    token_rewards: torch.Tensor | None = None
    """[samples, tokens]: extra reward per token, e.g. regularizers.kl_reward_penalty; read on the mask."""
    values: torch.Tensor | None = None
    """[samples, tokens]: the critic's value of the state before each token (GAE needs it)."""
    gamma: float = 1.0
    """Discount per action token."""
    lam: float = 1.0
    """GAE's lambda (bias/variance trade-off; 1 gives returns minus values)."""


@dataclass(frozen=True, slots=True)
class TokenAdvantages:
    advantages: torch.Tensor
    """[samples, tokens]: 0 off the mask."""
    returns: torch.Tensor
    """[samples, tokens]: the discounted return of each action token (the critic's target); 0 off the mask."""


TokenAdvantageFn = Callable[[TokenAdvantageInputs], TokenAdvantages]


def get_token_advantage(name: str) -> TokenAdvantageFn:
    """The token estimator ``name``, or the outcome estimator ``name`` broadcast over the tokens."""
    estimator = ADVANTAGE_ESTIMATORS.get(name)
    if estimator.token_level:
        return cast(TokenAdvantageFn, estimator.fn)
    outcome = cast(AdvantageFn, estimator.fn)

    def broadcast(inputs: TokenAdvantageInputs) -> TokenAdvantages:
        if inputs.token_rewards is not None or inputs.values is not None:
            raise ValueError(f"the outcome estimator {name!r} takes no token rewards or values")
        mask = _checked_mask(inputs)
        per_sample = outcome(inputs.rewards).reshape(-1, 1)
        zero = torch.zeros((), dtype=per_sample.dtype)
        return TokenAdvantages(
            advantages=torch.where(mask, per_sample, zero),
            returns=torch.where(mask, inputs.rewards.reshape(-1, 1), zero),
        )

    return broadcast


def _checked_mask(inputs: TokenAdvantageInputs) -> torch.Tensor:
    samples = inputs.rewards.numel()
    if inputs.rewards.dim() != 2 or inputs.mask.dim() != 2 or inputs.mask.shape[0] != samples:
        raise ValueError(
            f"rewards [groups, group_size] and mask [groups * group_size, tokens] do not match: "
            f"{tuple(inputs.rewards.shape)} and {tuple(inputs.mask.shape)}"
        )
    for name in ("token_rewards", "values"):
        tensor = getattr(inputs, name)
        if tensor is not None and tensor.shape != inputs.mask.shape:
            raise ValueError(f"{name} must have the mask's shape {tuple(inputs.mask.shape)}")
    return inputs.mask.bool()


def step_rewards(inputs: TokenAdvantageInputs, outcome: torch.Tensor) -> torch.Tensor:
    """r_t = token_rewards_t + [t is the sample's last action token] * outcome_b, 0 off the mask.

    ``outcome``: [samples], the reward credited at the end (the outcome reward, or
    it minus a baseline). A sample with no action token gets nothing.
    """
    mask = _checked_mask(inputs)
    columns = torch.arange(mask.shape[1]).expand_as(mask)
    last = torch.where(mask, columns, -1).amax(dim=1, keepdim=True)
    rewards = torch.where(columns == last, outcome.reshape(-1, 1).to(inputs.rewards.dtype), 0.0)
    if inputs.token_rewards is not None:
        rewards = rewards + inputs.token_rewards
    return torch.where(mask, rewards, 0.0)


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_t' over the action tokens, t' the next action token (0 after the last)."""
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in range(rewards.shape[1] - 1, -1, -1):
        # Off the mask the running return passes through unchanged: the token is not a step.
        running = torch.where(mask[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(mask[:, t], running, 0.0)
    return returns


def whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(x - mean) / (std + eps) over the masked entries of the whole batch (population std); 0 off it."""
    count = mask.sum().clamp(min=1)
    mean = torch.where(mask, values, 0.0).sum() / count
    var = torch.where(mask, (values - mean) ** 2, 0.0).sum() / count
    return torch.where(mask, (values - mean) / (var.sqrt() + EPS), 0.0)


def reinforce_pp(inputs: TokenAdvantageInputs) -> TokenAdvantages:
    """REINFORCE++ (Hu 2025): r_t = 1[t = end] * r(x, y) + token_rewards_t (the KL penalty
    -beta * KL_t, when given); G_t = sum_{i >= t} gamma^(i - t) r_i; A = (G - mean G) / std G
    over every action token of the batch (the global-batch normalisation that replaces a critic).
    """
    mask = _checked_mask(inputs)
    returns = discounted_returns(step_rewards(inputs, inputs.rewards.flatten()), mask, inputs.gamma)
    return TokenAdvantages(advantages=whiten(returns, mask), returns=returns)


def reinforce_pp_baseline(inputs: TokenAdvantageInputs) -> TokenAdvantages:
    """REINFORCE++-baseline (Hu 2025): REINFORCE++ with r(x, y) - mean of its group as the outcome
    reward; then discounted returns and normalisation over the batch as in ``reinforce_pp``.
    """
    _check(inputs.rewards)
    mask = _checked_mask(inputs)
    centred = inputs.rewards - inputs.rewards.mean(dim=1, keepdim=True)
    returns = discounted_returns(step_rewards(inputs, centred.flatten()), mask, inputs.gamma)
    return TokenAdvantages(advantages=whiten(returns, mask), returns=returns)


def gae(inputs: TokenAdvantageInputs) -> TokenAdvantages:
    """GAE (Schulman et al. 2016): delta_t = r_t + gamma V_t' - V_t, A_t = delta_t + gamma lambda A_t',
    t' the next action token (V = A = 0 after the last: the episode ends); returns R_t = A_t + V_t.
    Rewards as in ``reinforce_pp`` (``step_rewards``). Not normalised: a caller may whiten the advantages.
    """
    if inputs.values is None:
        raise ValueError("gae needs the critic's values")
    mask = _checked_mask(inputs)
    rewards = step_rewards(inputs, inputs.rewards.flatten())
    values = torch.where(mask, inputs.values, 0.0)
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])
    running = torch.zeros_like(rewards[:, 0])
    for t in range(rewards.shape[1] - 1, -1, -1):
        step = mask[:, t]
        delta = rewards[:, t] + inputs.gamma * next_value - values[:, t]
        running = torch.where(step, delta + inputs.gamma * inputs.lam * running, running)
        next_value = torch.where(step, values[:, t], next_value)
        advantages[:, t] = torch.where(step, running, 0.0)
    return TokenAdvantages(advantages=advantages, returns=torch.where(mask, advantages + values, 0.0))
