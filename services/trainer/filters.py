"""Group filters: which complete groups the trainer trains on (``algorithm.filters``).

A filter is a function of one group's scores (``GroupScores``) and its options that says whether
to keep the group (``GroupFilterFn``). The trainer applies the job's filters in order to each
complete group (job.py); a group one of them drops is acked without training, counted under that
filter's name in the step's metrics (``groups_filtered/<type>``) and reported to the controller
(``GroupsDropped.filtered``), which keeps prompts in flight for it (controller/pacing.py).

The built-ins are declared, with their options, in ``services/common/algorithms.py``
(``GROUP_FILTERS``). A user's filter is named ``module:function`` and declares the options it
takes with ``@traits``; the trainer imports it from its own import path::

    from services.common.plugins import traits
    from services.trainer.filters import GroupScores

    @traits(options=("above",))
    def not_too_easy(group: GroupScores, above: float = 0.9) -> bool:
        return sum(group.rewards) / len(group.rewards) <= above

This module imports no torch: the JobSpec reads the built-ins' options from it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from services.common.algorithms import GROUP_FILTERS
from services.common.pb import common_pb2

if TYPE_CHECKING:
    from services.common.algorithm_config import GroupFilterConfig


@dataclass(frozen=True, slots=True)
class GroupScores:
    """What a filter sees of one group: per sample, by sample index."""

    rewards: tuple[float, ...]
    """Each sample's reward."""
    components: tuple[Mapping[str, float], ...]
    """Each sample's named reward components, as its verifier gave them (``correct``, ``exact``...)."""
    response_tokens: tuple[int, ...]
    """Each sample's response length in tokens."""
    truncated: tuple[bool, ...]
    """Whether each sample stopped at the response budget (``rollout.max_new_tokens``)."""

    @classmethod
    def of(cls, trajectories: Sequence[common_pb2.Trajectory]) -> GroupScores:
        return cls(
            rewards=tuple(t.reward for t in trajectories),
            components=tuple(dict(t.reward_components) for t in trajectories),
            response_tokens=tuple(len(t.response_token_ids) for t in trajectories),
            truncated=tuple(t.finish_reason == common_pb2.FINISH_REASON_LENGTH for t in trajectories),
        )


class GroupFilterFn(Protocol):
    """Keep the group (True) or drop it (False); ``options`` are its JobSpec entry's other keys."""

    def __call__(self, group: GroupScores, /, **options: Any) -> bool: ...


def zero_variance(group: GroupScores) -> bool:
    """Keep a group whose rewards are not all equal: with equal rewards every group-relative
    advantage is 0, so the group carries no learning signal."""
    return len(set(group.rewards)) > 1


RIGHT = 1.0
"""A response is right when its accuracy is at least this (verst's verifiers score a right
answer 1.0; DAPO's rule-based reward is 1 for right, -1 for wrong)."""


def dynamic_sampling(group: GroupScores, accuracy: str = "correct") -> bool:
    """DAPO's dynamic sampling (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning
    System at Scale", the constraint 0 < |{o_i | is_equivalent(a, o_i)}| < G of its objective):
    keep a group unless all its responses are right or all are wrong.

    A response's accuracy is its ``accuracy`` reward component (``correct`` for verst's
    verifiers; ``exact`` for the reverse task, whose reward is partial credit); when a sample of
    the group lacks that component, the group is judged by its rewards instead. Either way a
    response is right when the value is >= ``RIGHT``."""
    values = [components.get(accuracy) for components in group.components]
    judged = list(group.rewards) if any(value is None for value in values) else values
    right = sum(1 for value in judged if value is not None and value >= RIGHT)
    return 0 < right < len(judged)


@dataclass(frozen=True, slots=True)
class ChosenFilter:
    """One of a job's filters, its options bound."""

    label: str
    """Its ``type``: the name its drops are counted under."""
    keep: Callable[[GroupScores], bool]


def chosen_filters(configs: Sequence[GroupFilterConfig]) -> list[ChosenFilter]:
    """The job's filters in order, each resolved (a user's imported) with its options bound; a
    ValueError naming the entry when one cannot be had or does not take its options."""
    chosen = []
    for index, config in enumerate(configs):
        entry = GROUP_FILTERS.resolve(config.type)
        options = config.options
        try:
            undeclared = sorted(set(options) - set(entry.options))
            if undeclared:  # the rule the JobSpec applies to the built-ins
                raise TypeError(f"it declares no option {', '.join(undeclared)} (@traits(options=...))")
            inspect.signature(entry.fn).bind(None, **options)
        except TypeError as err:
            raise ValueError(f"algorithm.filters.{index} ({config.type}): {err}") from None
        chosen.append(ChosenFilter(config.type, functools.partial(entry.fn, **options)))
    return chosen


def first_to_drop(filters: Sequence[ChosenFilter], group: GroupScores) -> str | None:
    """The label of the first filter that drops the group; None when every one keeps it."""
    for chosen in filters:
        kept = chosen.keep(group)
        if not isinstance(kept, bool):
            raise TypeError(f"group filter {chosen.label!r} returned {kept!r}, not a bool")
        if not kept:
            return chosen.label
    return None
