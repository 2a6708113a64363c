"""The tasks of the race in bench/e2e.py, by name: which built-in task and base model verst prepares
for it, and the hyper-parameters the race uses unless told otherwise.

A task's prompts, held-out split and scorer are the project's own (``services.tasks``): both sides
train on the same prompts in the same order and are scored by the same function. Adding a task is
one entry in ``BENCH_TASKS`` once its catalog task and builtin model exist.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class BenchTask:
    """One task of the race: a built-in task of the catalog, its base model and its defaults."""

    name: str
    bound: str
    """What limits a step: "overhead" (tiny model, short answers) or "compute"."""
    model: str
    """The base model as a JobSpec names it (``builtin:<name>``)."""
    data: str
    """The prompts as a JobSpec names them (``builtin:<task>``)."""
    verifier: str
    """The reward service's verifier of the task (verst's ``reward.verifier``)."""
    hyper: Mapping[str, float]
    """The race's hyper-parameters on this task: bench/e2e_runs.py's ``Hyper`` fields but the task,
    model and seed, each of which a flag of bench/e2e.py may override."""
    target: float
    """Held-out greedy accuracy both sides race to (the catalog task's ``accuracy`` component:
    exact match, also where the reward gives partial credit)."""
    eval_prompts: int = 200
    """Held-out prompts per evaluation."""

    @property
    def catalog_name(self) -> str:
        return self.data.removeprefix("builtin:")

    def model_dir(self) -> Path:
        """The base model's directory, built once and cached by verst."""
        from services.models import resolve_model_path

        return Path(resolve_model_path(self.model))

    def train_examples(self, seed: int, count: int) -> list[Any]:
        """The first ``count`` training prompts of ``seed``: those a job with that seed is fed, in order."""
        from services.tasks import get_task

        stream = get_task(self.catalog_name).train(seed)
        return [next(stream) for _ in range(count)]

    def eval_examples(self, count: int) -> list[Any]:
        """The first ``count`` prompts of the held-out split."""
        from services.tasks import get_task

        return list(get_task(self.catalog_name).eval())[:count]

    def scorer(self) -> Callable[[str, str], float]:
        """(response text, answer) -> reward: the task's own scorer, the one verst's verifier runs."""
        from services.tasks import get_task

        score = get_task(self.catalog_name).score
        return lambda text, answer: float(score(text, answer)[0])

    def correct(self) -> Callable[[str, str], bool]:
        """(response text, answer) -> whether it is right: what held-out accuracy counts (exact
        match on reverse, whose reward gives partial credit; the reward at 1.0 on addition)."""
        from services.tasks import get_task

        return get_task(self.catalog_name).is_correct


BENCH_TASKS: dict[str, BenchTask] = {
    "addition": BenchTask(
        name="addition",
        bound="overhead",
        model="builtin:addition",
        data="builtin:addition",
        verifier="addition",
        # the demo's job (examples/addition.yaml): 16 prompts x 8 samples, lr 1e-4, clip 0.2 / 0.28
        hyper={
            "group_size": 8,
            "prompts_per_step": 16,
            "max_new_tokens": 8,
            "learning_rate": 1e-4,
            "clip_low": 0.2,
            "clip_high": 0.28,
            "max_steps": 60,
            "eval_every": 2,
        },
        # the base model starts at 0.275 and passes 0.6 within 5-10 steps; 0.8 takes 20-25
        target=0.8,
    ),
    "reverse": BenchTask(
        name="reverse",
        bound="compute",
        model="builtin:reverse",
        data="builtin:reverse",
        verifier="reverse",
        # the measurement of (b): group 8, 16 prompts per step, lr 1e-4, answers up to 20 tokens
        hyper={
            "group_size": 8,
            "prompts_per_step": 16,
            "max_new_tokens": 20,
            "learning_rate": 1e-4,
            "clip_low": 0.2,
            "clip_high": 0.28,
            "max_steps": 120,
            "eval_every": 5,
        },
        # held-out exact match: the base model's is 0.36 (services/tasks/reverse.py); both sides dipped to
        # 0.20-0.26 at step 5 and were back at 0.29-0.30 at step 10 (one 10-step pair, busy machine);
        # bench/staleness.py --task reverse --lag 1 reached 0.42 at step 20
        target=0.5,
        eval_prompts=500,
    ),
}
"""Bench task name -> task: the overhead-bound ``addition`` (a 0.5M-parameter model, answers of 2-3
tokens) and the compute-bound ``reverse`` (5.1M parameters, answers of 8-16 tokens plus EOS)."""


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """A prompt's token ids as every verst component encodes them (BOS, then the text's tokens)."""
    from services.data import encode_prompt as encode

    return encode(tokenizer, text)


def get_bench_task(name: str) -> BenchTask:
    try:
        return BENCH_TASKS[name]
    except KeyError:
        raise SystemExit(f"unknown task {name!r}; known: {', '.join(sorted(BENCH_TASKS))}") from None
