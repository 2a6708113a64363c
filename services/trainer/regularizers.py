"""Regularisers around the policy loss: KL estimators (``algorithm.kl_estimator``), the entropy of
the policy, the behaviour importance weights of the off-policy corrections
(``algorithm.off_policy_correction``), and staleness weights (``algorithm.stale_policy``). Each is
a small function of per-token tensors; ``services/common/algorithms.py`` declares the named ones,
with their traits, in ``KL_ESTIMATORS``, ``OFF_POLICY_CORRECTIONS`` and ``STALE_POLICIES``.

KL direction: the tokens were sampled from the policy pi, and the estimators
estimate KL(pi || pi_ref) = E_{x ~ pi}[log pi(x) - log pi_ref(x)] from them,
with the ratio r = pi_ref(x) / pi(x), so log r = logp_ref - logp.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from services.common.algorithms import KL_ESTIMATORS

KLEstimatorFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k1 = -log r = logp - logp_ref (Schulman, "Approximating KL divergence", 2020): unbiased,
    high variance, negative on some tokens."""
    return logprobs - ref_logprobs


def k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k2 = 0.5 (log r)^2 (Schulman 2020): biased, low variance, never negative."""
    return 0.5 * (ref_logprobs - logprobs) ** 2


def k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 = (r - 1) - log r (Schulman 2020): unbiased, low variance, never negative."""
    log_r = ref_logprobs - logprobs
    return torch.expm1(log_r) - log_r


def _masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # where(), not a product: padding may hold inf or nan.
    return torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))


def kl_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor,
    estimator: str,
    coef: float,
) -> torch.Tensor:
    """KL as a loss term: coef * sum(weights * k(logp, logp_ref)) over the mask; ``weights`` are
    the aggregation weights of the policy loss (losses.sample_token_weights), so it aggregates
    the same way. The gradient flows through ``logprobs``."""
    per_token = KL_ESTIMATORS.get(estimator).fn(_masked(logprobs, mask), _masked(ref_logprobs, mask))
    return coef * (_masked(per_token, mask) * _masked(weights, mask)).sum()


@torch.no_grad()
def kl_reward_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, estimator: str, coef: float
) -> torch.Tensor:
    """KL folded into the reward: -coef * k(logp, logp_ref) per token, 0 off the mask, no gradient.
    ``logprobs`` are those of the policy that sampled (REINFORCE++ uses k1); pass the result as
    ``advantages.TokenAdvantageInputs.token_rewards``."""
    per_token = KL_ESTIMATORS.get(estimator).fn(_masked(logprobs, mask), _masked(ref_logprobs, mask))
    return _masked(-coef * per_token, mask)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """H = -sum_v p_v log p_v = logsumexp(z) - sum_v p_v z_v per position: [..., vocab] -> [...].
    Both terms come from the max-shifted logits, so large logits neither overflow nor cancel."""
    shifted = logits - logits.amax(dim=-1, keepdim=True).detach()
    log_z = torch.logsumexp(shifted, dim=-1)
    probs = torch.softmax(shifted, dim=-1)
    return log_z - (probs * shifted).sum(dim=-1)


ENTROPY_CHUNK_ELEMENTS = 1 << 18
"""Logits per chunk of ``masked_entropy_sum`` (1 MiB of float32): per vocabulary size the best
measured of 32 rows, 2^15-2^19 elements (99 tokens: 2.4 -> 0.37 ms for 1,226 positions against 32
rows; 1,000: 6.5 -> 2.9 ms; 49,152: no slower than 32 rows)."""


