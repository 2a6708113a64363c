"""Verifiers of built-in tasks that read more than the answer: the episode a response ended.

``multiply`` scores a multi-turn episode (``services.runner.episode``): the runner sends
the last turn's text as the response, and the episode's counts in the metadata
(``tool_calls``, ``tool_errors``, as decimal strings). The reward is the answer alone
(a tool call is worth nothing by itself: it pays only through the right answer it leads
to); the components also say whether the episode used the tool, so a job's reward
components show both.

This module imports nothing from ``verifiers.py`` (which registers it), so either can be
imported first.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

from services.tasks import get_task

TaskVerifierResult = tuple[float, dict[str, float], dict[str, str]]
"""(reward, components, info), as ``verifiers.VerifierResult``."""
_COUNT = re.compile(r"[0-9]+")


def _count(metadata: Mapping[str, str], key: str) -> int:
    """A count the runner put in the metadata; 0 when absent (a single-turn response)."""
    value = metadata.get(key, "").strip()
    if not value:
        return 0
    if _COUNT.fullmatch(value) is None:
        raise ValueError(f"metadata {key!r} must be a non-negative integer, got {value!r}")
    return int(value)


def verify_multiply(response_text: str, answer: str, metadata: Mapping[str, str]) -> TaskVerifierResult:
    """Reward 1.0 iff the final answer is exactly the product.

    Components: ``correct``, ``format`` (the answer is a run of digits), ``used_tool`` (the
    episode ran at least one tool call) and ``tool_errors`` (calls that failed or were
    malformed). Raises on malformed counts rather than guessing.
    """
    reward, components = get_task("multiply").score(response_text, answer)
    calls = _count(metadata, "tool_calls")
    errors = _count(metadata, "tool_errors")
    components = {**components, "used_tool": float(calls > 0), "tool_errors": float(errors)}
    return reward, components, {"parsed": response_text.strip(), "tool_calls": str(calls)}


TASK_VERIFIERS: dict[str, Callable[[str, str, Mapping[str, str]], TaskVerifierResult]] = {
    "multiply": verify_multiply,
}
"""Registered by ``verifiers.builtin_verifiers`` over the generic per-task verifiers."""
