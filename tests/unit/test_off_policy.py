"""Off-policy training: decoupled PPO against a reference written from its formula, its equality
with plain PPO on on-policy tokens, and the one-pass path of a step's preparation (the
old-logprob forward skipped exactly when it may be, the training forward giving the same loss,
gradients and behaviour weights, and measuring the mismatch)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch

from services.common.algorithms import OFF_POLICY_CORRECTIONS, POLICY_LOSSES, TIS_DEFAULT_CAP
from services.common.config import AlgorithmConfig, JobSpecError, parse_job_spec
from services.trainer.batching import collate, token_logprobs
from services.trainer.losses import PolicyLossInputs, ppo_clip
from services.trainer.objective import Totals, combine, micro_batch_loss
from services.trainer.prepare import old_from_training_forward, prepare, proximal_from_forward
from services.trainer.regularizers import (
    decoupled_importance_weights,
)
from tests.unit.test_trainer_parts import FixedLogprobs, trajectory


def three_policies(seed: int, rows: int = 4, cols: int = 9) -> tuple[torch.Tensor, ...]:
    """logp under pi_theta, pi_prox and pi_behav (log-ratios up to +-0.6 and +-1.6, so both the clip
    and a cap of 2.5 are crossed), advantages and a mask with holes."""
    gen = torch.Generator().manual_seed(seed)
    prox = -torch.rand(rows, cols, generator=gen, dtype=torch.float64) * 3
    new = prox + (torch.rand(rows, cols, generator=gen, dtype=torch.float64) - 0.5) * 1.2
    behav = prox + (torch.rand(rows, cols, generator=gen, dtype=torch.float64) - 0.5) * 3.2
    advantages = torch.randn(rows, cols, generator=gen, dtype=torch.float64)
    mask = torch.rand(rows, cols, generator=gen) > 0.3
    mask[0, 0] = True
    return new, prox, behav, advantages, mask


def decoupled_reference(
    new: torch.Tensor, prox: torch.Tensor, behav: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
    low: float, high: float, cap: float,
) -> tuple[float, list[list[float]]]:  # fmt: skip
    """The decoupled PPO token mean (Hilton et al. 2022; AReaL) and its gradient in logp_theta, token
    by token: w * max(-r A, -clip(r) A) with r = p_theta / p_prox and w = p_prox / p_behav, 0 above
    the cap; the gradient is -w r A where the unclipped term is the active one, else 0."""
    rows, cols = mask.shape
    n = int(mask.sum())
    total, grad = 0.0, [[0.0] * cols for _ in range(rows)]
    for i in range(rows):
        for j in range(cols):
            if not mask[i, j]:
                continue
            r = math.exp(float(new[i, j] - prox[i, j]))
            w = math.exp(float(prox[i, j] - behav[i, j]))
            w = w if w <= cap else 0.0
            a = float(adv[i, j])
            bounded = min(max(r, 1 - low), 1 + high)
            total += w * max(-r * a, -bounded * a) / n
            if -r * a >= -bounded * a:
                grad[i][j] = -w * r * a / n
    return total, grad


def decoupled_loss(new: torch.Tensor, prox: torch.Tensor, behav: torch.Tensor, adv: torch.Tensor,
                   mask: torch.Tensor, algorithm: AlgorithmConfig) -> torch.Tensor:  # fmt: skip
    """The trainer's composition: the correction's weights times the token-mean weights, into ppo_clip."""
    correction = OFF_POLICY_CORRECTIONS.get(algorithm.off_policy_correction)
    weights = correction.fn(prox, behav, mask, algorithm.decoupled.cap).weights
    mean = mask.double() / mask.sum()
    return ppo_clip(PolicyLossInputs(new, prox, adv, mask, mean * weights), algorithm).loss


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("low", "high", "cap"), [(0.2, 0.2, 5.0), (0.2, 0.28, 2.5), (0.1, 0.3, 1.2)])
def test_decoupled_ppo_matches_the_papers_formula(seed: int, low: float, high: float, cap: float) -> None:
    new, prox, behav, adv, mask = three_policies(seed)
    new = new.clone().requires_grad_(True)
    algorithm = AlgorithmConfig(clip_low=low, clip_high=high, decoupled={"cap": cap})
    assert algorithm.off_policy_correction == "decoupled"  # the default
    loss = decoupled_loss(new, prox, behav, adv, mask, algorithm)
    loss.backward()
    want, want_grad = decoupled_reference(new.detach(), prox, behav, adv, mask, low, high, cap)
    assert float(loss.detach()) == pytest.approx(want, abs=1e-9)
    assert new.grad is not None
    for got_row, want_row in zip(new.grad.tolist(), want_grad, strict=True):
        assert got_row == pytest.approx(want_row, abs=1e-9)
    weights = decoupled_importance_weights(prox, behav, mask, cap)
    over = mask & ((prox - behav).exp() > cap)
    assert weights.capped_fraction == pytest.approx(float(over.sum()) / float(mask.sum()))
    if cap == 2.5:
        assert 0 < weights.capped_fraction < 1  # the cap left some tokens out


@pytest.mark.parametrize("seed", [0, 1])
def test_decoupled_ppo_on_on_policy_tokens_is_plain_ppo(seed: int) -> None:
    new, prox, _, adv, mask = three_policies(seed)
    algorithm = AlgorithmConfig(clip_high=0.28)
    plain_new = new.clone().requires_grad_(True)
    mean = mask.double() / mask.sum()
    plain = ppo_clip(PolicyLossInputs(plain_new, prox, adv, mask, mean), algorithm).loss
    plain.backward()
    decoupled_new = new.clone().requires_grad_(True)
    decoupled = decoupled_loss(decoupled_new, prox, prox, adv, mask, algorithm)  # behaviour = prox
    decoupled.backward()
    assert float(decoupled.detach()) == float(plain.detach())
    assert torch.equal(decoupled_new.grad, plain_new.grad)  # type: ignore[arg-type]


def test_every_correction_weighs_from_the_same_ratio() -> None:
    trainer = torch.tensor([[math.log(3.0), 0.0, math.log(0.5)]], dtype=torch.float64)
    behaviour = torch.zeros_like(trainer)
    mask = torch.tensor([[True, True, True]])
    weights = {
        e.name: e.fn(trainer, behaviour, mask, 2.0).weights[0].tolist() for e in OFF_POLICY_CORRECTIONS
    }
    assert weights["none"] == [1.0, 1.0, 1.0]
    assert weights["tis"] == pytest.approx([2.0, 1.0, 0.5])  # truncated
    assert weights["decoupled"] == pytest.approx([0.0, 1.0, 0.5])  # left out
    assert OFF_POLICY_CORRECTIONS.where(corrects_engine=True) == {"tis"}
    assert OFF_POLICY_CORRECTIONS.where(reweights=False) == {"none"}


def test_tis_cap_selects_tis_and_belongs_to_it() -> None:
    assert parse_job_spec({}).algorithm.off_policy_correction == "decoupled"
    assert parse_job_spec({"algorithm": {"tis": {"cap": 3.0}}}).algorithm.off_policy_correction == "tis"
    tis = parse_job_spec({"algorithm": {"off_policy_correction": "tis"}})
    assert tis.algorithm.tis.cap is None and TIS_DEFAULT_CAP == 2.0
    with pytest.raises(JobSpecError, match=r"tis\.cap is the cap of off_policy_correction 'tis', not 'none'"):
        parse_job_spec({"algorithm": {"tis": {"cap": 3.0}, "off_policy_correction": "none"}})
    with pytest.raises(JobSpecError, match=r"algorithm.decoupled.cap: .*greater than 1"):
        parse_job_spec({"algorithm": {"decoupled": {"cap": 1.0}}})  # > 1, as AReaL requires


class CountingLogprobs(FixedLogprobs):
    """The policy as a LogprobSource that counts its forward passes."""

    calls = 0

    def response_logprobs(self, samples: Any) -> list[list[float]]:
        self.calls += 1
        return super().response_logprobs(samples)


def fresh_groups(version: int = 4) -> list[list[Any]]:
    return [[trajectory(f"g{g}", i, version=version, reward=float(i)) for i in range(2)] for g in range(2)]


def step_spec(**sections: Any) -> Any:
    return parse_job_spec({"algorithm": {"group_size": 2, **sections.pop("algorithm", {})}, **sections})


def test_one_pass_skips_the_old_logprob_forward_whatever_the_tokens_versions() -> None:
    behaviour = [[-1.0, -2.0]] * 4
    one_stale = fresh_groups()
    one_stale[1][0].policy_versions[1] = 3  # one token of one sample, one version old
    no_versions = fresh_groups()
    del no_versions[0][1].policy_versions[:]
    for groups, spec in [
        (fresh_groups(), step_spec()),
        (one_stale, step_spec()),
        (no_versions, step_spec()),
        (fresh_groups(), step_spec(algorithm={"tis": {"cap": 2.0}})),
        (fresh_groups(), step_spec(algorithm={"off_policy_correction": "none"})),
    ]:
        source = CountingLogprobs(behaviour)
        fast = prepare(groups, spec, 4, source)
        assert source.calls == 0 and fast.old_logprobs_skipped and fast.metrics()["old_logprobs_skipped"] == 1
        assert all(s.old_logprobs is None and s.is_weights is None for s in fast.samples)
        assert fast.mismatch_kl is None and "importance_capped_fraction" not in fast.metrics()
    for spec in (step_spec(trainer={"ppo_epochs": 2}), step_spec(trainer={"mini_batches": 2})):
        source = CountingLogprobs(behaviour)
        slow = prepare(fresh_groups(), spec, 4, source)
        assert source.calls == 1 and not slow.old_logprobs_skipped
        assert all(s.old_logprobs == [-1.0, -2.0] for s in slow.samples) and slow.mismatch_kl == 0.0
    kl_in_reward = step_spec(algorithm={"kl_coef": 0.1, "kl_in_reward": True, "advantage": "reinforce_pp"})
    assert not old_from_training_forward(kl_in_reward) and old_from_training_forward(step_spec())
    forced = CountingLogprobs(behaviour)
    assert not prepare(fresh_groups(), step_spec(), 4, forced, recompute_old=True).old_logprobs_skipped
    assert forced.calls == 1


@pytest.mark.parametrize("correction", ["decoupled", "tis", "none"])
def test_the_training_forward_gives_the_recomputed_paths_loss_gradients_and_weights(correction: str) -> None:
    """Stale tokens whose behaviour logprobs are off the trainer's by up to +-2.4 (some over the
    cap): the loss, its gradient and the capped share are those of the old-logprob forward."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 5, 99, generator=gen)
    ids = torch.randint(4, 99, (4, 5), generator=gen)
    ids[:, :3] = torch.tensor([1, 20, 21])  # every sample's prompt
    own = token_logprobs(logits, ids)[:, 2:]  # the response tokens' logprobs under these logits
    behav = own + (torch.rand(own.shape, generator=gen) - 0.5) * 4.8
    groups = [
        [trajectory(f"g{g}", i, version=3, reward=float(i), response_token_ids=ids[2 * g + i, 3:].tolist(),
                    behaviour_logprobs=behav[2 * g + i].tolist()) for i in range(2)]
        for g in range(2)
    ]  # fmt: skip
    spec = step_spec(algorithm={"off_policy_correction": correction})
    fast = prepare(groups, spec, 4, CountingLogprobs([]))
    slow = prepare(groups, spec, 4, CountingLogprobs(own.tolist()), recompute_old=True)
    assert fast.old_logprobs_skipped and not slow.old_logprobs_skipped
    results = []
    for prepared, proximal in ((fast, proximal_from_forward(spec)), (slow, None)):
        leaf = logits.clone().requires_grad_(True)
        batch = collate(prepared.samples, [1 / 8] * 4, "cpu")
        totals = Totals()
        loss = micro_batch_loss(
            leaf, batch, spec.algorithm, POLICY_LOSSES.get("ppo_clip").fn, totals, proximal
        )
        loss.backward()
        results.append((float(loss.detach()), leaf.grad, combine([(totals, 0.0)], [], 1e-4, proximal)))
    (fast_loss, fast_grad, fast_stats), (slow_loss, slow_grad, _) = results
    assert fast_loss == pytest.approx(slow_loss, abs=1e-6)
    assert torch.allclose(fast_grad, slow_grad, atol=1e-6) and float(fast_grad.abs().sum()) > 0  # type: ignore[arg-type, union-attr]
    assert fast_stats.importance_capped_fraction == pytest.approx(slow.importance_capped_fraction)
    assert (slow.importance_capped_fraction > 0) == (correction != "none")  # the caps were crossed