@torch.no_grad()
def masked_entropy_sum(
    logits: torch.Tensor, mask: torch.Tensor, chunk_elements: int = ENTROPY_CHUNK_ELEMENTS
) -> float:
    """The sum of ``token_entropy`` over the positions of ``mask`` (logits ``[..., vocab]``, mask
    ``[...]``), without a graph, about ``chunk_elements`` logits at a time: each chunk stays in
    cache (with a large vocabulary about 5x faster than one pass over them all), and a small
    vocabulary takes few chunks (each costs a few tensor calls). For logging the entropy."""
    rows = max(1, chunk_elements // max(1, logits.shape[-1]))
    where = mask.nonzero(as_tuple=True)
    total = torch.zeros((), dtype=torch.promote_types(logits.dtype, torch.float32), device=logits.device)
    for start in range(0, int(where[0].numel()), rows):
        chunk = logits[tuple(index[start : start + rows] for index in where)].to(total.dtype)  # bf16 up
        log_p = torch.log_softmax(chunk, dim=-1)
        total -= (log_p.exp() * log_p).sum()
    return float(total)  # one device sync, not one per chunk


def entropy_bonus(
    entropy: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor, coef: float
) -> torch.Tensor:
    """Entropy as a loss term: -coef * sum(weights * H) over the mask (minimising it raises H)."""
    return -coef * (_masked(entropy, mask) * _masked(weights, mask)).sum()


@dataclass(frozen=True, slots=True)
class ImportanceWeights:
    weights: torch.Tensor
    """Per token: the behaviour importance weight of its policy loss, no gradient; 0 off the mask."""
    mismatch_kl: float
    """k3 estimate of KL(behaviour || trainer), the mean over masked tokens: r - 1 - log r,
    r = p_trainer / p_behaviour (the engine sampled the tokens)."""
    capped_fraction: float
    """Share of masked tokens whose ratio was above the cap (truncated or dropped)."""
    tokens: int
    """Masked tokens, to combine means of several micro-batches."""


BehaviourWeightFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], ImportanceWeights]
"""(trainer logprobs, behaviour logprobs, mask, cap) -> the behaviour weight of each token."""


def _behaviour_ratio(
    trainer_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor, cap: float
) -> tuple[torch.Tensor, int, float]:
    """(r = p_trainer / p_behaviour per token, masked tokens, mean k3 of KL(behaviour || trainer))."""
    if cap <= 0:
        raise ValueError("the importance weight cap must be > 0")
    log_ratio = _masked(trainer_logprobs - behaviour_logprobs, mask)
    tokens = int(mask.sum())
    kl = _masked(torch.expm1(log_ratio) - log_ratio, mask)
    return torch.exp(log_ratio), tokens, float(kl.sum()) / tokens if tokens else 0.0


def _fraction(selected: torch.Tensor, tokens: int) -> float:
    return float(selected.sum()) / tokens if tokens else 0.0


@torch.no_grad()
def unit_importance_weights(
    trainer_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor, cap: float
) -> ImportanceWeights:
    """No correction: every weight 1 (``cap`` unused); the mismatch is still measured."""
    _, tokens, kl = _behaviour_ratio(trainer_logprobs, behaviour_logprobs, mask, cap)
    return ImportanceWeights(weights=mask.to(trainer_logprobs.dtype), mismatch_kl=kl, capped_fraction=0.0,
                             tokens=tokens)  # fmt: skip


@torch.no_grad()
def truncated_importance_weights(
    trainer_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor, cap: float
) -> ImportanceWeights:
    """Truncated importance sampling (TIS; Yao et al. 2025, "Your Efficient RL Framework Secretly
    Brings You Off-Policy RL Training"; verl's ``tis_imp_ratio_cap``) for the engine/trainer
    mismatch: the engine's logprobs differ from the trainer's for the same weights (kernels,
    precision), so a token's loss is reweighted by w = min(pi_trainer_old / pi_behaviour, cap),
    treated as a constant."""
    ratio, tokens, kl = _behaviour_ratio(trainer_logprobs, behaviour_logprobs, mask, cap)
    return ImportanceWeights(
        weights=_masked(torch.clamp(ratio, max=cap), mask),
        mismatch_kl=kl,
        capped_fraction=_fraction(mask & (ratio > cap), tokens),
        tokens=tokens,
    )


