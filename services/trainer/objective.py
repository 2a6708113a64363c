"""The policy's objective on one micro-batch, and the statistics of a rollout batch's optimisation.

The loss of a micro-batch is the sum of its parts, each weighted by the aggregation
weights of the whole optimiser step (so accumulated micro-batches give the
mini-batch gradient):

- the policy loss (``algorithm.policy_loss``) on the ratio to the trainer's *old*
  logprobs (fixed when the step began), each token's loss times its behaviour
  importance weight (``algorithm.off_policy_correction``);
- ``kl_coef`` x the KL estimator to the reference model, unless ``kl_in_reward``
  folded it into the rewards already;
- ``-entropy_coef`` x the policy's entropy.

When the loss is the policy loss alone and that vanishes at a zero advantage, a sample with no
nonzero advantage (a GRPO group whose rewards were all equal) adds exactly nothing to the
gradient: ``samples_with_gradient`` leaves it out of forward and backward (``trainer.
skip_zero_advantage``) while the aggregation weights still count it, so the step's gradient is
the whole batch's. The per-token statistics are then over the samples trained on.

Entropy and KL are measured on every micro-batch (without a gradient when their
coefficient is 0), so they are logged whatever the configuration. So is the
engine/trainer mismatch, KL(behaviour || trainer), from the training forward's own
logprobs: the first optimiser step's forward runs the weights the step began with,
so it measures what the old-logprob forward would have. With one optimiser pass that
forward is skipped altogether (``ProximalFromForward``): the training forward's logprobs,
detached, are the old logprobs (the ratio is 1 in value, its gradient the policy
gradient's), and the behaviour weights are computed from them here.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.common.algorithms import KL_ESTIMATORS, OFF_POLICY_CORRECTIONS, POLICY_LOSSES
from services.common.config import AlgorithmConfig
from services.trainer.batching import MicroBatch, TrainSample, token_logprobs
from services.trainer.critic import CriticStats
from services.trainer.losses import PolicyLossFn, PolicyLossInputs
from services.trainer.regularizers import (
    entropy_bonus,
    k3,
    kl_loss,
    masked_entropy_sum,
    token_entropy,
)


def optimiser_step_plan(count: int, epochs: int, mini_batches: int, seed: int) -> list[list[int]]:
    """Sample indices of each optimiser step: ``epochs`` passes, each split into
    ``mini_batches`` disjoint parts (shuffled per pass when there are several)."""
    rng = random.Random(seed)
    plan: list[list[int]] = []
    for _ in range(epochs):
        order = list(range(count))
        if mini_batches > 1:
            rng.shuffle(order)
        plan.extend(part for k in range(mini_batches) if (part := order[k::mini_batches]))
    return plan


def samples_with_gradient(samples: Sequence[TrainSample], algorithm: AlgorithmConfig) -> list[int]:
    """Indices of the samples whose loss can have a gradient: every sample, unless the objective is
    the policy loss alone (no KL loss, no entropy bonus) and that vanishes at a zero advantage; then
    those with a nonzero advantage, and at least the shortest sample, so that the optimiser still
    steps on the (zero) gradient as it would have."""
    every = list(range(len(samples)))
    kl_loss_on = algorithm.kl_coef > 0 and not algorithm.kl_in_reward
    if kl_loss_on or algorithm.entropy_coef > 0:
        return every
    if not POLICY_LOSSES.get(algorithm.policy_loss).vanishes_at_zero_advantage:
        return every
    kept = [i for i in every if any(a != 0.0 for a in samples[i].token_advantages())]
    if kept or not samples:
        return kept
    return [min(every, key=lambda i: samples[i].length)]


@dataclass(frozen=True, slots=True)
class ProximalFromForward:
    """The old logprobs are the training forward's own (one optimiser pass, prepare.py): the
    behaviour weights come from them with this correction (by name: the other trainer ranks
    receive it pickled) and cap."""

    correction: str
    """An ``OFF_POLICY_CORRECTIONS`` name."""
    cap: float


@dataclass(slots=True)
class Totals:
    """Sums over the micro-batches of one optimiser step; means are token-weighted sums."""

    loss: float = 0.0
    policy_loss: float = 0.0
    kl_loss: float = 0.0
    entropy_loss: float = 0.0
    clipped: float = 0.0
    approx_kl: float = 0.0
    kl: float = 0.0
    entropy: float = 0.0
    mismatch_kl: float = 0.0
    capped: float = 0.0
    """Loss tokens whose behaviour weight was over its cap (ProximalFromForward only)."""
    loss_tokens: int = 0
    tokens: int = 0
    padded_tokens: int = 0
    samples: int = 0
    """Samples of the optimiser step, those left out included."""
    skipped: int = 0
    """Samples left out of forward and backward (``samples_with_gradient``)."""


def _token_sum(values: torch.Tensor, mask: torch.Tensor) -> float:
    return float(torch.where(mask, values.detach().float(), 0.0).sum())


def _ratio_inputs(
    logprobs: torch.Tensor, batch: MicroBatch, proximal: ProximalFromForward | None, totals: Totals
) -> tuple[torch.Tensor, torch.Tensor]:
    """The old logprobs and behaviour weights of the ratio: the batch's, or (``proximal``) those
    of the training forward itself, counting the tokens over the cap in ``totals``."""
    if proximal is None:
        return batch.old_logprobs, batch.is_weights
    old = logprobs.detach()
    correction = OFF_POLICY_CORRECTIONS.get(proximal.correction)
    if not correction.reweights:
        return old, torch.ones_like(old)
    weighed = correction.fn(old, batch.behaviour_logprobs, batch.mask, proximal.cap)
    totals.capped += weighed.capped_fraction * weighed.tokens
    return old, weighed.weights


def micro_batch_loss(
    logits: torch.Tensor,
    batch: MicroBatch,
    algorithm: AlgorithmConfig,
    loss_fn: PolicyLossFn,
    totals: Totals,
    proximal: ProximalFromForward | None = None,
) -> torch.Tensor:
    """The micro-batch's loss (to backpropagate); adds its statistics to ``totals``."""
    logprobs = token_logprobs(logits, batch.input_ids)
    mask = batch.mask
    old, is_weights = _ratio_inputs(logprobs, batch, proximal, totals)
    policy = loss_fn(
        PolicyLossInputs(logprobs, old, batch.advantages, mask, batch.weights * is_weights), algorithm
    )
    loss = policy.loss
    with torch.no_grad():  # k3 with r = p_trainer / p_behaviour, on the tokens behaviour sampled
        totals.mismatch_kl += _token_sum(k3(batch.behaviour_logprobs, logprobs), mask)
    totals.policy_loss += float(policy.loss.detach())
    totals.clipped += policy.clip_fraction * policy.tokens
    totals.approx_kl += policy.approx_kl * policy.tokens
    totals.loss_tokens += policy.tokens
    if algorithm.kl_coef > 0:
        with torch.no_grad():
            per_token = KL_ESTIMATORS.get(algorithm.kl_estimator).fn(logprobs, batch.ref_logprobs)
            totals.kl += _token_sum(per_token, mask)
        if not algorithm.kl_in_reward:
            term = kl_loss(
                logprobs, batch.ref_logprobs, mask, batch.weights, algorithm.kl_estimator, algorithm.kl_coef
            )
            totals.kl_loss += float(term.detach())
            loss = loss + term
    if algorithm.entropy_coef > 0:
        entropy = token_entropy(logits[:, :-1].float())
        totals.entropy += _token_sum(entropy, mask)
        term = entropy_bonus(entropy, mask, batch.weights, algorithm.entropy_coef)
        totals.entropy_loss += float(term.detach())
        loss = loss + term
    else:  # only logged: over the loss tokens alone, without a graph
        totals.entropy += masked_entropy_sum(logits[:, :-1], mask)
    totals.loss += float(loss.detach())
    totals.tokens += batch.tokens
    totals.padded_tokens += batch.padded_tokens
    return loss


