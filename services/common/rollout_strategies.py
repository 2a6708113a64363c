"""Every rollout strategy a JobSpec may name in ``rollout.strategy``, with its traits: the one list.

A rollout strategy is how the runner turns one PromptTask into its group's scored Trajectories:
``group`` samples the group's n responses in one Generate (single turn, aborted samples resumed),
``tool_episode`` runs one multi-turn episode per sample with tool calls between turns. A user's
own agent loop is named by its ``module:function`` and declares its traits with
``@plugins.traits``. The contract a strategy implements is ``RolloutStrategy`` in
services/runner/strategy.py, documented there.

The implementations live in the runner and are registered here by their dotted path
(``register_lazy``): this module, and the JobSpec that checks names against it, imports neither
the runner nor gRPC.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.common.plugins import PLUGIN_PATH, is_plugin_path
from services.common.registry import Entry, Registry

AUTO = "auto"
"""``rollout.strategy`` that picks ``tool_episode`` when ``rollout.max_turns`` > 1, else ``group``."""
FIELD = "rollout.strategy"


@dataclass(frozen=True, slots=True)
class RolloutStrategyEntry(Entry[Callable[..., Any]]):
    """A rollout strategy (a ``RolloutStrategy`` of services/runner/strategy.py) and what it needs."""

    multi_turn: bool = False
    """Takes several model turns per sample: the job needs rollout.max_turns >= 2."""
    uses_tools: bool = False
    """Runs tool calls through the Tools service between turns (rollout.tools, tool_* settings)."""


ROLLOUT_STRATEGIES: Registry[RolloutStrategyEntry] = Registry(
    RolloutStrategyEntry, kind="rollout strategy", field=FIELD, owner="runner"
)
"""Every built-in strategy by the name ``rollout.strategy`` uses (or a user's ``module:function``)."""
ROLLOUT_STRATEGIES.register_lazy("group", "services.runner.group:roll_out_group")
ROLLOUT_STRATEGIES.register_lazy(
    "tool_episode", "services.runner.episode:roll_out_episodes", multi_turn=True, uses_tools=True
)


def strategy_name(strategy: str, max_turns: int) -> str:
    """The strategy ``rollout.strategy`` stands for: ``auto`` resolved by ``max_turns``, else itself."""
    if strategy != AUTO:
        return strategy
    return "tool_episode" if max_turns > 1 else "group"


def strategy_problem(name: str, multi_turn: bool, max_turns: int) -> str | None:
    """Why strategy ``name`` (of trait ``multi_turn``) cannot run a job of ``max_turns``, or None."""
    if multi_turn and max_turns < 2:
        return f"{name!r} is multi-turn: it needs rollout.max_turns >= 2, not {max_turns}"
    if not multi_turn and max_turns > 1:  # it would silently ignore the turns the job asked for
        return f"{name!r} takes one turn: rollout.max_turns must be 1, not {max_turns}"
    return None


def check_strategy(strategy: str, max_turns: int | None) -> str:
    """``strategy`` when a JobSpec may name it: ``auto``, a built-in that fits ``max_turns`` (None:
    not known, only the name is checked) or a user's ``module:function`` (its traits are checked
    where it runs); a ValueError saying why not otherwise. Built-ins are not imported."""
    name = strategy_name(strategy, max_turns or 1)
    if is_plugin_path(name):
        if PLUGIN_PATH.fullmatch(name) is None:
            raise ValueError(f"{name!r} is not module:function")
        return strategy
    if name not in ROLLOUT_STRATEGIES:
        try:
            ROLLOUT_STRATEGIES.get(name)
        except ValueError as err:
            raise ValueError(f"{err}; or {AUTO!r}, or a module:function of your own") from None
    multi_turn = name in ROLLOUT_STRATEGIES.where(multi_turn=True)
    problem = None if max_turns is None else strategy_problem(name, multi_turn, max_turns)
    if problem is not None:
        raise ValueError(problem)
    return strategy
