"""A rollout batch made ready to optimise: everything fixed before the first optimiser step.

For the groups of one step (blocking; run in a thread):

1. old logprobs: the trainer's log p of every response token under the current
   weights (PPO's old policy, the proximal policy of decoupled PPO: the ratio's
   denominator in every epoch). With one optimiser pass (``ppo_epochs`` and
   ``mini_batches`` 1, and no ``kl_in_reward``, which needs them before the pass) the
   training forward runs exactly these weights, so this forward is skipped: the
   objective takes the old logprobs, and the behaviour weights of step 3, from the
   training forward's own logprobs, detached (``objective.ProximalFromForward``), as TRL
   does with one iteration; the same forward reports the engine/trainer mismatch
   (``objective.StepStats.mismatch_kl``);
2. reference logprobs (``kl_coef > 0``) and the critic's values (an estimator that ``needs_critic``);
3. the behaviour importance weight of each token (here, unless step 1 left them to the
   training forward) (``algorithm.off_policy_correction``,
   ``algorithms.OFF_POLICY_CORRECTIONS``): from r = p_old / p_behaviour, decoupled
   PPO's r where r <= decoupled.cap (else 0), TIS's min(r, tis.cap), or none;
4. advantages per token (``get_token_advantage``, for every estimator; the outcome
   ones broadcast their per-sample value); with ``kl_in_reward`` the KL penalty is
   each token's reward; an estimator's advantages are whitened over the batch when it
   declares ``whiten`` (GAE);
5. staleness: each sample's lag (trainer version - its oldest token's version)
   beyond ``max_staleness`` drops it or scales its loss weight (``stale_policy``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from services.common.algorithms import (
    ADVANTAGE_ESTIMATORS,
    OFF_POLICY_CORRECTIONS,
    STALE_POLICIES,
    OffPolicyCorrection,
)
from services.common.config import JobSpec
from services.common.pb import common_pb2
from services.trainer.advantages import (
    TokenAdvantageInputs,
    TokenAdvantages,
    get_token_advantage,
    whiten,
)
from services.trainer.batching import TrainSample, response_mask, response_matrix, unpad
from services.trainer.critic import Critic
from services.trainer.objective import ProximalFromForward
from services.trainer.reference import ReferenceModel
from services.trainer.regularizers import ImportanceWeights, kl_reward_penalty

HISTOGRAM_BUCKETS = 8
"""Staleness histogram: one count per lag 0..7, then one for every larger lag."""


class LogprobSource(Protocol):
    def response_logprobs(self, samples: Sequence[TrainSample]) -> list[list[float]]: ...


@dataclass(frozen=True, slots=True)
class Prepared:
    samples: list[TrainSample]
    """The samples to train on (stale ones dropped under ``drop``)."""
    rewards: list[float]
    """The outcome reward of every sample of the groups, dropped ones included."""
    verifier_rewards: list[float]
    """The reward service's reward of each, before the job's reward shaping (as ``rewards``)."""
    lags: list[int]
    """Each sample's version lag, dropped ones included."""
    stale_dropped: int
    stale_downweighted: int
    mismatch_kl: float | None
    """k3 estimate of KL(behaviour || trainer old), mean over loss tokens; None when the old-logprob
    forward was skipped. The step's metrics report it from the training forward (StepStats)."""
    importance_capped_fraction: float
    """Share of loss tokens whose behaviour weight was above its cap: truncated (TIS) or left out
    (decoupled); 0 without a correction or when the training forward weighs the tokens."""
    proximal: ProximalFromForward | None = None
    """Set when the old-logprob forward was skipped: the training forward gives the old logprobs
    and the behaviour weights this way (and reports the capped share)."""

    @property
    def old_logprobs_skipped(self) -> bool:
        return self.proximal is not None

    def metrics(self) -> dict[str, float]:
        values = {
            "old_logprobs_skipped": float(self.old_logprobs_skipped),
            "stale_samples_dropped": float(self.stale_dropped),
            "stale_downweighted": float(self.stale_downweighted),
            "staleness_max": float(max(self.lags, default=0)),
            "staleness_mean": sum(self.lags) / len(self.lags) if self.lags else 0.0,
        }
        for lag in range(HISTOGRAM_BUCKETS):
            values[f"staleness_lag_{lag}"] = float(self.lags.count(lag))
        if not self.old_logprobs_skipped:  # else the training forward's StepStats has it
            values["importance_capped_fraction"] = self.importance_capped_fraction
        values[f"staleness_lag_{HISTOGRAM_BUCKETS}_plus"] = float(
            sum(1 for lag in self.lags if lag >= HISTOGRAM_BUCKETS)
        )
        return values


def base_samples(groups: Sequence[Sequence[common_pb2.Trajectory]]) -> list[TrainSample]:
    """One sample per trajectory, groups in order, advantages still 0."""
    return [
        TrainSample(
            prompt_token_ids=list(t.prompt_token_ids),
            response_token_ids=list(t.response_token_ids),
            loss_mask=list(t.loss_mask),
            behaviour_logprobs=list(t.behaviour_logprobs),
            advantage=0.0,
        )
        for group in groups
        for t in group
    ]


