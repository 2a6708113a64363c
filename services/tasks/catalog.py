"""The built-in tasks, the ``builtin`` data source that reads them, and ``builtin:<name>`` model paths.

A task is a named source of prompts with reference answers, the reward verifier
that scores a response against an answer, and optionally the base model verst
builds for it. ``TASKS`` lists them: ``addition`` (``addition.py``), ``multiply``
(``multiply.py``, a multi-turn task solved with the python tool) and ``reverse``
(``reverse.py``, string reversal with a 5.1M-parameter base model and partial credit).
``builtin:<task>`` in a JobSpec's ``data.train`` / ``data.eval`` is the data source
``builtin`` (registered by path in services/data/sources.py) given ``<task>``;
``builtin:<name>`` in its ``model.path`` and the verifier names in the reward service
also resolve through ``TASKS``.

Importing this module imports no torch: a base model's builder is imported when a
build is needed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from services.data import DataError, PromptExample, SourceRequest, check_options
from services.tasks.addition import (
    WarmupRecipe,
    addition_eval_prompts,
    addition_train_prompts,
    score_addition,
)
from services.tasks.models import (
    LOCK_TIMEOUT_S,
    BaseModel,
    ModelPathError,
    Recipe,
    cached_model_paths,
    ensure_model,
    is_built,
)
from services.tasks.multiply import ToolRecipe, multiply_eval_prompts, multiply_train_prompts
from services.tasks.reverse import ReverseRecipe, reverse_eval_prompts, reverse_train_prompts, score_reverse

BUILTIN_PREFIX = "builtin:"
"""Prefix of a model path that names a base model verst builds (``builtin:addition``)."""


@dataclasses.dataclass(frozen=True)
class Task:
    """A built-in task: where its prompts come from, how a response is scored, its base model."""

    name: str
    description: str
    train: Callable[[int], Iterator[PromptExample]]
    """Endless training prompts for a seed; the same seed gives the same sequence."""
    eval: Callable[[], Sequence[PromptExample]]
    """The fixed held-out prompts, disjoint from every training prompt."""
    score: Callable[[str, str], tuple[float, dict[str, float]]]
    """(response_text, answer) -> (reward, named components)."""
    verifier: str
    """The reward service's verifier for a job of this task (``reward.verifier``)."""
    base_model: BaseModel | None = None
    """The model ``builtin:<name>`` that verst builds for this task, if any."""
    accuracy: str = "correct"
    """The score component that is 1.0 exactly when a response is right: held-out accuracy counts it."""

    def is_correct(self, response_text: str, answer: str) -> bool:
        """Whether ``response_text`` is right (``accuracy`` component 1.0), whatever partial credit
        the reward gives."""
        return self.score(response_text, answer)[1][self.accuracy] >= 1.0


def _build_addition_model(name: str, recipe: Any, out_dir: Path, *, progress: bool) -> dict[str, Any]:
    from services.tasks.addition_model import build_addition_model  # torch: only when building

    return build_addition_model(name, recipe, out_dir, progress=progress)


def _build_multiply_model(name: str, recipe: Any, out_dir: Path, *, progress: bool) -> dict[str, Any]:
    from services.tasks.multiply_model import build_tool_model  # torch: only when building

    return build_tool_model(name, recipe, out_dir, progress=progress)


def _build_reverse_model(name: str, recipe: Any, out_dir: Path, *, progress: bool) -> dict[str, Any]:
    from services.tasks.reverse_model import build_reverse_model  # torch: only when building

    return build_reverse_model(name, recipe, out_dir, progress=progress)


TASKS: dict[str, Task] = {
    "addition": Task(
        name="addition",
        description="two-digit addition, answer written least-significant digit first",
        train=addition_train_prompts,
        eval=addition_eval_prompts,
        score=score_addition,
        verifier="addition",
        base_model=BaseModel(WarmupRecipe(), _build_addition_model, summary=("eval_greedy_accuracy",)),
    ),
    "multiply": Task(
        name="multiply",
        description=(
            "3-digit by 3-digit multiplication, the exact product as the answer; a multi-turn task "
            "(rollout.max_turns > 1) meant to be solved with the python tool"
        ),
        train=multiply_train_prompts,
        eval=multiply_eval_prompts,
        score=score_addition,  # the same rule: the stripped response is exactly the answer's digits
        verifier="multiply",  # reads the episode's tool-call counts too (reward/task_verifiers.py)
        base_model=BaseModel(
            ToolRecipe(),
            _build_multiply_model,
            summary=("sampled_tool_call_rate", "copy_accuracy", "simulated_reward"),
        ),
    ),
    "reverse": Task(
        name="reverse",
        description=(
            "8-16 lowercase letters, answered reversed; partial credit (the share of positions right), "
            "held-out accuracy is exact match"
        ),
        train=reverse_train_prompts,
        eval=reverse_eval_prompts,
        score=score_reverse,
        verifier="reverse",
        base_model=BaseModel(
            ReverseRecipe(), _build_reverse_model, summary=("eval_exact_match", "eval_positions")
        ),
        accuracy="exact",
    ),
}


def get_task(name: str) -> Task:
    """The task called ``name``; raises ``DataError`` listing the known ones."""
    try:
        return TASKS[name]
    except KeyError:
        raise DataError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}") from None


# --- the `builtin` data source ----------------------------------------------------------------


def builtin_source(request: SourceRequest) -> Iterator[PromptExample] | Sequence[PromptExample]:
    """The data source ``builtin`` (endless): task ``request.location``'s endless training prompts
    for the seed, or its fixed held-out ones; ``DataError`` naming the known tasks otherwise."""
    check_options(request, "builtin")
    task = get_task(request.location)
    return task.train(request.seed) if request.split == "train" else task.eval()


# --- a JobSpec's model path ---------------------------------------------------------------------


def builtin_model(name: str) -> BaseModel:
    """The base model of task ``name``; raises ``ModelPathError`` listing the known ones."""
    task = TASKS.get(name)
    if task is None or task.base_model is None:
        known = ", ".join(f"{BUILTIN_PREFIX}{n}" for n, t in sorted(TASKS.items()) if t.base_model)
        raise ModelPathError(f"unknown builtin model {name!r}; known: {known}")
    return task.base_model


def ensure_builtin_model(
    name: str = "addition",
    cache_dir: Path | None = None,
    *,
    recipe: Recipe | None = None,
    progress: bool = True,
    lock_timeout_s: float = LOCK_TIMEOUT_S,
) -> Path:
    """The directory of builtin model ``name``, building it first when the cache lacks it.

    ``recipe`` overrides the registered one (tests use a tiny recipe). Safe to call
    from several processes at once (``models.ensure_model``).
    """
    model = builtin_model(name)
    if recipe is not None:
        model = dataclasses.replace(model, recipe=recipe)
    return ensure_model(name, model, cache_dir, progress=progress, lock_timeout_s=lock_timeout_s)


def built_model_dir(name: str) -> Path | None:
    """The directory of builtin model ``name`` when the cache holds a finished build, else None;
    never builds. Raises ``ModelPathError`` for an unknown name."""
    model = builtin_model(name)
    model_dir, _ = cached_model_paths(name, model.recipe)
    return model_dir if is_built(model_dir, model.recipe.digest(name)) else None
