"""bench/ceiling.py's pure parts: the floor of a step, the ceiling, and the trajectories it trains on."""

from __future__ import annotations

import math

import pytest

from bench.ceiling import Floor, ceiling, trajectories
from services.common.pb import common_pb2
from services.rollout.engine_protocol import Completion


def test_the_floor_spreads_both_shares_over_the_cores() -> None:
    floor = Floor(engine_s=0.4, trainer_s=1.2, samples=128, response_tokens=1600)
    assert floor.step_s(2) == pytest.approx(0.8)
    assert floor.step_s(1) == pytest.approx(1.6)
    assert ceiling(1.9, floor.step_s(2)) == pytest.approx(1.9 / 0.8)
    assert math.isnan(ceiling(1.9, 0.0))


def test_trajectories_keep_groups_samples_and_rewards_in_order() -> None:
    length = common_pb2.FINISH_REASON_LENGTH
    groups = [
        [
            Completion(0, [5, 6, 2], [-0.1, -0.2, -0.3], [0, 0, 0], length),
            Completion(1, [7], [-0.5], [0], length),
        ],
        [Completion(0, [8, 9], [-1.0, -2.0], [0, 0], length)],
    ]
    built = trajectories([[1, 3], [1, 4]], groups, [[1.0, 0.25], [0.5]])
    assert [[t.id for t in group] for group in built] == [["g0:0", "g0:1"], ["g1:0"]]
    first = built[0][0]
    assert list(first.prompt_token_ids) == [1, 3]
    assert list(first.response_token_ids) == [5, 6, 2]
    assert list(first.behaviour_logprobs) == pytest.approx([-0.1, -0.2, -0.3])
    assert list(first.loss_mask) == [True, True, True]
    assert list(first.policy_versions) == [0, 0, 0]
    assert [t.reward for group in built for t in group] == [1.0, 0.25, 0.5]
    assert built[1][0].group_id == "g1" and built[0][1].sample_index == 1
    with pytest.raises(ValueError):
        trajectories([[1]], groups, [[1.0, 0.0]])  # a prompt per group
