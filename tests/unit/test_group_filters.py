"""Group filters (services/trainer/filters.py) against references written from their definitions,
and how a job's filters are chosen, ordered and checked."""

from __future__ import annotations

import random
import statistics

import pytest

from services.common.algorithm_config import GroupFilterConfig
from services.common.config import JobSpecError, parse_job_spec
from services.common.pb import common_pb2
from services.common.plugins import PluginError
from services.trainer.filters import (
    GroupScores,
    chosen_filters,
    dynamic_sampling,
    first_to_drop,
    zero_variance,
)

PLUGIN = "tests.plugins.filters:keep_rewarded"


def scores(rewards: list[float], components: list[dict[str, float]] | None = None) -> GroupScores:
    size = len(rewards)
    return GroupScores(
        rewards=tuple(rewards),
        components=tuple(components or [{} for _ in rewards]),
        response_tokens=(3,) * size,
        truncated=(False,) * size,
    )


def zero_variance_reference(rewards: list[float]) -> bool:
    """A group-relative advantage is r - mean(r) (over a std): all 0 exactly when the variance is."""
    return statistics.pvariance(rewards) > 0


def dapo_reference(correct: list[bool]) -> bool:
    """DAPO (Yu et al. 2025), the constraint of its objective: 0 < |{o_i | is_equivalent(a, o_i)}| < G."""
    return 0 < correct.count(True) < len(correct)


@pytest.mark.parametrize("seed", range(20))
def test_zero_variance_keeps_exactly_the_groups_with_a_learning_signal(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(50):
        rewards = [float(rng.choice([0, 1, 2])) for _ in range(rng.randint(2, 5))]
        assert zero_variance(scores(rewards)) == zero_variance_reference(rewards), rewards


@pytest.mark.parametrize("seed", range(20))
def test_dynamic_sampling_keeps_groups_neither_all_right_nor_all_wrong(seed: int) -> None:
    """With an accuracy component (reverse's `exact`, partial credit as the reward) the component
    decides, whatever the rewards; without one, a reward of 1 is right (DAPO's +1 / -1 rule)."""
    rng = random.Random(seed)
    for _ in range(50):
        size = rng.randint(2, 6)
        exact = [rng.random() < 0.5 for _ in range(size)]
        partial = [1.0 if right else rng.choice([0.0, 0.25, 0.5, 0.75]) for right in exact]
        components = [
            {"exact": float(right), "positions": p} for right, p in zip(exact, partial, strict=True)
        ]
        group = scores(partial, components)
        assert dynamic_sampling(group, accuracy="exact") == dapo_reference(exact)
        signs = [1.0 if right else -1.0 for right in exact]
        assert dynamic_sampling(scores(signs)) == dapo_reference(exact)  # no `correct` component


def test_the_two_filters_differ_on_partial_credit_and_agree_on_binary_rewards() -> None:
    all_wrong = scores([0.25, 0.5], [{"correct": 0.0}, {"correct": 0.0}])
    assert zero_variance(all_wrong) and not dynamic_sampling(all_wrong)  # rewards vary, nobody right
    for rewards in ([0.0, 1.0], [1.0, 1.0], [0.0, 0.0], [1.0, 0.0, 1.0]):
        binary = scores(rewards, [{"correct": r} for r in rewards])
        assert zero_variance(binary) == dynamic_sampling(binary)
    one_lacks_it = scores([1.0, 0.0], [{"correct": 1.0}, {}])
    assert dynamic_sampling(one_lacks_it)  # judged by its rewards


def test_a_groups_scores_come_from_its_trajectories() -> None:
    stopped = common_pb2.Trajectory(
        reward=1.0, response_token_ids=[4, 5], finish_reason=common_pb2.FINISH_REASON_STOP
    )
    stopped.reward_components["correct"] = 1.0
    cut = common_pb2.Trajectory(
        reward=0.0, response_token_ids=[4, 5, 6], finish_reason=common_pb2.FINISH_REASON_LENGTH
    )
    group = GroupScores.of([stopped, cut])
    assert group == GroupScores((1.0, 0.0), ({"correct": 1.0}, {}), (2, 3), (False, True))


def test_filters_apply_in_order_and_the_first_to_drop_is_named() -> None:
    filters = chosen_filters(
        [GroupFilterConfig(type=PLUGIN, at_least=0.5), GroupFilterConfig(type="zero_variance")]  # type: ignore[call-arg]
    )
    assert [f.label for f in filters] == [PLUGIN, "zero_variance"]
    assert first_to_drop(filters, scores([0.0, 0.0])) == PLUGIN  # both would drop it: the first counts
    assert first_to_drop(filters, scores([1.0, 1.0])) == "zero_variance"
    assert first_to_drop(filters, scores([1.0, 0.0])) is None
    strict = chosen_filters([GroupFilterConfig(type=PLUGIN, at_least=0.9)])  # type: ignore[call-arg]
    assert first_to_drop(strict, scores([1.0, 0.0])) == PLUGIN  # the option reached it
    assert first_to_drop([], scores([0.0, 0.0])) is None


def test_a_filter_must_say_keep_or_drop() -> None:
    [broken] = chosen_filters([GroupFilterConfig(type="tests.plugins.filters:not_a_verdict")])
    with pytest.raises(TypeError, match=r"returned 0\.5, not a bool"):
        first_to_drop([broken], scores([1.0, 0.0]))


def test_a_users_filter_and_its_options_are_checked_where_it_runs() -> None:
    with pytest.raises(PluginError, match=r"cannot import 'tests\.plugins\.nothing'"):
        chosen_filters([GroupFilterConfig(type="tests.plugins.nothing:keep")])
    with pytest.raises(PluginError, match="may not come from the standard library"):
        chosen_filters([GroupFilterConfig(type="os:system")])
    with pytest.raises(ValueError, match=r"algorithm.filters.0 \(tests.*\): it declares no option most"):
        chosen_filters([GroupFilterConfig(type=PLUGIN, most=1)])  # type: ignore[call-arg]


def test_the_jobspec_checks_the_builtins_options_and_the_filters_names() -> None:
    spec = parse_job_spec({"algorithm": {"filters": [{"type": "dynamic_sampling", "accuracy": "exact"}]}})
    assert spec.algorithm.filters[0].options == {"accuracy": "exact"}
    with pytest.raises(
        JobSpecError, match=r"algorithm\.filters\.0: .*zero_variance takes no option accuracy"
    ):
        parse_job_spec({"algorithm": {"filters": [{"type": "zero_variance", "accuracy": "exact"}]}})
    with pytest.raises(JobSpecError, match=r"algorithm\.filters\.0\.type: .*or a user's module:function"):
        parse_job_spec({"algorithm": {"filters": [{"type": "dynamic"}]}})
    with pytest.raises(JobSpecError, match=r"algorithm\.filters\.0: .*option 'accuracy' must be a string"):
        parse_job_spec({"algorithm": {"filters": [{"type": "dynamic_sampling", "accuracy": ["a"]}]}})
    with pytest.raises(JobSpecError, match=r"algorithm\.oversample: .*set filters"):
        parse_job_spec({"algorithm": {"oversample": 0.5}})
