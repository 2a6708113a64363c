"""Verifiers: named functions that score one response against a reference answer.

A verifier is ``(response_text, answer, metadata) -> (reward, components, info)``:
the scalar reward, its named parts, and free-form strings worth showing (the
parsed answer, say). It raises on input it cannot judge; the reward service
turns the exception into ``ScoreResponse.error``, never into a silent zero.

The registry (``VERIFIER_REGISTRY``; ``builtin_verifiers`` builds its verifiers):

- every built-in task of ``services.tasks.catalog`` under its own name (``"addition"``),
  and the task verifiers that read an episode's metadata (``task_verifiers.py``);
- ``exact_match``: the stripped response equals the stripped answer;
- ``numeric``: the last number of the response is within a relative or absolute
  tolerance of the answer's number;
- ``math``: math-verify's symbolic comparison (``math_verifier.py``);
- ``code``: the fraction of the task's unit tests the response's program passes in the
  sandbox (``code_verifier.py``);
- ``reasoning_gym``: a row of the ``reasoning_gym`` data source scored by its dataset's own
  ``score_answer`` (``reasoning_gym_verifier.py``).

``numeric``, ``math`` and ``code`` are ``configurable``: registered as a function of the
service's ``VerifierOptions`` that makes the verifier.

User reward functions are not registered here: a ScoreRequest names one as
``module:function`` (``plugins.py``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from services.common.registry import Entry, Registry
from services.reward.code_verifier import CodeVerifier
from services.reward.math_verifier import MathVerifier
from services.reward.reasoning_gym_verifier import ReasoningGymVerifier
from services.reward.sandbox import SandboxConfig
from services.reward.task_verifiers import TASK_VERIFIERS
from services.tasks import TASKS, Task

VerifierResult = tuple[float, dict[str, float], dict[str, str]]
"""(reward, components, info)."""
Verifier = Callable[[str, str, Mapping[str, str]], VerifierResult]
"""(response_text, answer, metadata) -> VerifierResult."""

NUMBER = re.compile(
    r"(?<![\w.])[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?(?:\s*/\s*\d+(?!\.?\d))?"
    r"|(?<![\w.])[-+]?\.\d+(?:[eE][-+]?\d+)?"
)
"""A number as answers write it: ``-12``, ``3.5``, ``1,234.5``, ``.5``, ``6.02e23``, ``3/4``."""


@dataclass(frozen=True, slots=True)
class VerifierEntry(Entry[Callable[..., Any]]):
    """A registered verifier: ``fn`` is the ``Verifier``, or with ``configurable`` a function of
    the ``VerifierOptions`` that makes it."""

    configurable: bool = False
    """``fn(options)`` makes the verifier, so its settings come from the service."""
    quick: bool = False
    """A pure-Python check of microseconds: a batch's items run one after another in one
    pool job rather than one thread hop each (which cost more than the check)."""

    def build(self, options: VerifierOptions) -> Verifier:
        """The verifier, configured by ``options`` when it is configurable."""
        return self.fn(options) if self.configurable else self.fn


VERIFIER_REGISTRY: Registry[VerifierEntry] = Registry(
    VerifierEntry, kind="verifier", field="reward.verifier", owner="reward service"
)
"""Every built-in verifier by the name a ScoreRequest (``reward.verifier``) uses."""


@VERIFIER_REGISTRY.register("exact_match", quick=True)
def exact_match(response_text: str, answer: str, metadata: Mapping[str, str]) -> VerifierResult:
    """Reward 1.0 iff the response equals the answer, both stripped of surrounding whitespace."""
    response = response_text.strip()
    correct = float(response == answer.strip())
    return correct, {"correct": correct}, {"parsed": response}


def last_number(text: str) -> tuple[float, str] | None:
    """The value and the text of the last number in ``text``; None when it has none."""
    matches = NUMBER.findall(text)
    if not matches:
        return None
    shown = matches[-1]
    number, _, denominator = shown.replace(",", "").replace(" ", "").partition("/")
    value = float(number) / float(denominator) if denominator else float(number)
    return value, shown


@dataclass(frozen=True)
class NumericVerifier:
    """The ``numeric`` verifier: reward 1.0 iff the response's last number is within
    ``rel_tol`` (relative to the larger magnitude) or ``abs_tol`` of the answer's number, as
    ``math.isclose`` has it. Components: ``correct``, ``parsed`` (the response has a number).
    An answer without a number raises."""

    rel_tol: float = 1e-6
    abs_tol: float = 1e-9

    def __call__(self, response_text: str, answer: str, metadata: Mapping[str, str]) -> VerifierResult:
        expected = last_number(answer)
        if expected is None:
            raise ValueError(f"the answer {answer!r:.100} has no number")
        got = last_number(response_text)
        if got is None:
            return 0.0, {"correct": 0.0, "parsed": 0.0}, {"parsed": ""}
        correct = float(math.isclose(got[0], expected[0], rel_tol=self.rel_tol, abs_tol=self.abs_tol))
        info = {"parsed": got[1], "abs_error": f"{abs(got[0] - expected[0]):.6g}"}
        return correct, {"correct": correct, "parsed": 1.0}, info


def task_verifier(task: Task) -> Verifier:
    """A verifier that scores with ``task.score``; ``info`` holds the stripped response."""

    def verify(response_text: str, answer: str, metadata: Mapping[str, str]) -> VerifierResult:
        reward, components = task.score(response_text, answer)
        return reward, components, {"parsed": response_text.strip()}

    verify.__name__ = f"verify_{task.name}"
    verify.__doc__ = f"The {task.name!r} task's verifier: {task.description}."
    return verify


@dataclass(frozen=True)
class VerifierOptions:
    """What the configurable verifiers need; the service fills it from its settings."""

    numeric_rel_tol: float = 1e-6
    """``numeric``: relative tolerance."""
    numeric_abs_tol: float = 1e-9
    """``numeric``: absolute tolerance."""
    math_workers: int = 2
    """``math``: checks at once, one worker process each."""
    math_timeout_s: float = 5.0
    """``math``: time for one parse and comparison."""
    code_test_timeout_s: float = 2.0
    """``code``: time for one test."""
    code_timeout_s: float = 8.0
    """``code``: wall time of the whole sandbox call."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """``code``: how its sandboxes are made."""


@VERIFIER_REGISTRY.register("numeric", configurable=True, quick=True)
def make_numeric_verifier(options: VerifierOptions) -> Verifier:
    """The ``numeric`` verifier with the service's tolerances."""
    return NumericVerifier(options.numeric_rel_tol, options.numeric_abs_tol)


