"""Prompt sources: built-in synthetic tasks and JSONL files, and the one prompt encoding.

A task is a named source of prompts with reference answers plus the verifier
that scores a response against an answer. ``builtin:<task>`` in a JobSpec's
``data.train`` / ``data.eval`` and the verifier name in the reward service both
resolve through ``TASKS``.

The built-in task ``addition``: prompts ``"{a}+{b}="`` with ``a, b`` uniform in
[10, 99], answered with the sum written least-significant digit first
(``47+85=`` -> ``"231"``). Reversed digits make the carry local to the digit
being written, which is what lets a tiny transformer learn the task in about a
minute on a CPU. The eval split is a fixed set of distinct problems that the
train split never produces.

The built-in task ``multiply``: ``"What is 347*829?"`` with both operands in
[317, 999], answered with the exact product (``"287663"``). It is a multi-turn
task: a tiny model cannot multiply, so it is solved by calling the python tool
and copying the result (``services/tasks/toolmodel.py`` builds such a model).

Everyone encodes a prompt with ``encode_prompt`` so that the controller, the
engines and the trainer agree on the token ids.
"""

from __future__ import annotations

import functools
import json
import random
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from services.common.config import DataConfig

BUILTIN_PREFIX = "builtin:"
"""Prefix of a data source or model path that names something verst provides."""


class DataError(ValueError):
    """A prompt source cannot be read: unknown task, missing file, or a bad JSONL line."""


class PromptTooLongError(ValueError):
    """A prompt encodes to more tokens than allowed (``DataConfig.max_prompt_tokens``)."""


@dataclass(frozen=True, slots=True)
class PromptExample:
    """One prompt and its reference answer. ``prompt_id`` is unique within its source and split."""

    prompt_id: str
    text: str
    answer: str


class PromptTokenizer(Protocol):
    """The part of a Hugging Face tokenizer that ``encode_prompt`` uses."""

    bos_token_id: int | None

    def __call__(self, text: str, *, add_special_tokens: bool) -> Any: ...


def encode_prompt(tokenizer: PromptTokenizer, text: str, *, max_tokens: int | None = None) -> list[int]:
    """Token ids of a prompt: BOS, then the text's tokens without any other special tokens.

    Tokenizers disagree on whether they add BOS themselves; asking for none and
    prepending it here gives every component the same ids for the same text.
    Raises ``PromptTooLongError`` when ``max_tokens`` is given and exceeded.
    """
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if tokenizer.bos_token_id is not None:
        ids.insert(0, int(tokenizer.bos_token_id))
    if max_tokens is not None and len(ids) > max_tokens:
        raise PromptTooLongError(
            f"prompt is {len(ids)} tokens, above the limit of {max_tokens}: {text[:80]!r}"
        )
    return ids


# --- the addition task --------------------------------------------------------------------------

ADDITION_OPERAND_RANGE = (10, 99)
"""Inclusive range of both operands."""
ADDITION_EVAL_SIZE = 1000
"""Distinct problems in the held-out split; the train split excludes all of them."""
ADDITION_EVAL_SEED_BASE = 10_000
"""Eval problem i is drawn from ``random.Random(ADDITION_EVAL_SEED_BASE + i)``."""
_DIGITS = re.compile(r"[0-9]+")


@dataclass(frozen=True, slots=True)
class AdditionProblem:
    """``a + b``, with the prompt text and the reversed-digit answer."""

    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}+{self.b}="

    @property
    def answer(self) -> str:
        return str(self.a + self.b)[::-1]

    @classmethod
    def draw(cls, rng: random.Random) -> AdditionProblem:
        low, high = ADDITION_OPERAND_RANGE
        return cls(rng.randint(low, high), rng.randint(low, high))


@functools.cache
def addition_eval_problems() -> tuple[AdditionProblem, ...]:
    """The held-out split: the first ``ADDITION_EVAL_SIZE`` distinct problems of seeds 10000, 10001, …"""
    problems: dict[AdditionProblem, None] = {}  # an ordered set
    seed = ADDITION_EVAL_SEED_BASE
    while len(problems) < ADDITION_EVAL_SIZE:
        problems.setdefault(AdditionProblem.draw(random.Random(seed)))
        seed += 1
    return tuple(problems)


