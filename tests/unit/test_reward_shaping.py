"""Reward shaping: DAPO's over-long penalty against its formula, the registry and the JobSpec's
checks, and the runner's stage that applies a job's shapings to a scored group."""

from __future__ import annotations

import math
import sys
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest

from services.common.config import JobSpecError, RewardShapingConfig, parse_job_spec
from services.common.pb import common_pb2
from services.common.shaping import REWARD_SHAPINGS, OverlongPenaltyOptions, ShapingGroup, overlong_penalty
from services.runner.group import InvalidTaskError
from services.runner.shaping import load_shapings, shape_rewards

FORMAT_BONUS = "examples.plugins.reward_shaping:format_bonus"


def dapo_r_length(length: int, l_max: int, l_cache: int) -> Fraction:
    """DAPO eq. 13, read off the paper: 0 while |y| <= L_max - L_cache; ((L_max - L_cache) - |y|)
    / L_cache while L_max - L_cache < |y| <= L_max; -1 when L_max < |y| (exact arithmetic)."""
    if length <= l_max - l_cache:
        return Fraction(0)
    if length <= l_max:
        return Fraction((l_max - l_cache) - length, l_cache)
    return Fraction(-1)


def group_of(lengths: list[int], rewards: list[float] | None = None, budget: int = 20) -> ShapingGroup:
    rewards = rewards if rewards is not None else [0.0] * len(lengths)
    return ShapingGroup(
        rewards=tuple(rewards),
        verifier_rewards=tuple(rewards),
        response_lengths=tuple(lengths),
        finish_reasons=(common_pb2.FINISH_REASON_STOP,) * len(lengths),
        max_new_tokens=budget,
    )


@pytest.mark.parametrize(("l_max", "l_cache"), [(20, 8), (16, 16), (4096, 1024), (7, 1)])
def test_the_overlong_penalty_is_dapos_formula(l_max: int, l_cache: int) -> None:
    lengths = list(range(l_max + 4))
    rewards = [1.0 if n % 3 else 0.5 for n in lengths]
    shaped = overlong_penalty(group_of(lengths, rewards), max_tokens=l_max, buffer_tokens=l_cache)
    expected = [r + float(dapo_r_length(n, l_max, l_cache)) for n, r in zip(lengths, rewards, strict=True)]
    assert shaped == pytest.approx(expected, abs=1e-12)


def test_the_overlong_penalty_at_hand_computed_points() -> None:
    """L_max 20, L_cache 8: free up to 12 tokens, then -1/8 per token down to -1 at 20, and -1 past it."""
    lengths = [0, 12, 13, 16, 19, 20, 21, 400]
    shaped = overlong_penalty(group_of(lengths), max_tokens=20, buffer_tokens=8)
    assert shaped == pytest.approx([0.0, 0.0, -0.125, -0.5, -0.875, -1.0, -1.0, -1.0])


def test_max_tokens_defaults_to_the_rollout_budget_and_factor_scales() -> None:
    group = group_of([10, 14, 16, 30], rewards=[1.0, 1.0, 0.0, 1.0], budget=16)
    assert overlong_penalty(group, buffer_tokens=4) == pytest.approx([1.0, 0.5, -1.0, 0.0])
    assert overlong_penalty(group, buffer_tokens=4, factor=0.5) == pytest.approx([1.0, 0.75, -0.5, 0.5])
    with pytest.raises(ValueError, match="buffer_tokens 32 exceeds max_tokens 16"):
        overlong_penalty(group, buffer_tokens=32)


def test_the_registry_has_the_built_in_with_its_traits() -> None:
    entry = REWARD_SHAPINGS.get("overlong_penalty")
    assert REWARD_SHAPINGS.names() == ("overlong_penalty",)
    assert (entry.fn, entry.options, entry.needs_texts) == (overlong_penalty, OverlongPenaltyOptions, False)
    user = REWARD_SHAPINGS.resolve(FORMAT_BONUS)
    assert (user.needs_texts, user.options) == (True, None), "the traits its @traits declared"


def errors_of(data: object) -> dict[str, str]:
    with pytest.raises(JobSpecError) as caught:
        parse_job_spec(data)
    return dict(caught.value.errors)


@pytest.mark.parametrize(
    ("shaping", "path", "says"),
    [
        (
            {"type": "length_bonus"},
            "reward.shaping.0.type",
            "reward.shaping.type 'length_bonus' is not available in this runner (available: overlong_pe",
        ),
        ({"type": "a b:c"}, "reward.shaping.0.type", "is not module:function"),
        (
            {"type": "overlong_penalty"},
            "reward.shaping.0",
            "overlong_penalty options: buffer_tokens: Field required",
        ),
        (
            {"type": "overlong_penalty", "buffer_tokens": 0},
            "reward.shaping.0",
            "buffer_tokens: Input should be greater than or equal to 1",
        ),
        (
            {"type": "overlong_penalty", "buffer_tokens": 9, "max_tokens": 8},
            "reward.shaping.0",
            "buffer_tokens 9 exceeds max_tokens 8",
        ),
        (
            {"type": "overlong_penalty", "buffer_tokens": 4, "cache": 2},
            "reward.shaping.0",
            "cache: Extra inputs are not permitted",
        ),
        ({"type": FORMAT_BONUS, "bonus": [1, 2]}, "reward.shaping.0", "option 'bonus' must be a number"),
        ({"buffer_tokens": 4}, "reward.shaping.0.type", "Field required"),
    ],
)
def test_the_job_spec_rejects_a_shaping_naming_the_field(
    shaping: dict[str, Any], path: str, says: str
) -> None:
    errors = errors_of({"reward": {"shaping": [shaping]}})
    assert set(errors) == {path}, errors
    assert says in errors[path]


