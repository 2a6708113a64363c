"""Prompts as every task and data set gives them, and the one prompt encoding.

A prompt source yields ``PromptExample``s: built-in tasks (``catalog.py``) generate them,
and a JSONL file with a prompt and an answer field loads through ``read_jsonl_prompts``.
Everyone encodes a prompt with ``encode_prompt`` so that the controller, the engines and
the trainer agree on the token ids.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

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


# --- synthetic tasks ---------------------------------------------------------------------------


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
