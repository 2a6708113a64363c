"""A reward plugin that raises on every call (tests/e2e/test_bad_specs_later.py)."""

from __future__ import annotations

from services.common.pb import reward_pb2


def score(request: reward_pb2.ScoreRequest) -> float:
    raise RuntimeError("the reward plugin always fails")