def test_the_training_forward_measures_the_engine_trainer_mismatch() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 5, 99, generator=gen)
    ids = torch.randint(4, 99, (4, 5), generator=gen)
    ids[:, :3] = torch.tensor([1, 20, 21])
    own = token_logprobs(logits, ids)[:, 2:]
    groups = [
        [trajectory(f"g{g}", i, version=4, reward=float(i), response_token_ids=ids[2 * g + i, 3:].tolist(),
                    behaviour_logprobs=own[2 * g + i].tolist()) for i in range(2)]
        for g in range(2)
    ]  # fmt: skip
    fast = prepare(groups, step_spec(), 4, CountingLogprobs([]))
    proximal = proximal_from_forward(step_spec())
    totals = Totals()
    micro_batch_loss(logits, collate(fast.samples, [1 / 8] * 4, "cpu"), step_spec().algorithm,
                     POLICY_LOSSES.get("ppo_clip").fn, totals, proximal)  # fmt: skip
    assert combine([(totals, 0.0)], [], 1e-4).mismatch_kl == pytest.approx(0.0, abs=1e-6)
    # An engine that sampled with p = 2 x the trainer's: the training forward measures the mismatch.
    shifted = [dataclasses.replace(s, behaviour_logprobs=[lp + math.log(2.0) for lp in s.behaviour_logprobs])
               for s in fast.samples]  # fmt: skip
    totals = Totals()
    batch = collate(shifted, [1 / 8] * 4, "cpu")
    micro_batch_loss(logits, batch, step_spec().algorithm, POLICY_LOSSES.get("ppo_clip").fn, totals,
                     proximal)  # fmt: skip
    stats = combine([(totals, 0.0)], [], 1e-4, proximal)
    assert stats.mismatch_kl == pytest.approx(0.5 - 1 - math.log(0.5), abs=1e-5)
    assert stats.metrics()["mismatch_kl"] == stats.mismatch_kl


def test_the_one_pass_setting_travels_to_the_other_trainer_ranks_pickled() -> None:
    import pickle

    for correction in ("decoupled", "tis", "none"):
        prepared = prepare(fresh_groups(), step_spec(algorithm={"off_policy_correction": correction}), 4,
                           CountingLogprobs([[-1.0, -2.0]] * 4))  # fmt: skip
        assert (
            prepared.proximal is not None
            and pickle.loads(pickle.dumps(prepared.proximal)) == prepared.proximal
        )
