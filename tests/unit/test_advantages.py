"""Advantage estimators against references written from their formulas."""

from __future__ import annotations

import random
import statistics

import pytest
import torch

from services.common.algorithms import ADVANTAGE_ESTIMATORS
from services.trainer import advantages
from services.trainer.advantages import (
    EPS,
    TokenAdvantageInputs,
    get_advantage,
    get_token_advantage,
)
from services.trainer.regularizers import kl_reward_penalty


def random_rewards(groups: int, size: int, seed: int) -> list[list[float]]:
    rng = random.Random(seed)
    return [[rng.uniform(-2.0, 3.0) for _ in range(size)] for _ in range(groups)]


def grpo_reference(rows: list[list[float]]) -> list[list[float]]:
    return [[(r - statistics.fmean(row)) / (statistics.stdev(row) + EPS) for r in row] for row in rows]


def dr_grpo_reference(rows: list[list[float]]) -> list[list[float]]:
    return [[r - statistics.fmean(row) for r in row] for row in rows]


def rloo_reference(rows: list[list[float]]) -> list[list[float]]:
    return [[r - statistics.fmean(row[:i] + row[i + 1 :]) for i, r in enumerate(row)] for row in rows]


@pytest.mark.parametrize(
    ("name", "reference"),
    [("grpo", grpo_reference), ("dr_grpo", dr_grpo_reference), ("rloo", rloo_reference)],
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_estimators_match_their_formulas(name: str, reference: object, seed: int) -> None:
    rows = random_rewards(groups=5, size=2 + seed * 3, seed=seed)
    got = get_advantage(name)(torch.tensor(rows, dtype=torch.float64))
    expected = torch.tensor(reference(rows), dtype=torch.float64)  # type: ignore[operator]
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_grpo_of_an_all_equal_group_is_zero_not_nan() -> None:
    got = get_advantage("grpo")(torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 0.0, 1.0]]))
    assert torch.equal(got[0], torch.zeros(4))
    assert torch.isfinite(got).all()


