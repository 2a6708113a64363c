"""The runner's reward shaping stage: a job's ``reward.shaping`` applied to each scored group.

After the strategy returned the group's scored Trajectories and before they are published, each
trajectory's ``verifier_reward`` is set to the reward it came back with, and the shapings run in
order, each on the rewards the one before returned (the contract, ``RewardShaping``, and the
built-ins are in services/common/shaping.py). A sample whose scoring failed keeps reward 0.

A shaping that cannot be loaded, whose options do not fit, that raises or returns something
other than one finite reward per sample fails its task with ``InvalidTaskError`` naming the
entry (``reward.shaping.1``): the same function fails every retry alike, so the task is
dead-lettered, and the controller fails the job when every task is refused alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from services.common.config import RewardShapingConfig
from services.common.job_tokenizer import decode_texts
from services.common.pb import common_pb2
from services.common.plugins import PluginError
from services.common.shaping import (
    REWARD_SHAPINGS,
    RewardShapingEntry,
    ShapingGroup,
    check_shaping_options,
)
from services.runner.group import InvalidTaskError
from services.runner.spliced import head


@dataclass(frozen=True, slots=True)
class Shaping:
    """One loaded ``reward.shaping`` entry."""

    field: str
    """Where the JobSpec names it (``reward.shaping.0``), for errors."""
    entry: RewardShapingEntry
    options: dict[str, Any]
    """Its keyword arguments, validated by the entry's options model when it has one."""


def load_shapings(configs: Sequence[RewardShapingConfig]) -> list[Shaping]:
    """The job's shapings, a user's imported on first use; ``InvalidTaskError`` naming the entry
    when one cannot be loaded or its options do not fit."""
    shapings = []
    for position, config in enumerate(configs):
        field = f"reward.shaping.{position}"
        try:
            entry = REWARD_SHAPINGS.resolve(config.type)
            options = check_shaping_options(entry, config.options)
        except PluginError as err:  # names the path and why it cannot be loaded
            raise InvalidTaskError(f"{field}: {err}") from None
        except Exception as err:  # a module that fails as it is imported fails every task alike
            raise InvalidTaskError(f"{field} {config.type!r} cannot be loaded: {err}") from None
        shapings.append(Shaping(field, entry, options))
    return shapings


def shape_rewards(
    trajectories: list[common_pb2.Trajectory],
    shapings: Sequence[Shaping],
    task: common_pb2.PromptTask,
    *,
    max_new_tokens: int,
    tokenizer: Any,
) -> None:
    """Keep each trajectory's reward as its ``verifier_reward``, then set its ``reward`` to what
    the shapings make of the group's rewards (in place)."""
    ordered = sorted(trajectories, key=lambda t: head(t).sample_index)
    for fields in map(head, ordered):
        fields.verifier_reward = fields.reward
    if not shapings:
        return
    texts: tuple[str, ...] = ()
    if any(shaping.entry.needs_texts for shaping in shapings):  # decoding costs: only on request
        texts = tuple(decode_texts(tokenizer, [t.response_token_ids for t in ordered]))
    rewards = tuple(t.reward for t in ordered)
    for shaping in shapings:
        group = ShapingGroup(
            rewards=rewards,
            verifier_rewards=tuple(t.verifier_reward for t in ordered),
            response_lengths=tuple(len(t.response_token_ids) for t in ordered),
            finish_reasons=tuple(int(t.finish_reason) for t in ordered),
            max_new_tokens=max_new_tokens,
            prompt_text=task.prompt_text,
            answer=task.answer,
            texts=texts if shaping.entry.needs_texts else (),
        )
        rewards = _apply(shaping, group)
    for trajectory, reward in zip(ordered, rewards, strict=True):
        trajectory.reward = 0.0 if trajectory.reward_error else reward


def _apply(shaping: Shaping, group: ShapingGroup) -> tuple[float, ...]:
    """The rewards ``shaping`` returns for ``group``; ``InvalidTaskError`` naming it when it
    raises or returns anything but one finite number per sample."""
    what = f"{shaping.field} {shaping.entry.name!r}"
    try:
        shaped = tuple(float(reward) for reward in shaping.entry.fn(group, **shaping.options))
    except Exception as err:  # a user's function: its failure is its task's, said in its words
        raise InvalidTaskError(f"{what} failed: {err!r}") from None
    if len(shaped) != len(group.rewards):
        raise InvalidTaskError(f"{what} returned {len(shaped)} rewards for {len(group.rewards)} samples")
    if not all(math.isfinite(reward) for reward in shaped):
        raise InvalidTaskError(f"{what} returned a reward that is not finite: {list(shaped)}")
    return shaped