def version_lags(groups: Sequence[Sequence[common_pb2.Trajectory]], version: int) -> list[int]:
    """trainer version - the oldest policy version of each sample's tokens (0 without tokens)."""
    oldest = [min(t.policy_versions, default=version) for group in groups for t in group]
    return [max(version - first, 0) for first in oldest]


def token_advantages(
    spec: JobSpec,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    old: torch.Tensor,
    ref: list[list[float]] | None,
    values: list[list[float]] | None,
) -> TokenAdvantages:
    """``algorithm.advantage`` per token; with ``kl_in_reward`` each token's reward is
    -kl_coef x KL(old || ref) there (REINFORCE++), computed on the trainer's old logprobs."""
    algorithm = spec.algorithm
    token_rewards = None
    if algorithm.kl_in_reward:
        if ref is None:
            raise ValueError("algorithm.kl_in_reward needs the reference model")
        token_rewards = kl_reward_penalty(
            old, response_matrix(ref), mask, algorithm.kl_estimator, algorithm.kl_coef
        )
    return get_token_advantage(algorithm.advantage)(
        TokenAdvantageInputs(
            rewards=rewards,
            mask=mask,
            token_rewards=token_rewards,
            values=response_matrix(values) if values is not None else None,
            gamma=algorithm.gamma,
            lam=algorithm.gae.lambda_,
        )
    )


def old_from_training_forward(spec: JobSpec) -> bool:
    """Whether the training forward itself gives the old logprobs: one optimiser pass over the
    batch (its first and only forward runs the weights the step began with), and no
    ``kl_in_reward`` (whose rewards need the old logprobs before the pass)."""
    trainer = spec.trainer
    return trainer.ppo_epochs == 1 and trainer.mini_batches == 1 and not spec.algorithm.kl_in_reward


def correction_cap(correction: OffPolicyCorrection, spec: JobSpec) -> float:
    """The cap of the correction's weights: its ``algorithm`` field, else its default."""
    cap = correction.cap_of(spec.algorithm)
    return correction.default_cap if cap is None else float(cap)


def proximal_from_forward(spec: JobSpec) -> ProximalFromForward:
    """How the training forward weighs the tokens when it gives the old logprobs."""
    correction = OFF_POLICY_CORRECTIONS.get(spec.algorithm.off_policy_correction)
    return ProximalFromForward(correction.name, correction_cap(correction, spec))


def prepare(
    groups: Sequence[Sequence[common_pb2.Trajectory]],
    spec: JobSpec,
    version: int,
    policy: LogprobSource,
    reference: ReferenceModel | None = None,
    critic: Critic | None = None,
    *,
    recompute_old: bool = False,
) -> Prepared:
    """The step's samples with old logprobs, advantages and weights (see the module docstring);
    ``recompute_old`` runs the old-logprob forward even where the training forward could
    stand in for it (to compare the two)."""
    algorithm = spec.algorithm
    samples = base_samples(groups)
    if not samples:
        raise ValueError("no samples to prepare")
    rewards = torch.tensor([[t.reward for t in group] for group in groups], dtype=torch.float64)
    lags = version_lags(groups, version)
    staleness = STALE_POLICIES.get(algorithm.stale_policy).fn(
        lags, algorithm.max_staleness, algorithm.downweight.decay
    )
    mask = response_mask(samples)
    skipped = old_from_training_forward(spec) and not recompute_old
    behaviour = response_matrix([s.behaviour_logprobs for s in samples])
    old = None if skipped else policy.response_logprobs(samples)  # None: the training forward's
    old_m = behaviour if old is None else response_matrix(old)  # read only by kl_in_reward then
    ref = reference.response_logprobs(samples) if reference is not None else None
    values = critic.values(samples) if critic is not None else None
    correction = OFF_POLICY_CORRECTIONS.get(algorithm.off_policy_correction)
    weights: ImportanceWeights | None = None
    if not skipped:  # else the objective weighs each token from the training forward
        weights = correction.fn(old_m, behaviour, mask, correction_cap(correction, spec))
    estimated = token_advantages(spec, rewards, mask, old_m, ref, values)
    advantages = estimated.advantages
    if ADVANTAGE_ESTIMATORS.get(algorithm.advantage).whiten:  # PPO's practice for GAE
        advantages = whiten(advantages, mask)
    per_sample = {
        "advantage": unpad(advantages, samples),
        "old_logprobs": old,
        "ref_logprobs": ref,
        "returns": unpad(estimated.returns, samples) if critic is not None else None,
        "old_values": values,
        "is_weights": unpad(weights.weights, samples)
        if weights is not None and correction.reweights
        else None,
        "weight": staleness.weights,
    }
    filled = {name: column for name, column in per_sample.items() if column is not None}
    kept = [
        dataclasses.replace(sample, **{name: column[i] for name, column in filled.items()})
        for i, sample in enumerate(samples)
        if staleness.keep[i]
    ]
    return Prepared(
        samples=kept,
        rewards=rewards.flatten().tolist(),
        verifier_rewards=[t.verifier_reward for group in groups for t in group],
        lags=lags,
        stale_dropped=staleness.dropped,
        stale_downweighted=staleness.downweighted,
        mismatch_kl=weights.mismatch_kl if weights is not None else None,
        importance_capped_fraction=weights.capped_fraction if weights is not None else 0.0,
        proximal=proximal_from_forward(spec) if skipped else None,
    )
