"""Policy losses and loss aggregations: the functions ``services/common/algorithms.py`` declares in
``POLICY_LOSSES`` (``algorithm.policy_loss``) and ``LOSS_AGGREGATIONS`` (``algorithm.loss_aggregation``).

A loss sees per-token tensors of one micro-batch and returns ``sum(weights *
token_loss)``. The weights carry the aggregation over the *whole* rollout
batch (a token mean divides by the batch's token count, not the micro-batch's),
so the gradients accumulated over micro-batches equal the full-batch gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from services.common.algorithms import LOSS_AGGREGATIONS
from services.common.config import AlgorithmConfig


@dataclass(frozen=True, slots=True)
class PolicyLossInputs:
    """Per-token tensors, all ``[batch, tokens]`` and aligned."""

    logprobs: torch.Tensor
    """log p of each token under the policy being trained (carries the gradient)."""
    behaviour_logprobs: torch.Tensor
    """log p of each token under the weights that sampled it."""
    advantages: torch.Tensor
    mask: torch.Tensor
    """bool: the tokens that count (response tokens with loss_mask true)."""
    weights: torch.Tensor
    """Aggregation weight of each token; zero off the mask."""


@dataclass(frozen=True, slots=True)
class PolicyLossOutput:
    loss: torch.Tensor
    """Scalar: the weighted sum of the token losses."""
    clip_fraction: float
    """Share of masked tokens whose clipped term was the active one."""
    approx_kl: float
    """Mean k3 estimate of KL(behaviour || policy) over masked tokens: (r - 1) - log r."""
    tokens: int
    """Masked tokens seen, to combine the means of several micro-batches."""


PolicyLossFn = Callable[[PolicyLossInputs, AlgorithmConfig], PolicyLossOutput]


def ppo_clip(inputs: PolicyLossInputs, algorithm: AlgorithmConfig) -> PolicyLossOutput:
    """PPO's clipped surrogate, with clip-higher (clip_low != clip_high) and optional dual-clip."""
    mask = inputs.mask
    # Padding may hold anything; zero its log-ratio so exp() cannot overflow into the sum.
    log_ratio = torch.where(mask, inputs.logprobs - inputs.behaviour_logprobs, 0.0)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1.0 - algorithm.clip_low, 1.0 + algorithm.clip_high)
    unclipped_loss = -ratio * inputs.advantages
    clipped_loss = -clipped * inputs.advantages
    token_loss = torch.maximum(unclipped_loss, clipped_loss)
    if algorithm.dual_clip is not None:
        # Dual-clip: on negative advantages the loss is capped at -c * A, however large the ratio.
        capped = torch.minimum(token_loss, -algorithm.dual_clip * inputs.advantages)
        token_loss = torch.where(inputs.advantages < 0, capped, token_loss)
    loss = (token_loss * torch.where(mask, inputs.weights, 0.0)).sum()
    with torch.no_grad():
        tokens = int(mask.sum())
        clip_active = (clipped_loss > unclipped_loss) & mask
        kl = torch.where(mask, (ratio - 1.0) - log_ratio, 0.0)
        clip_fraction = float(clip_active.sum()) / tokens if tokens else 0.0
        approx_kl = float(kl.sum()) / tokens if tokens else 0.0
    return PolicyLossOutput(loss=loss, clip_fraction=clip_fraction, approx_kl=approx_kl, tokens=tokens)


def gspo(inputs: PolicyLossInputs, algorithm: AlgorithmConfig) -> PolicyLossOutput:
    """GSPO (Zheng et al. 2025) with algorithm.gspo.clip_low/high (by default the paper's
    ranges); ``gspo_token`` has the formula."""
    return gspo_token(inputs, algorithm.gspo.clip_low, algorithm.gspo.clip_high)


