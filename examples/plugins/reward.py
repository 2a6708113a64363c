"""A reward function of one's own, scored inside verst's reward service.

    reward:
      plugin: examples.plugins.reward:close_enough

The contract (services/reward/plugins.py): a function of the whole ScoreRequest (response and
prompt text and token ids, the reference answer, metadata, number of turns) returning the reward,
or ``{"reward": ..., "components": {...}, "info": {...}}``; sync functions run on the service's
verifier threads, async ones on its event loop. An exception, or anything but a number, scores 0
with ``ScoreResponse.error`` saying why, so a broken function never passes as a silent zero.
"""

from __future__ import annotations

import re

from services.common.pb import reward_pb2

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
"""The first number in a response is its answer."""


def close_enough(request: reward_pb2.ScoreRequest) -> dict[str, object]:
    """1 for the exact number, partial credit 1 / (1 + relative error) otherwise, 0 for no number."""
    found = NUMBER.search(request.response_text)
    if found is None:
        return {"reward": 0.0, "components": {"parsed": 0.0}, "info": {"why": "no number"}}
    got, want = float(found.group()), float(request.answer)
    error = abs(got - want) / max(1.0, abs(want))
    return {
        "reward": 1.0 if got == want else 1.0 / (1.0 + error),
        "components": {"parsed": 1.0, "exact": float(got == want)},
        "info": {"parsed": found.group()},
    }
