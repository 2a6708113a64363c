"""A user's group filter, as ``algorithm.filters`` names it: ``tests.plugins.filters:keep_rewarded``."""

from __future__ import annotations

import statistics

from services.common.plugins import traits
from services.trainer.filters import GroupScores


@traits(options=("at_least",))
def keep_rewarded(group: GroupScores, at_least: float = 0.5) -> bool:
    """Keep a group whose mean reward is at least ``at_least`` (drop the prompts it cannot solve)."""
    return statistics.fmean(group.rewards) >= at_least


def not_a_verdict(group: GroupScores) -> float:
    """A broken filter: it returns a number, not whether to keep the group."""
    return statistics.fmean(group.rewards)