@dataclass(frozen=True, slots=True)
class StepStats:
    """What one rollout batch's optimisation did: losses are means over its optimiser steps,
    per-token quantities means over every loss token seen."""

    loss: float
    policy_loss: float
    kl_loss: float
    entropy_loss: float
    clip_fraction: float
    approx_kl: float
    """k3 estimate of KL(old || new) over the tokens: how far the steps moved the policy."""
    kl: float
    """Mean KL estimate (algorithm.kl_estimator) to the reference model; 0 without one."""
    entropy: float
    grad_norm: float
    learning_rate: float
    optimizer_steps: int
    tokens: int
    """Tokens run through forward and backward, prompts included, over all passes."""
    padded_tokens: int
    """Tokens the forward passes computed, padding included."""
    critic_steps: int = 0
    """Optimiser steps of the critic (0 without one)."""
    value_loss: float = 0.0
    value_clip_fraction: float = 0.0
    critic_grad_norm: float = 0.0
    mismatch_kl: float = 0.0
    """k3 estimate of KL(behaviour || trainer) over the first optimiser step's tokens, from its
    forward (the weights before any update): the engine/trainer mismatch, plus the drift of the
    weights since stale tokens were sampled."""
    importance_capped_fraction: float | None = None
    """Share of loss tokens whose behaviour weight was over its cap, when the training forward
    weighed them (ProximalFromForward); None when prepare.py did."""
    zero_advantage_skipped: float = 0.0
    """Share of the samples left out of forward and backward: no nonzero advantage, so no gradient."""

    @property
    def padding_waste(self) -> float:
        """Share of the computed tokens that were padding."""
        return 1.0 - self.tokens / self.padded_tokens if self.padded_tokens else 0.0

    def metrics(self) -> dict[str, float]:
        values = {
            name: float(getattr(self, name))
            for name in (
                "loss", "policy_loss", "kl_loss", "entropy_loss", "clip_fraction", "approx_kl", "kl",
                "entropy", "grad_norm", "learning_rate", "optimizer_steps", "padding_waste", "mismatch_kl",
                "zero_advantage_skipped",
            )
        }  # fmt: skip
        if self.importance_capped_fraction is not None:
            values["importance_capped_fraction"] = self.importance_capped_fraction
        if self.critic_steps:
            values |= {
                "value_loss": self.value_loss,
                "value_clip_fraction": self.value_clip_fraction,
                "critic_grad_norm": self.critic_grad_norm,
            }
        return values


