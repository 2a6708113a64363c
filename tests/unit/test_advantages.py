"""Advantage estimators against references written from their formulas."""

from __future__ import annotations

import random
import statistics

import pytest
import torch

from services.trainer import advantages
from services.trainer.advantages import EPS, get_advantage, register_advantage


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
    with pytest.raises(ValueError, match=r"'gae' is not available.*dr_grpo, grpo, rloo"):
        get_advantage("gae")


def test_an_estimator_cannot_be_registered_twice() -> None:
    with pytest.raises(ValueError, match="registered twice"):
        register_advantage("grpo")(advantages.grpo)


def test_rewards_must_be_groups_of_at_least_two() -> None:
    with pytest.raises(ValueError, match="group_size >= 2"):
        get_advantage("grpo")(torch.tensor([[1.0], [0.0]]))
    with pytest.raises(ValueError, match="group_size >= 2"):
        get_advantage("dr_grpo")(torch.tensor([1.0, 0.0]))
