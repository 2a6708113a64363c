"""What an evaluation reports of a set (services/controller/eval_scores.py): pass@k against the
definition of Chen et al. 2021 computed independently, mean@n, greedy accuracy and errors."""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest

from services.controller.eval_scores import PromptOutcome, SetScores, pass_at_k, set_scores

CASES = [
    (1, 0, 1),
    (1, 1, 1),
    (4, 0, 2),  # c = 0: no draw holds a right answer
    (4, 4, 3),  # c = n: every draw does
    (5, 1, 1),
    (5, 2, 3),
    (5, 3, 3),  # n - c < k: every draw of k holds a right one
    (6, 2, 5),
    (8, 3, 4),
    (10, 1, 10),
    (10, 7, 2),
    (12, 5, 6),
]


def by_enumeration(n: int, c: int, k: int) -> Fraction:
    """The fraction of the k-subsets of n answers (c of them right) that hold a right answer."""
    answers = [True] * c + [False] * (n - c)
    draws = list(itertools.combinations(range(n), k))
    return Fraction(sum(1 for draw in draws if any(answers[i] for i in draw)), len(draws))


def by_product(n: int, c: int, k: int) -> Fraction:
    """1 - prod_{i = n-c+1}^{n} (1 - k/i), the numerically stable form of the same estimator."""
    if n - c < k:
        return Fraction(1)
    product = Fraction(1)
    for i in range(n - c + 1, n + 1):
        product *= 1 - Fraction(k, i)
    return 1 - product


@pytest.mark.parametrize(("n", "c", "k"), CASES)
def test_pass_at_k_is_the_chance_that_k_draws_hold_a_right_answer(n: int, c: int, k: int) -> None:
    expected = by_enumeration(n, c, k)
    assert by_product(n, c, k) == expected, "the two independent forms agree"
    assert pass_at_k(n, c, k) == pytest.approx(float(expected), abs=1e-12)


def test_pass_at_k_edges() -> None:
    assert pass_at_k(7, 0, 3) == 0.0
    assert pass_at_k(7, 7, 3) == 1.0
    assert pass_at_k(7, 5, 3) == 1.0  # 2 wrong answers cannot fill a draw of 3
    assert pass_at_k(7, 3, 1) == pytest.approx(3 / 7)  # pass@1 is the fraction right
    assert pass_at_k(1024, 1, 1024) == 1.0 and pass_at_k(1024, 1000, 512) == 1.0


def test_pass_at_k_stays_exact_for_many_samples() -> None:
    n, c, k = 1024, 3, 500  # C(1021, 500) / C(1024, 500) has hundreds of digits
    assert pass_at_k(n, c, k) == pytest.approx(float(by_product(n, c, k)), rel=1e-12)


@pytest.mark.parametrize(("n", "c", "k"), [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_pass_at_k_refuses_what_is_no_draw(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(n, c, k)


def test_set_scores_average_over_prompts() -> None:
    outcomes = [
        PromptOutcome(greedy_reward=1.0, samples=4, samples_right=4),
        PromptOutcome(greedy_reward=0.5, samples=4, samples_right=1, failed=1),
        PromptOutcome(greedy_reward=0.0, samples=4, samples_right=0, failed=2),
    ]
    scores = set_scores(outcomes, [1, 2, 4])
    assert (scores.accuracy, scores.reward_mean) == (pytest.approx(1 / 3), pytest.approx(0.5))
    assert (scores.num_prompts, scores.errors, scores.samples) == (3, 3, 4)
    assert scores.mean_at_n == pytest.approx((1 + 0.25 + 0) / 3)
    for k in (1, 2, 4):
        expected = sum(float(by_enumeration(4, c, k)) for c in (4, 1, 0)) / 3
        assert scores.pass_at[k] == pytest.approx(expected)
    assert scores.pass_at[1] == pytest.approx(scores.mean_at_n), "pass@1 is mean@n"


def test_greedy_only_reports_no_sampled_metrics() -> None:
    scores = set_scores([PromptOutcome(1.0), PromptOutcome(0.0, failed=1)], [])
    assert scores == SetScores(accuracy=0.5, reward_mean=0.5, num_prompts=2, errors=1)
    assert scores.metric_values() == {"accuracy": 0.5, "reward_mean": 0.5, "num_prompts": 2.0, "errors": 1.0}


def test_metric_names_carry_the_prefix_and_k() -> None:
    scores = set_scores([PromptOutcome(1.0, samples=2, samples_right=1)], [1, 2])
    assert scores.metric_values("gsm8k/") == {
        "gsm8k/accuracy": 1.0,
        "gsm8k/reward_mean": 1.0,
        "gsm8k/num_prompts": 1.0,
        "gsm8k/errors": 0.0,
        "gsm8k/mean@2": 0.5,
        "gsm8k/pass@1": 0.5,
        "gsm8k/pass@2": 1.0,
    }


def test_a_set_needs_prompts_with_as_many_samples_each() -> None:
    with pytest.raises(ValueError, match="at least one prompt"):
        set_scores([], [1])
    with pytest.raises(ValueError, match="same number of sampled answers"):
        set_scores([PromptOutcome(1.0, samples=2), PromptOutcome(1.0, samples=3)], [1])
