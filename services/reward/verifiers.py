"""Verifiers: named functions that score one response against a reference answer.

A verifier is ``(response_text, answer, metadata) -> (reward, components, info)``:
the scalar reward, its named parts, and free-form strings worth showing (the
parsed answer, say). It raises on input it cannot judge; the reward service
turns the exception into ``ScoreResponse.error``, never into a silent zero.

Every built-in task of ``services.common.tasks`` is registered under its own
name (``"addition"``), next to the general-purpose ``"exact_match"``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from services.common.tasks import TASKS, Task

VerifierResult = tuple[float, dict[str, float], dict[str, str]]
"""(reward, components, info)."""
Verifier = Callable[[str, str, Mapping[str, str]], VerifierResult]
"""(response_text, answer, metadata) -> VerifierResult."""


def exact_match(response_text: str, answer: str, metadata: Mapping[str, str]) -> VerifierResult:
    """Reward 1.0 iff the response equals the answer, both stripped of surrounding whitespace."""
    response = response_text.strip()
    correct = float(response == answer.strip())
    return correct, {"correct": correct}, {"parsed": response}


def task_verifier(task: Task) -> Verifier:
    """A verifier that scores with ``task.score``; ``info`` holds the stripped response."""

    def verify(response_text: str, answer: str, metadata: Mapping[str, str]) -> VerifierResult:
        reward, components = task.score(response_text, answer)
        return reward, components, {"parsed": response_text.strip()}

    verify.__name__ = f"verify_{task.name}"
    verify.__doc__ = f"The {task.name!r} task's verifier: {task.description}."
    return verify


def builtin_verifiers() -> dict[str, Verifier]:
    """Every built-in verifier by name: one per task, and ``exact_match``."""
    verifiers: dict[str, Verifier] = {name: task_verifier(task) for name, task in TASKS.items()}
    verifiers["exact_match"] = exact_match
    return verifiers


VERIFIERS: Mapping[str, Verifier] = builtin_verifiers()
"""The registry the reward service serves by default."""