def gspo_token(inputs: PolicyLossInputs, clip_low: float, clip_high: float) -> PolicyLossOutput:
    """GSPO in its GSPO-token form (Zheng et al. 2025, "Group Sequence Policy Optimization").

    Sequence ratio s_i = exp(mean_t(logp_new - logp_old)) over the sample's masked tokens; token
    ratio s_it = sg[s_i] * pi(y_it) / sg[pi(y_it)], equal to s_i in value, with gradient
    s_i * grad log pi(y_it); token loss -min(s_it A_it, clip(s_it, 1 - low, 1 + high) A_it).
    With one advantage per sample and per-sample weights, the weighted sum equals, in value and
    gradient, the sequence-level objective sum_i W_i * -min(s_i A_i, clip(s_i) A_i), W_i the
    sample's total weight: ``sequence_mean`` aggregation gives the paper's 1/G sum_i. No dual-clip.
    """
    mask = inputs.mask
    log_ratio = torch.where(mask, inputs.logprobs - inputs.behaviour_logprobs, 0.0)
    counts = mask.sum(dim=1, keepdim=True)
    seq_log_ratio = log_ratio.sum(dim=1, keepdim=True) / counts.clamp(min=1)
    logprobs = torch.where(mask, inputs.logprobs, 0.0)
    token_log_ratio = seq_log_ratio.detach() + logprobs - logprobs.detach()
    ratio = torch.exp(token_log_ratio)
    unclipped_loss = -ratio * inputs.advantages
    clipped_loss = -torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * inputs.advantages
    token_loss = torch.maximum(unclipped_loss, clipped_loss)
    loss = (token_loss * torch.where(mask, inputs.weights, 0.0)).sum()
    with torch.no_grad():
        tokens = int(mask.sum())
        clip_active = (clipped_loss > unclipped_loss) & mask
        kl = torch.where(mask, torch.expm1(log_ratio) - log_ratio, 0.0)
        clip_fraction = float(clip_active.sum()) / tokens if tokens else 0.0
        approx_kl = float(kl.sum()) / tokens if tokens else 0.0
    return PolicyLossOutput(loss=loss, clip_fraction=clip_fraction, approx_kl=approx_kl, tokens=tokens)


@dataclass(frozen=True, slots=True)
class ValueLossInputs:
    """Per-token tensors, all ``[batch, tokens]`` and aligned."""

    values: torch.Tensor
    """The critic's current predictions (carry the gradient)."""
    old_values: torch.Tensor
    """The critic's predictions when the advantages were computed."""
    returns: torch.Tensor
    """Targets: advantages.TokenAdvantages.returns."""
    mask: torch.Tensor
    """bool: the tokens that count."""
    weights: torch.Tensor
    """Aggregation weight of each token, as for the policy loss."""


@dataclass(frozen=True, slots=True)
class ValueLossOutput:
    loss: torch.Tensor
    """Scalar: the weighted sum of the token losses."""
    clip_fraction: float
    """Share of masked tokens whose clipped error was the larger."""
    tokens: int


def value_loss(inputs: ValueLossInputs, clip_range: float | None) -> ValueLossOutput:
    """PPO's clipped value loss (Schulman et al. 2017; OpenAI baselines ppo2): per token
    0.5 * max((V - R)^2, (V_old + clip(V - V_old, -eps_v, eps_v) - R)^2), weighted and summed
    like the policy loss. ``clip_range`` None: the plain 0.5 (V - R)^2."""
    mask = inputs.mask
    values = torch.where(mask, inputs.values, 0.0)
    returns = torch.where(mask, inputs.returns, 0.0)
    unclipped = (values - returns) ** 2
    if clip_range is None:
        clipped = unclipped
    else:
        old = torch.where(mask, inputs.old_values, 0.0)
        clipped = (old + torch.clamp(values - old, -clip_range, clip_range) - returns) ** 2
    token_loss = 0.5 * torch.maximum(unclipped, clipped)
    loss = (token_loss * torch.where(mask, inputs.weights, 0.0)).sum()
    with torch.no_grad():
        tokens = int(mask.sum())
        active = int(((clipped > unclipped) & mask).sum())
    return ValueLossOutput(loss=loss, clip_fraction=active / tokens if tokens else 0.0, tokens=tokens)


AggregationFn = Callable[[Sequence[int], int], list[float]]
"""(loss tokens per sample, the response budget) -> each sample's weight per loss token."""


def sample_token_weights(loss_tokens: Sequence[int], aggregation: str, constant: int) -> list[float]:
    """The weight of each loss token of each sample, so that the weighted sum of token
    losses over the rollout batch is its aggregated loss (``aggregation``, a ``LOSS_AGGREGATIONS``
    name). ``loss_tokens``: loss-mask tokens per sample; ``constant``: the response budget."""
    fn: AggregationFn = LOSS_AGGREGATIONS.get(aggregation).fn
    return fn(loss_tokens, constant) if loss_tokens else []


def token_mean(loss_tokens: Sequence[int], constant: int) -> list[float]:
    """1 / all tokens of the batch (``constant`` unused)."""
    total = sum(loss_tokens)
    return [1.0 / total if total else 0.0] * len(loss_tokens)


def sequence_mean(loss_tokens: Sequence[int], constant: int) -> list[float]:
    """1 / (samples * the sample's tokens): each sample's mean, then the mean over samples."""
    count = len(loss_tokens)
    return [1.0 / (count * tokens) if tokens else 0.0 for tokens in loss_tokens]


def constant_normaliser(loss_tokens: Sequence[int], constant: int) -> list[float]:
    """Dr. GRPO's 1 / (samples * constant), with ``constant`` the response budget."""
    if constant < 1:
        raise ValueError("the constant of loss_aggregation 'constant' must be >= 1")
    return [1.0 / (len(loss_tokens) * constant)] * len(loss_tokens)
