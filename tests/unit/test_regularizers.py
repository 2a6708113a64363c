"""KL estimators, entropy, truncated importance sampling and staleness weights against references
written from their formulas, and the loss terms against a few steps of SGD."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from services.common.algorithms import KL_ESTIMATORS, STALE_POLICIES
from services.trainer.regularizers import (
    entropy_bonus,
    kl_loss,
    kl_reward_penalty,
    masked_entropy_sum,
    token_entropy,
    truncated_importance_weights,
)


def per_token_case(seed: int, rows: int = 4, cols: int = 9) -> tuple[torch.Tensor, ...]:
    """Two logprob tensors, a ragged mask with holes (nan where it is off) and per-sample weights."""
    rng = random.Random(seed)
    mask = torch.tensor(
        [[j < rng.randint(1, cols) and rng.random() > 0.15 for j in range(cols)] for _ in range(rows)]
    )
    mask[0, 0] = True
    a = torch.tensor(
        [[-rng.uniform(0.05, 4.0) for _ in range(cols)] for _ in range(rows)], dtype=torch.float64
    )
    b = torch.tensor(
        [[-rng.uniform(0.05, 4.0) for _ in range(cols)] for _ in range(rows)], dtype=torch.float64
    )
    nan = torch.tensor(float("nan"), dtype=torch.float64)
    weights = torch.tensor([[rng.uniform(0.01, 0.2)] * cols for _ in range(rows)], dtype=torch.float64)
    return torch.where(mask, a, nan), torch.where(mask, b, nan), mask, weights * mask


def kl_reference(name: str, logp: float, ref: float) -> float:
    log_r = ref - logp  # r = pi_ref / pi, on tokens sampled from pi
    return {"k1": -log_r, "k2": 0.5 * log_r**2, "k3": math.exp(log_r) - 1 - log_r}[name]


def masked_cells(mask: torch.Tensor) -> list[tuple[int, int]]:
    return [(i, j) for i in range(mask.shape[0]) for j in range(mask.shape[1]) if mask[i, j]]


@pytest.mark.parametrize("name", ["k1", "k2", "k3"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kl_estimators_match_their_formulas(name: str, seed: int) -> None:
    logp, ref, mask, weights = per_token_case(seed)
    got = KL_ESTIMATORS.get(name).fn(logp, ref)
    for i, j in masked_cells(mask):
        assert float(got[i, j]) == pytest.approx(
            kl_reference(name, float(logp[i, j]), float(ref[i, j])), abs=1e-6
        )
    loss = kl_loss(logp, ref, mask, weights, name, 0.3)
    expected = sum(
        0.3 * float(weights[i, j]) * kl_reference(name, float(logp[i, j]), float(ref[i, j]))
        for i, j in masked_cells(mask)
    )
    assert float(loss) == pytest.approx(expected, abs=1e-6)
    penalty = kl_reward_penalty(logp, ref, mask, name, 0.3)
    assert not penalty.requires_grad and (penalty[~mask] == 0).all()
    for i, j in masked_cells(mask):
        assert float(penalty[i, j]) == pytest.approx(-0.3 * float(got[i, j]), abs=1e-6)


def test_k2_and_k3_are_never_negative_and_k1_sometimes_is() -> None:
    logp, ref, mask, _ = per_token_case(3)
    values = {name: KL_ESTIMATORS.get(name).fn(logp, ref)[mask] for name in ("k1", "k2", "k3")}
    assert (values["k2"] >= 0).all() and (values["k3"] >= 0).all()
    assert (values["k1"] < 0).any()


@pytest.mark.parametrize("name", ["k1", "k3"])
def test_unbiased_estimators_estimate_kl_of_the_policy_to_the_reference(name: str) -> None:
    """On tokens sampled from pi, the mean of k1 and k3 is KL(pi || pi_ref), not KL(pi_ref || pi)."""
    gen = torch.Generator().manual_seed(0)
    pi = torch.tensor([0.9, 0.05, 0.03, 0.01, 0.01], dtype=torch.float64)
    pi_ref = torch.full((5,), 0.2, dtype=torch.float64)
    forward = sum(p * math.log(p / q) for p, q in zip(pi.tolist(), pi_ref.tolist(), strict=True))
    reverse = sum(q * math.log(q / p) for p, q in zip(pi.tolist(), pi_ref.tolist(), strict=True))
    assert abs(forward - reverse) > 0.2  # the test tells the directions apart
    tokens = torch.multinomial(pi, 200_000, replacement=True, generator=gen)
    estimate = float(KL_ESTIMATORS.get(name).fn(pi.log()[tokens], pi_ref.log()[tokens]).mean())
    assert estimate == pytest.approx(forward, abs=0.02)


def test_kl_registry_names_the_available_estimators() -> None:
    with pytest.raises(ValueError, match=r"'k4' is not available.*k1, k2, k3"):
        KL_ESTIMATORS.get("k4")
    with pytest.raises(ValueError, match="registered twice"):
        KL_ESTIMATORS.register("k3")(KL_ESTIMATORS.get("k1").fn)


def entropy_reference(row: list[float]) -> float:
    top = max(row)
    exps = [math.exp(z - top) for z in row]
    probs = [e / sum(exps) for e in exps]
    return -sum(p * math.log(p) for p in probs if p > 0)


@pytest.mark.parametrize("seed", [0, 1])
def test_entropy_matches_its_formula(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 5, 7, generator=gen, dtype=torch.float64) * 3
    got = token_entropy(logits)
    assert got.shape == (3, 5)
    for i in range(3):
        for j in range(5):
            assert float(got[i, j]) == pytest.approx(entropy_reference(logits[i, j].tolist()), abs=1e-6)


@pytest.mark.parametrize("chunk_elements", [1, 9, 27, 1 << 18])  # rows of 9 logits: 1, 1, 3, all
def test_the_logged_entropy_sums_the_formula_over_the_mask(chunk_elements: int) -> None:
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 6, 9, generator=gen, dtype=torch.float64) * 3
    mask = torch.rand(3, 6, generator=gen) < 0.6
    expected = sum(entropy_reference(logits[i, j].tolist()) for i in range(3) for j in range(6) if mask[i, j])
    assert masked_entropy_sum(logits, mask, chunk_elements) == pytest.approx(expected, abs=1e-9)
    assert masked_entropy_sum(logits, torch.zeros_like(mask)) == 0.0


def test_entropy_is_stable_for_large_logits() -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 4, 50, generator=gen, dtype=torch.float32) * 5
    for big in (logits + 1e4, logits * 1e3):
        got = token_entropy(big)
        assert torch.isfinite(got).all() and (got >= 0).all()
    torch.testing.assert_close(token_entropy(logits + 1e4), token_entropy(logits), rtol=0, atol=1e-3)
    uniform = token_entropy(torch.zeros(1, 50))
    assert float(uniform) == pytest.approx(math.log(50), abs=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("cap", [0.5, 2.0, 1e9])
def test_truncated_importance_weights_match_their_formula(seed: int, cap: float) -> None:
    trainer, behaviour, mask, _ = per_token_case(seed)
    trainer = trainer.clone().requires_grad_(True)
    got = truncated_importance_weights(trainer, behaviour, mask, cap)
    assert not got.weights.requires_grad and (got.weights[~mask] == 0).all()
    kls, capped = [], 0
    for i, j in masked_cells(mask):
        log_ratio = float(trainer.detach()[i, j]) - float(behaviour[i, j])
        assert float(got.weights[i, j]) == pytest.approx(min(math.exp(log_ratio), cap), abs=1e-6)
        kls.append(math.exp(log_ratio) - 1 - log_ratio)
        capped += int(math.exp(log_ratio) > cap)
    assert got.tokens == len(kls)
    assert got.mismatch_kl == pytest.approx(sum(kls) / len(kls), abs=1e-6)
    assert got.capped_fraction == pytest.approx(capped / len(kls), abs=1e-6)
    if cap == 2.0:
        assert 0 < got.capped_fraction < 1


def test_importance_weights_of_matching_logprobs_are_one_with_no_mismatch() -> None:
    logp, _, mask, _ = per_token_case(4)
    got = truncated_importance_weights(logp, logp, mask, 2.0)
    assert (got.weights[mask] == 1).all() and got.mismatch_kl == 0.0 and got.capped_fraction == 0.0
    with pytest.raises(ValueError, match="cap must be > 0"):
        truncated_importance_weights(logp, logp, mask, 0.0)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("max_staleness", [0, 1, 3])
def test_staleness_weights_follow_the_policy(seed: int, max_staleness: int) -> None:
    rng = random.Random(seed)
    lags = [rng.randint(0, 6) for _ in range(20)]
    drop = STALE_POLICIES.get("drop").fn(lags, max_staleness)
    down = STALE_POLICIES.get("downweight").fn(lags, max_staleness, 0.7)
    fresh = sum(1 for lag in lags if lag <= max_staleness)
    assert drop.keep == [lag <= max_staleness for lag in lags]
    assert drop.weights == [1.0 if lag <= max_staleness else 0.0 for lag in lags]
    assert (drop.fresh, drop.dropped, drop.downweighted) == (fresh, len(lags) - fresh, 0)
    expected = [1.0 if lag <= max_staleness else 0.7 ** (lag - max_staleness) for lag in lags]
    assert down.weights == pytest.approx(expected, abs=1e-12)
    assert down.keep == [True] * len(lags)
    assert (down.fresh, down.dropped, down.downweighted) == (fresh, 0, len(lags) - fresh)


def test_staleness_rejects_bad_lags_and_unknown_policies() -> None:
    with pytest.raises(ValueError, match="must be >= 0"):
        STALE_POLICIES.get("drop").fn([0, -1], 1)
    with pytest.raises(ValueError, match="decay must be in"):
        STALE_POLICIES.get("downweight").fn([0, 3], 1, 1.5)
    with pytest.raises(ValueError, match=r"'fifo' is not available.*downweight, drop"):
        STALE_POLICIES.get("fifo")
    with pytest.raises(ValueError, match="registered twice"):
        STALE_POLICIES.register("drop")(STALE_POLICIES.get("downweight").fn)


# --- the loss terms improve their objectives under a few SGD steps -----------------------------


def sgd_losses(loss_of: object, param: torch.Tensor, steps: int = 6, lr: float = 1.0) -> list[float]:
    param.requires_grad_(True)
    optimiser = torch.optim.SGD([param], lr=lr)
    seen = []
    for _ in range(steps + 1):
        optimiser.zero_grad()
        loss = loss_of(param)  # type: ignore[operator]
        seen.append(float(loss.detach()))
        loss.backward()
        optimiser.step()
    return seen


def toy_policy(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 6, 5, generator=gen, dtype=torch.float64) * 2
    tokens = torch.randint(0, 5, (3, 6), generator=gen)
    mask = torch.rand(3, 6, generator=gen) > 0.2
    return logits, tokens, mask, mask.double() / mask.sum()


@pytest.mark.parametrize("name", ["k1", "k2", "k3"])
def test_kl_loss_improves_its_objective(name: str) -> None:
    logits, tokens, mask, weights = toy_policy(0)
    ref = torch.log_softmax(torch.randn(3, 6, 5, dtype=torch.float64), -1).gather(-1, tokens[..., None])
    ref = ref.squeeze(-1)

    def objective(param: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(param, -1).gather(-1, tokens[..., None]).squeeze(-1)
        return kl_loss(logp, ref, mask, weights, name, 1.0)

    seen = sgd_losses(objective, logits.clone())
    assert seen[-1] < seen[0] - 1e-3


def test_entropy_bonus_raises_the_entropy() -> None:
    logits, _, mask, weights = toy_policy(1)
    seen = sgd_losses(lambda param: entropy_bonus(token_entropy(param), mask, weights, 1.0), logits.clone())
    assert seen[-1] < seen[0] - 1e-3
    assert all(b <= a + 1e-12 for a, b in itertools.pairwise(seen))
