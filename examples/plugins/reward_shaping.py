"""A reward shaping of one's own: a bonus for answers in the expected format.

    reward:
      shaping:
        - {type: overlong_penalty, buffer_tokens: 16}
        - {type: "examples.plugins.reward_shaping:format_bonus", bonus: 0.1}

Each reward of the group plus ``bonus`` when its response, stripped, is a bare integer. It reads
the responses' texts, so it declares ``needs_texts`` and the runner decodes them for it. The
contract (services/common/shaping.py): a pure function of the ``ShapingGroup`` and its options,
returning one reward per sample, in sample order; the trajectory keeps the verifier's reward
in ``verifier_reward``.
"""

from __future__ import annotations

import re

from services.common.plugins import traits
from services.common.shaping import ShapingGroup

ANSWER = re.compile(r"-?\d+")
"""The expected format: a bare integer."""


@traits(needs_texts=True)
def format_bonus(group: ShapingGroup, /, *, bonus: float = 0.1) -> list[float]:
    """Each reward plus ``bonus`` when its response, stripped, is a bare integer."""
    return [
        reward + (bonus if ANSWER.fullmatch(text.strip()) else 0.0)
        for reward, text in zip(group.rewards, group.texts, strict=True)
    ]