@VERIFIER_REGISTRY.register("math", configurable=True)
def make_math_verifier(options: VerifierOptions) -> Verifier:
    """The ``math`` verifier with the service's workers and timeout."""
    return MathVerifier(options.math_workers, options.math_timeout_s)


@VERIFIER_REGISTRY.register("code", configurable=True)
def make_code_verifier(options: VerifierOptions) -> Verifier:
    """The ``code`` verifier with the service's sandbox and timeouts."""
    return CodeVerifier(
        options.sandbox, test_timeout_s=options.code_test_timeout_s, timeout_s=options.code_timeout_s
    )


VERIFIER_REGISTRY.register("reasoning_gym")(ReasoningGymVerifier(last_number))


def _register_tasks() -> None:
    """Every built-in task's verifier under the name the task declares; a task verifier that
    reads the episode's metadata (``task_verifiers.py``) takes the place of the generic one."""
    for task in TASKS.values():
        if task.verifier not in TASK_VERIFIERS:
            VERIFIER_REGISTRY.register(task.verifier, quick=True)(task_verifier(task))
    for name, verify in TASK_VERIFIERS.items():
        VERIFIER_REGISTRY.register(name, quick=True)(verify)


_register_tasks()


def builtin_verifiers(options: VerifierOptions | None = None) -> dict[str, Verifier]:
    """Every built-in verifier by name. Nothing starts here: ``math`` starts its worker
    processes and ``code`` its sandboxes on first use."""
    options = options if options is not None else VerifierOptions()
    return {entry.name: entry.build(options) for entry in VERIFIER_REGISTRY}


def quick_verifiers() -> frozenset[str]:
    """The names of the built-in verifiers whose checks take microseconds (``quick``)."""
    return frozenset(entry.name for entry in VERIFIER_REGISTRY if entry.quick)


VERIFIERS: Mapping[str, Verifier] = builtin_verifiers()
"""The registry's verifiers with default options: its names are the verifiers a setting may name."""