def test_the_job_spec_keeps_the_shapings_in_order_with_their_options() -> None:
    spec = parse_job_spec(
        {
            "reward": {
                "shaping": [{"type": "overlong_penalty", "buffer_tokens": 4}, {"type": "mine_x.y:z", "k": 2}]
            }
        }
    )
    assert [(s.type, s.options) for s in spec.reward.shaping] == [
        ("overlong_penalty", {"buffer_tokens": 4}),
        ("mine_x.y:z", {"k": 2}),
    ]
    assert "mine_x" not in sys.modules, "a user's shaping is imported where it runs, not by the JobSpec"
    assert type(spec).model_validate_json(spec.model_dump_json()) == spec


class Decoder:
    """A tokenizer's decode, for the runner's texts: token 7 is "7", token 5 is "x"."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join("7" if i == 7 else "x" for i in ids)


def scored_group(lengths: list[int], rewards: list[float], errors: tuple[int, ...] = ()) -> list[Any]:
    return [
        common_pb2.Trajectory(
            sample_index=i,
            response_token_ids=[7 if i % 2 == 0 else 5] * n,
            reward=0.0 if i in errors else r,
            reward_error="scoring failed" if i in errors else "",
            finish_reason=common_pb2.FINISH_REASON_STOP,
        )
        for i, (n, r) in enumerate(zip(lengths, rewards, strict=True))
    ]


def shape(trajectories: list[Any], *shapings: dict[str, Any], budget: int = 8) -> None:
    configs = [RewardShapingConfig.model_validate(s) for s in shapings]
    task = common_pb2.PromptTask(prompt_id="j:0:0", prompt_text="1+1=", answer="2")
    shape_rewards(trajectories, load_shapings(configs), task, max_new_tokens=budget, tokenizer=Decoder())


def test_the_runner_applies_shapings_in_order_and_keeps_the_verifier_reward() -> None:
    group = scored_group([2, 6, 8, 3], [1.0, 1.0, 0.0, 0.0], errors=(3,))
    shape(group, {"type": "overlong_penalty", "buffer_tokens": 4}, {"type": FORMAT_BONUS, "bonus": 0.25})
    # over-long (free up to 4 of 8 tokens): 0, -0.5, -1, (error); format bonus: the "777..." texts
    assert [t.reward for t in group] == pytest.approx([1.25, 0.5, -0.75, 0.0])
    assert [t.verifier_reward for t in group] == [1.0, 1.0, 0.0, 0.0]
    assert group[3].reward == 0.0 and group[3].reward_error, "a failed score is never shaped into a reward"


def test_without_shapings_the_verifier_reward_is_the_reward() -> None:
    group = scored_group([2, 9], [1.0, 0.5])
    shape(group)
    assert [(t.reward, t.verifier_reward) for t in group] == [(1.0, 1.0), (0.5, 0.5)]


@pytest.fixture
def user_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "user_shapings.py").write_text(
        "import math\n"
        "def short(group, /):\n    return [1.0]\n"
        "def nan(group, /):\n    return [math.nan] * len(group.rewards)\n"
        "def boom(group, /, *, k=1):\n    raise KeyError('k')\n"
        "def texts(group, /):\n    assert group.texts == (), 'texts only when needs_texts'\n"
        "    return group.rewards\n"
    )
    return tmp_path


@pytest.mark.parametrize(
    ("shaping", "says"),
    [
        (
            {"type": "user_shapings:short"},
            "reward.shaping.1 'user_shapings:short' returned 1 rewards for 2 samples",
        ),
        (
            {"type": "user_shapings:nan"},
            "reward.shaping.1 'user_shapings:nan' returned a reward that is not finite",
        ),
        ({"type": "user_shapings:boom"}, "reward.shaping.1 'user_shapings:boom' failed: KeyError('k')"),
        ({"type": "user_shapings:boom", "j": 1}, "failed: TypeError("),
        (
            {"type": "user_shapings:gone"},
            "reward.shaping.1: reward.shaping.type (reward shaping) 'user_shapings:gone'",
        ),
        ({"type": "no_such_shapings:f"}, "cannot import 'no_such_shapings'"),
    ],
)
def test_a_shaping_that_fails_fails_its_task_naming_the_entry(
    user_modules: Path, shaping: dict[str, Any], says: str
) -> None:
    group = scored_group([2, 3], [1.0, 0.0])
    with pytest.raises(InvalidTaskError) as caught:
        shape(group, {"type": "overlong_penalty", "buffer_tokens": 2}, shaping)
    assert says in str(caught.value)


def test_texts_are_decoded_only_for_a_shaping_that_declares_it(user_modules: Path) -> None:
    group = scored_group([1, 1], [0.0, 0.0])
    shape(group, {"type": "user_shapings:texts"}, {"type": FORMAT_BONUS, "bonus": 1.0})
    assert [t.reward for t in group] == [1.0, 0.0], "the bonus read the decoded texts"
    assert all(math.isfinite(t.reward) for t in group)
