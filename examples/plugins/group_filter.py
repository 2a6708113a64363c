"""A group filter of one's own: keep the groups whose rewards spread wide enough to teach.

    algorithm:
      filters:
        - {type: "examples.plugins.group_filter:spread_at_least", min_spread: 0.5}

A group whose best and worst rewards differ by less than ``min_spread`` is dropped: with a 0/1
verifier and a small shaping bonus on top, that keeps the groups with a right and a wrong answer
and drops those the shaping alone separates (the zero_variance filter would keep them). The
trainer counts the groups it drops under ``groups_filtered/<type>`` and the controller replaces
them. The contract (services/trainer/filters.py): a function of the group's ``GroupScores`` and
its options that says whether to keep the group; ``@traits(options=...)`` names the options.
"""

from __future__ import annotations

from services.common.plugins import traits
from services.trainer.filters import GroupScores


@traits(options=("min_spread",))
def spread_at_least(group: GroupScores, min_spread: float = 0.5) -> bool:
    """Keep the group when its best and worst rewards differ by at least ``min_spread``."""
    return max(group.rewards) - min(group.rewards) >= min_spread