def combine(
    steps: Sequence[tuple[Totals, float]],
    critic: Sequence[CriticStats],
    learning_rate: float,
    proximal: ProximalFromForward | None = None,
) -> StepStats:
    """One StepStats from each optimiser step's totals and grad norm (and the critic's steps);
    ``proximal``: the training forward weighed the tokens."""
    if not steps:
        raise ValueError("no optimiser steps to combine")
    count = len(steps)
    tokens = sum(t.loss_tokens for t, _ in steps) or 1
    first = steps[0][0]
    critic_tokens = sum(c.tokens for c in critic) or 1
    return StepStats(
        loss=sum(t.loss for t, _ in steps) / count,
        policy_loss=sum(t.policy_loss for t, _ in steps) / count,
        kl_loss=sum(t.kl_loss for t, _ in steps) / count,
        entropy_loss=sum(t.entropy_loss for t, _ in steps) / count,
        clip_fraction=sum(t.clipped for t, _ in steps) / tokens,
        approx_kl=sum(t.approx_kl for t, _ in steps) / tokens,
        kl=sum(t.kl for t, _ in steps) / tokens,
        entropy=sum(t.entropy for t, _ in steps) / tokens,
        grad_norm=sum(norm for _, norm in steps) / count,
        learning_rate=learning_rate,
        optimizer_steps=count,
        tokens=sum(t.tokens for t, _ in steps),
        padded_tokens=sum(t.padded_tokens for t, _ in steps),
        critic_steps=len(critic),
        value_loss=sum(c.loss for c in critic) / len(critic) if critic else 0.0,
        value_clip_fraction=sum(c.clip_fraction * c.tokens for c in critic) / critic_tokens,
        critic_grad_norm=sum(c.grad_norm for c in critic) / len(critic) if critic else 0.0,
        mismatch_kl=first.mismatch_kl / first.loss_tokens if first.loss_tokens else 0.0,
        importance_capped_fraction=sum(t.capped for t, _ in steps) / tokens if proximal else None,
        zero_advantage_skipped=sum(t.skipped for t, _ in steps) / max(1, sum(t.samples for t, _ in steps)),
    )
