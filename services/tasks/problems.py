"""What the synthetic tasks share: a fixed held-out split and an endless training stream that
never repeats a held-out problem, each numbered as PromptExamples.

A task draws a problem from a ``random.Random``; ``held_out_problems`` takes the first distinct
ones of fixed seeds, ``training_problems`` draws from the job's seed and skips those.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Protocol, TypeVar

from services.data import PromptExample


class Problem(Protocol):
    """A generated problem of a built-in task."""

    @property
    def prompt(self) -> str: ...

    @property
    def answer(self) -> str: ...


ProblemT = TypeVar("ProblemT", bound=Hashable)


def held_out_problems(
    draw: Callable[[random.Random], ProblemT], seed_base: int, size: int
) -> tuple[ProblemT, ...]:
    """The first ``size`` distinct problems drawn from ``random.Random(seed_base + i)``, i = 0, 1, …"""
    problems: dict[ProblemT, None] = {}  # an ordered set
    seed = seed_base
    while len(problems) < size:
        problems.setdefault(draw(random.Random(seed)))
        seed += 1
    return tuple(problems)


def training_problems(
    draw: Callable[[random.Random], ProblemT], held_out: Iterable[ProblemT], seed: int
) -> Iterator[ProblemT]:
    """Endless problems from one RNG stream seeded with ``seed``, never one of ``held_out``."""
    excluded = frozenset(held_out)
    rng = random.Random(seed)
    while True:
        problem = draw(rng)
        if problem not in excluded:
            yield problem


def numbered_prompts(id_prefix: str, problems: Iterable[Problem]) -> Iterator[PromptExample]:
    """Each problem as a PromptExample with id ``"{id_prefix}:{index}"``."""
    for index, problem in enumerate(problems):
        yield PromptExample(f"{id_prefix}:{index}", problem.prompt, problem.answer)