def addition_train_problems(seed: int) -> Iterator[AdditionProblem]:
    """Endless training problems from one RNG stream, never one of the eval split's problems."""
    held_out = frozenset(addition_eval_problems())
    rng = random.Random(seed)
    while True:
        problem = AdditionProblem.draw(rng)
        if problem not in held_out:
            yield problem


def score_addition(response_text: str, answer: str) -> tuple[float, dict[str, float]]:
    """Reward 1.0 iff the stripped response equals the answer.

    Components: ``correct`` (0/1) and ``format`` (1 when the stripped response
    is a non-empty run of ASCII digits, whatever its value).
    """
    response = response_text.strip()
    correct = response == answer.strip()
    well_formed = _DIGITS.fullmatch(response) is not None
    return float(correct), {"correct": float(correct), "format": float(well_formed)}


def _addition_train(seed: int) -> Iterator[PromptExample]:
    for index, problem in enumerate(addition_train_problems(seed)):
        yield PromptExample(f"addition:train:{index}", problem.prompt, problem.answer)


def _addition_eval() -> list[PromptExample]:
    return [
        PromptExample(f"addition:eval:{index}", problem.prompt, problem.answer)
        for index, problem in enumerate(addition_eval_problems())
    ]


# --- the multiplication task (multi-turn: solved with the python tool) ---------------------------

MULTIPLY_OPERAND_RANGE = (317, 999)
"""Inclusive range of both operands: 3-digit numbers whose product always has 6 digits (317² =
100489), so every answer has the same shape; the product is beyond a tiny model's arithmetic."""
MULTIPLY_EVAL_SIZE = 500
"""Distinct problems in the held-out split; the train split excludes all of them."""
MULTIPLY_EVAL_SEED_BASE = 20_000
"""Eval problem i is drawn from ``random.Random(MULTIPLY_EVAL_SEED_BASE + i)``."""


@dataclass(frozen=True, slots=True)
class MultiplyProblem:
    """``a * b``, asked in words; the answer is the product in ordinary decimal."""

    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"What is {self.a}*{self.b}?"

    @property
    def answer(self) -> str:
        return str(self.a * self.b)

    @classmethod
    def draw(cls, rng: random.Random) -> MultiplyProblem:
        low, high = MULTIPLY_OPERAND_RANGE
        return cls(rng.randint(low, high), rng.randint(low, high))


@functools.cache
def multiply_eval_problems() -> tuple[MultiplyProblem, ...]:
    """The held-out split: the first ``MULTIPLY_EVAL_SIZE`` distinct problems of seeds 20000, 20001, …"""
    problems: dict[MultiplyProblem, None] = {}  # an ordered set
    seed = MULTIPLY_EVAL_SEED_BASE
    while len(problems) < MULTIPLY_EVAL_SIZE:
        problems.setdefault(MultiplyProblem.draw(random.Random(seed)))
        seed += 1
    return tuple(problems)


def multiply_train_problems(seed: int) -> Iterator[MultiplyProblem]:
    """Endless training problems from one RNG stream, never one of the eval split's problems."""
    held_out = frozenset(multiply_eval_problems())
    rng = random.Random(seed)
    while True:
        problem = MultiplyProblem.draw(rng)
        if problem not in held_out:
            yield problem


def _multiply_train(seed: int) -> Iterator[PromptExample]:
    for index, problem in enumerate(multiply_train_problems(seed)):
        yield PromptExample(f"multiply:train:{index}", problem.prompt, problem.answer)


def _multiply_eval() -> list[PromptExample]:
    return [
        PromptExample(f"multiply:eval:{index}", problem.prompt, problem.answer)
        for index, problem in enumerate(multiply_eval_problems())
    ]


# --- the registry -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Task:
    """A built-in task: where its prompts come from and how a response is scored."""

    name: str
    description: str
    train: Callable[[int], Iterator[PromptExample]]
    """Endless training prompts for a seed; the same seed gives the same sequence."""
    eval: Callable[[], Sequence[PromptExample]]
    """The fixed held-out prompts, disjoint from every training prompt."""
    score: Callable[[str, str], tuple[float, dict[str, float]]]
    """(response_text, answer) -> (reward, named components)."""