def test_grpo_advantages_of_binary_rewards_have_the_expected_signs() -> None:
    got = get_advantage("grpo")(torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    assert got[0, 0] > 0 and (got[0, 1:] < 0).all()
    assert abs(float(got.sum())) < 1e-6


def test_unknown_estimator_names_the_available_ones() -> None:
    available = r"dr_grpo, gae, grpo, reinforce_pp, reinforce_pp_baseline, rloo"
    with pytest.raises(ValueError, match=rf"'vtrace' is not available.*{available}"):
        get_advantage("vtrace")
    with pytest.raises(ValueError, match=rf"'vtrace' is not available.*{available}"):
        get_token_advantage("vtrace")


def test_a_token_estimator_is_not_served_as_an_outcome_one() -> None:
    with pytest.raises(ValueError, match="'gae' is a token-level estimator"):
        get_advantage("gae")


def test_an_estimator_cannot_be_registered_twice() -> None:
    with pytest.raises(ValueError, match="registered twice"):
        ADVANTAGE_ESTIMATORS.register("grpo", needs_groups=True)(advantages.grpo)
    with pytest.raises(ValueError, match="registered twice"):
        ADVANTAGE_ESTIMATORS.register("grpo", token_level=True)(advantages.gae)
    with pytest.raises(ValueError, match="registered twice"):
        ADVANTAGE_ESTIMATORS.register("gae")(advantages.grpo)


def test_rewards_must_be_groups_of_at_least_two() -> None:
    with pytest.raises(ValueError, match="group_size >= 2"):
        get_advantage("grpo")(torch.tensor([[1.0], [0.0]]))
    with pytest.raises(ValueError, match="group_size >= 2"):
        get_advantage("dr_grpo")(torch.tensor([1.0, 0.0]))


# --- token-level estimators: references written step by step from the papers ------------------


Rows = list[list[float]]


def random_mask(samples: int, tokens: int, seed: int) -> list[list[bool]]:
    """Ragged responses (right padding) with holes inside (tool output between turns)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(samples):
        length = rng.randint(1, tokens)
        rows.append([t < length and (t == 0 or rng.random() > 0.2) for t in range(tokens)])
    return rows


def random_tokens(samples: int, tokens: int, seed: int) -> Rows:
    rng = random.Random(seed)
    return [[rng.uniform(-1.0, 1.0) for _ in range(tokens)] for _ in range(samples)]


def step_rewards_reference(mask: list[list[bool]], outcome: list[float], extra: Rows | None) -> list[dict]:
    """Per sample: {action token: reward}; the outcome at the last action token."""
    out = []
    for b, row in enumerate(mask):
        steps = [t for t, m in enumerate(row) if m]
        rewards = {t: (extra[b][t] if extra else 0.0) for t in steps}
        rewards[steps[-1]] += outcome[b]
        out.append(rewards)
    return out


def returns_reference(rewards: list[dict], tokens: int, gamma: float) -> Rows:
    rows = []
    for per_step in rewards:
        row, running = [0.0] * tokens, 0.0
        for t in sorted(per_step, reverse=True):
            running = per_step[t] + gamma * running
            row[t] = running
        rows.append(row)
    return rows


def whiten_reference(values: Rows, mask: list[list[bool]]) -> Rows:
    flat = [v for row, m in zip(values, mask, strict=True) for v, k in zip(row, m, strict=True) if k]
    mean, std = statistics.fmean(flat), statistics.pstdev(flat)
    return [
        [(v - mean) / (std + EPS) if k else 0.0 for v, k in zip(row, m, strict=True)]
        for row, m in zip(values, mask, strict=True)
    ]


def reinforce_pp_reference(rewards: Rows, mask: list[list[bool]], extra: Rows | None, gamma: float):
    outcome = [r for row in rewards for r in row]
    returns = returns_reference(step_rewards_reference(mask, outcome, extra), len(mask[0]), gamma)
    return whiten_reference(returns, mask), returns


def reinforce_pp_baseline_reference(rewards: Rows, mask: list[list[bool]], extra: Rows | None, gamma: float):
    centred = [[r - statistics.fmean(row) for r in row] for row in rewards]
    return reinforce_pp_reference(centred, mask, extra, gamma)


def gae_reference(rewards: Rows, mask: list[list[bool]], extra: Rows | None, values: Rows, gamma, lam):
    outcome = [r for row in rewards for r in row]
    per_sample = step_rewards_reference(mask, outcome, extra)
    tokens = len(mask[0])
    advantages, returns = [], []
    for b, per_step in enumerate(per_sample):
        steps = sorted(per_step)
        adv_row, ret_row, running = [0.0] * tokens, [0.0] * tokens, 0.0
        for k in range(len(steps) - 1, -1, -1):
            t = steps[k]
            next_value = values[b][steps[k + 1]] if k + 1 < len(steps) else 0.0
            delta = per_step[t] + gamma * next_value - values[b][t]
            running = delta + gamma * lam * running
            adv_row[t], ret_row[t] = running, running + values[b][t]
        advantages.append(adv_row)
        returns.append(ret_row)
    return advantages, returns


def token_case(seed: int, with_extra: bool, groups: int = 3, size: int = 4, tokens: int = 11):
    rewards = random_rewards(groups, size, seed)
    mask = random_mask(groups * size, tokens, seed)
    extra = random_tokens(groups * size, tokens, seed + 100) if with_extra else None
    values = random_tokens(groups * size, tokens, seed + 200)
    return rewards, mask, extra, values


def t(rows: object) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("with_extra", [False, True])
@pytest.mark.parametrize("gamma", [1.0, 0.9])
@pytest.mark.parametrize(
    ("name", "reference"),
    [("reinforce_pp", reinforce_pp_reference), ("reinforce_pp_baseline", reinforce_pp_baseline_reference)],
)
def test_reinforce_pp_matches_its_formula(
    name: str, reference: object, seed: int, with_extra: bool, gamma: float
) -> None:
    rewards, mask, extra, _ = token_case(seed, with_extra)
    inputs = TokenAdvantageInputs(t(rewards), torch.tensor(mask), t(extra) if extra else None, gamma=gamma)
    got = get_token_advantage(name)(inputs)
    advantages, returns = reference(rewards, mask, extra, gamma)  # type: ignore[operator]
    torch.testing.assert_close(got.returns, t(returns), rtol=0, atol=1e-6)
    torch.testing.assert_close(got.advantages, t(advantages), rtol=0, atol=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("with_extra", [False, True])
@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (1.0, 0.5)])
def test_gae_matches_its_formula(seed: int, with_extra: bool, gamma: float, lam: float) -> None:
    rewards, mask, extra, values = token_case(seed, with_extra)
    inputs = TokenAdvantageInputs(
        t(rewards), torch.tensor(mask), t(extra) if extra else None, t(values), gamma, lam
    )
    got = get_token_advantage("gae")(inputs)
    advantages, returns = gae_reference(rewards, mask, extra, values, gamma, lam)
    torch.testing.assert_close(got.advantages, t(advantages), rtol=0, atol=1e-6)
    torch.testing.assert_close(got.returns, t(returns), rtol=0, atol=1e-6)


def test_gae_with_lambda_one_is_the_discounted_return_minus_the_value() -> None:
    rewards, mask, extra, values = token_case(5, True)
    inputs = TokenAdvantageInputs(t(rewards), torch.tensor(mask), t(extra), t(values), 0.95, 1.0)
    got = get_token_advantage("gae")(inputs)
    outcome = [r for row in rewards for r in row]
    returns = t(returns_reference(step_rewards_reference(mask, outcome, extra), len(mask[0]), 0.95))
    torch.testing.assert_close(got.returns, returns, rtol=0, atol=1e-9)
    torch.testing.assert_close(got.advantages, returns - t(values) * torch.tensor(mask), rtol=0, atol=1e-9)


def test_kl_folded_into_the_reward_is_reinforce_pp_with_a_per_token_penalty() -> None:
    rewards, mask, _, _ = token_case(7, False)
    logprobs, ref = t(random_tokens(12, 11, 8)) - 2.0, t(random_tokens(12, 11, 9)) - 2.0
    penalty = kl_reward_penalty(logprobs, ref, torch.tensor(mask), "k1", 0.05)
    got = get_token_advantage("reinforce_pp")(TokenAdvantageInputs(t(rewards), torch.tensor(mask), penalty))
    # r_t = 1[t = end] r(x, y) - beta * KL_t with the k1 estimate log pi_old - log pi_ref.
    kl = [[-0.05 * (float(logprobs[b, j]) - float(ref[b, j])) for j in range(11)] for b in range(12)]
    advantages, returns = reinforce_pp_reference(rewards, mask, kl, 1.0)
    torch.testing.assert_close(got.advantages, t(advantages), rtol=0, atol=1e-6)
    torch.testing.assert_close(got.returns, t(returns), rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_outcome_estimators_broadcast_over_the_action_tokens(name: str) -> None:
    rewards, mask, _, _ = token_case(3, False)
    got = get_token_advantage(name)(TokenAdvantageInputs(t(rewards), torch.tensor(mask)))
    per_sample = get_advantage(name)(t(rewards)).flatten().tolist()
    expected = [[a if m else 0.0 for m in row] for a, row in zip(per_sample, mask, strict=True)]
    torch.testing.assert_close(got.advantages, t(expected), rtol=0, atol=0)
    with pytest.raises(ValueError, match="takes no token rewards"):
        get_token_advantage(name)(TokenAdvantageInputs(t(rewards), torch.tensor(mask), t(rewards)))


def test_token_estimators_check_their_inputs() -> None:
    rewards, mask, _, values = token_case(1, False)
    with pytest.raises(ValueError, match="needs the critic's values"):
        get_token_advantage("gae")(TokenAdvantageInputs(t(rewards), torch.tensor(mask)))
    with pytest.raises(ValueError, match="do not match"):
        get_token_advantage("reinforce_pp")(TokenAdvantageInputs(t(rewards), torch.tensor(mask[:-1])))
    with pytest.raises(ValueError, match="values must have the mask's shape"):
        get_token_advantage("gae")(
            TokenAdvantageInputs(t(rewards), torch.tensor(mask), values=t(values)[:, :3])
        )
    with pytest.raises(ValueError, match="group_size >= 2"):
        get_token_advantage("reinforce_pp_baseline")(
            TokenAdvantageInputs(t([[1.0], [2.0]]), torch.ones(2, 3, dtype=torch.bool))
        )


def test_padding_garbage_does_not_reach_token_advantages() -> None:
    rewards, mask, extra, values = token_case(4, True)
    off = ~torch.tensor(mask)
    extra_t, values_t = (t(rows).masked_fill(off, float("nan")) for rows in (extra, values))
    inputs = TokenAdvantageInputs(t(rewards), torch.tensor(mask), extra_t, values_t, 0.9, 0.9)
    for name in ("reinforce_pp", "reinforce_pp_baseline", "gae"):
        got = get_token_advantage(name)(inputs)
        assert torch.isfinite(got.advantages).all() and torch.isfinite(got.returns).all()
        assert (got.advantages[off] == 0).all()