@torch.no_grad()
def decoupled_importance_weights(
    trainer_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor, cap: float
) -> ImportanceWeights:
    """The behaviour weight of decoupled PPO (Hilton et al. 2022, "Batch size-invariance for policy
    optimization"; as AReaL trains asynchronously: Fu et al. 2025, "AReaL: A Large-Scale
    Asynchronous Reinforcement Learning System for Language Reasoning", ``ppo_actor_loss_fn``).

    Three policies: pi_behav sampled the token (its logprobs came with it), pi_prox is the
    proximal policy (the trainer's weights when the step began: the recomputed old logprobs),
    pi_theta is being trained. The token loss is

        w * max(-r A, -clip(r, 1 - eps_low, 1 + eps_high) A),  r = pi_theta / pi_prox,
        w = pi_prox / pi_behav  if pi_prox / pi_behav <= cap, else 0  (a constant),

    so the clip bounds each step around pi_prox, however stale pi_behav, and w corrects the
    expectation from pi_behav's samples to pi_prox's; a token whose w exceeds the cap is dropped
    from the loss (AReaL's ``behav_imp_weight_cap``), not truncated. This function gives w; the
    policy loss multiplies its token losses by it. With on-policy tokens (pi_behav = pi_prox) every
    w is 1 and the loss is plain PPO's."""
    ratio, tokens, kl = _behaviour_ratio(trainer_logprobs, behaviour_logprobs, mask, cap)
    kept = mask & (ratio <= cap)
    return ImportanceWeights(
        weights=_masked(ratio, kept), mismatch_kl=kl, capped_fraction=_fraction(mask & ~kept, tokens),
        tokens=tokens,
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class StalenessWeights:
    weights: list[float]
    """Per sample: 1 within max_staleness; beyond, 0 (drop) or decay ** (lag - max_staleness)."""
    keep: list[bool]
    """Per sample: whether it is trained on at all."""
    fresh: int
    """Samples whose lag is within max_staleness."""
    dropped: int
    downweighted: int


StalenessFn = Callable[[Sequence[int], int, float], StalenessWeights]
"""(version lags, max_staleness, decay) -> each sample's weight and whether it is kept."""


def _stale(lags: Sequence[int], max_staleness: int) -> list[bool]:
    if max_staleness < 0 or any(lag < 0 for lag in lags):
        raise ValueError("version lags and max_staleness must be >= 0 (a sample cannot be newer)")
    return [lag > max_staleness for lag in lags]


def drop_stale(lags: Sequence[int], max_staleness: int, decay: float = 0.5) -> StalenessWeights:
    """Samples whose version lag (trainer version - oldest token version) exceeds max_staleness
    are dropped; the rest keep weight 1. ``decay`` is unused (same signature as downweight)."""
    stale = _stale(lags, max_staleness)
    dropped = sum(stale)
    return StalenessWeights(
        weights=[0.0 if s else 1.0 for s in stale],
        keep=[not s for s in stale],
        fresh=len(stale) - dropped,
        dropped=dropped,
        downweighted=0,
    )


def downweight_stale(lags: Sequence[int], max_staleness: int, decay: float = 0.5) -> StalenessWeights:
    """Samples beyond max_staleness stay, weighted decay ** (lag - max_staleness), so the
    weight falls geometrically with every version past the allowed window."""
    if not 0.0 < decay <= 1.0:
        raise ValueError("the staleness decay must be in (0, 1]")
    stale = _stale(lags, max_staleness)
    weights = [decay ** (lag - max_staleness) if s else 1.0 for lag, s in zip(lags, stale, strict=True)]
    downweighted = sum(stale)
    return StalenessWeights(
        weights=weights,
        keep=[True] * len(stale),
        fresh=len(stale) - downweighted,
        dropped=0,
        downweighted=downweighted,
    )