TASKS: dict[str, Task] = {
    "addition": Task(
        name="addition",
        description="two-digit addition, answer written least-significant digit first",
        train=_addition_train,
        eval=_addition_eval,
        score=score_addition,
    ),
    "multiply": Task(
        name="multiply",
        description=(
            "3-digit by 3-digit multiplication, the exact product as the answer; a multi-turn task "
            "(rollout.max_turns > 1) meant to be solved with the python tool"
        ),
        train=_multiply_train,
        eval=_multiply_eval,
        score=score_addition,  # the same rule: the stripped response is exactly the answer's digits
    ),
}


def get_task(name: str) -> Task:
    """The task called ``name``; raises ``DataError`` listing the known ones."""
    try:
        return TASKS[name]
    except KeyError:
        raise DataError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}") from None


# --- JSONL files --------------------------------------------------------------------------------


def _field_text(record: dict[str, Any], field: str, where: str) -> str:
    if field not in record:
        raise DataError(f"{where}: missing field {field!r} (fields present: {', '.join(sorted(record))})")
    value = record[field]
    # Numbers are accepted for answers written as JSON numbers (e.g. "answer": 132); bool is not one.
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str) or not value:
        raise DataError(f"{where}: field {field!r} must be a non-empty string, got {value!r}")
    return value


def read_jsonl_prompts(
    path: str | Path, prompt_field: str = "prompt", answer_field: str = "answer"
) -> list[PromptExample]:
    """Every record of a JSONL file as a PromptExample (blank lines are skipped).

    ``prompt_id`` is ``"{file name}:{line number}"``. A line that is not a JSON
    object with both fields raises ``DataError`` naming the file and line.
    """
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise DataError(f"cannot read prompts from {path}: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    examples = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{where}: invalid JSON: {err.msg} (column {err.colno})") from None
        if not isinstance(record, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
        prompt = _field_text(record, prompt_field, where)
        answer = _field_text(record, answer_field, where)
        examples.append(PromptExample(f"{path.name}:{number}", prompt, answer))
    if not examples:
        raise DataError(f"{path}: no prompts (the file is empty)")
    return examples


# --- a JobSpec's data section -------------------------------------------------------------------


def builtin_task_name(source: str) -> str | None:
    """``"addition"`` for ``"builtin:addition"``; None for a file path."""
    return source.removeprefix(BUILTIN_PREFIX) if source.startswith(BUILTIN_PREFIX) else None


def train_prompts(data: DataConfig, seed: int) -> Iterator[PromptExample]:
    """Endless training prompts of a job's data section.

    A built-in task samples forever from its train split. A JSONL file is
    repeated epoch after epoch, shuffled each epoch (seeded by ``seed`` and the
    epoch) when ``data.shuffle`` is set. The file is read, and errors raised,
    on this call, not on the first ``next``.
    """
    task_name = builtin_task_name(data.train)
    if task_name is not None:
        return get_task(task_name).train(seed)
    examples = read_jsonl_prompts(data.train, data.prompt_field, data.answer_field)
    return _epochs(examples, seed, data.shuffle)


def _epochs(examples: list[PromptExample], seed: int, shuffle: bool) -> Iterator[PromptExample]:
    epoch = 0
    while True:
        order = list(examples)
        if shuffle:
            random.Random(f"{seed}:{epoch}").shuffle(order)
        yield from order
        epoch += 1


def eval_prompts(data: DataConfig, limit: int | None = None) -> list[PromptExample]:
    """The first ``limit`` (all when None) held-out prompts; empty when ``data.eval`` is null."""
    if data.eval is None:
        return []
    task_name = builtin_task_name(data.eval)
    if task_name is not None:
        examples = list(get_task(task_name).eval())
    else:
        examples = read_jsonl_prompts(data.eval, data.prompt_field, data.answer_field)
    return examples if limit is None else examples[:limit]
