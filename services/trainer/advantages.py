"""Advantage estimators, registered by the name a JobSpec uses (``algorithm.advantage``).

Each takes the rewards of a rollout batch as a ``[groups, group_size]`` tensor
(the samples of one prompt in a row) and returns one advantage per sample, the
same shape. Every token of a response gets its sample's advantage.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

AdvantageFn = Callable[[torch.Tensor], torch.Tensor]

EPS = 1e-6
"""Keeps a group whose rewards are all equal from dividing by zero (its advantages are 0)."""

_ADVANTAGES: dict[str, AdvantageFn] = {}


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Make an estimator available as ``algorithm.advantage: <name>``."""

    def add(fn: AdvantageFn) -> AdvantageFn:
        if name in _ADVANTAGES:
            raise ValueError(f"advantage estimator {name!r} is registered twice")
        _ADVANTAGES[name] = fn
        return fn

    return add


def get_advantage(name: str) -> AdvantageFn:
    """The estimator registered as ``name``; ValueError naming the available ones otherwise."""
    try:
        return _ADVANTAGES[name]
    except KeyError:
        raise ValueError(
            f"algorithm.advantage {name!r} is not available in this trainer (available: {available()})"
        ) from None


def available() -> str:
    return ", ".join(sorted(_ADVANTAGES))


def _check(rewards: torch.Tensor) -> None:
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be [groups, group_size >= 2], got {tuple(rewards.shape)}")


@register_advantage("grpo")
def grpo(rewards: torch.Tensor) -> torch.Tensor:
    """GRPO: (r - group mean) / (group std + eps), with the unbiased (n - 1) std."""
    _check(rewards)
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, correction=1)
    return (rewards - mean) / (std + EPS)


@register_advantage("dr_grpo")
def dr_grpo(rewards: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO: r - group mean; no division by the std, which favours easy and hard prompts."""
    _check(rewards)
    return rewards - rewards.mean(dim=1, keepdim=True)


@register_advantage("rloo")
def rloo(rewards: torch.Tensor) -> torch.Tensor:
    """RLOO: r minus the mean reward of the other samples of the group."""
    _check(rewards)
    n = rewards.shape[1]
    others_mean = (rewards.sum(dim=1, keepdim=True) - rewards) / (n - 1)
    return rewards - others_mean
