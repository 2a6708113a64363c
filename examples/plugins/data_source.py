"""Data sources of one's own: arithmetic problems generated on the fly, and a TSV file reader.

    data:
      source: examples.plugins.data_source:arithmetic
      train: subtract          # the operation: add, subtract or multiply
      eval: subtract
      options: {digits: 3, eval_size: 200}

``arithmetic`` is endless: its train split draws problems forever from the job's seed, never one
of its held-out problems, which are the first ``eval_size`` distinct ones of a fixed seed (the
same for every job). ``tsv_rows`` reads a tab-separated file whose header names its columns
(``data.prompt_field`` and ``data.answer_field`` pick two); it reads a local path, so it
declares ``reads_path`` and the api confines the file to ``VERST_DATA_ROOTS``.

The contract (services/data/sources.py): a function of a ``SourceRequest`` (location, split,
the job's data section, seed) returning ``PromptExample``s, raising ``DataError`` for data it
cannot read, with its traits declared by ``@traits``.
"""

from __future__ import annotations

import operator
import random
from collections.abc import Callable, Iterator
from pathlib import Path

from services.common.plugins import traits
from services.data import DataError, PromptExample, SourceRequest, check_options

OPERATIONS: dict[str, tuple[str, Callable[[int, int], int]]] = {
    "add": ("+", operator.add),
    "subtract": ("-", operator.sub),
    "multiply": ("*", operator.mul),
}
"""What ``arithmetic``'s location may name: the symbol in the prompt and what it computes."""
EVAL_SEED = 20_240_601
"""Seed of the held-out problems: fixed, so every job evaluates on the same ones."""


def _int_option(request: SourceRequest, name: str, default: int, low: int, high: int) -> int:
    value = request.data.options.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise DataError(f"data.options.{name}: must be an integer in [{low}, {high}], got {value!r}")
    return value


@traits(endless=True)
def arithmetic(request: SourceRequest) -> Iterator[PromptExample] | list[PromptExample]:
    """``"{a}{symbol}{b}="`` with ``digits``-digit operands, answered with the exact result."""
    check_options(request, "arithmetic", takes=("digits", "eval_size"))
    if request.location not in OPERATIONS:
        raise DataError(
            f"arithmetic: unknown operation {request.location!r} (known: {', '.join(OPERATIONS)})"
        )
    symbol, apply = OPERATIONS[request.location]
    digits = _int_option(request, "digits", 2, 1, 6)
    low, high = 10 ** (digits - 1), 10**digits - 1
    space = (high - low + 1) ** 2
    eval_size = _int_option(request, "eval_size", 100, 1, min(10_000, space // 2))  # half left to train on

    def example(prompt_id: str, a: int, b: int) -> PromptExample:
        return PromptExample(prompt_id, f"{a}{symbol}{b}=", str(apply(a, b)))

    rng = random.Random(EVAL_SEED)
    held_out: dict[tuple[int, int], None] = {}  # an ordered set
    while len(held_out) < eval_size:
        held_out.setdefault((rng.randint(low, high), rng.randint(low, high)))
    if request.split == "eval":
        return [example(f"{request.location}:eval:{i}", a, b) for i, (a, b) in enumerate(held_out)]

    def training() -> Iterator[PromptExample]:
        rng = random.Random(request.seed)
        index = 0
        while True:
            pair = (rng.randint(low, high), rng.randint(low, high))
            if pair not in held_out:
                yield example(f"{request.location}:train:{index}", *pair)
                index += 1

    return training()  # options were checked above, on the call, not on the first prompt


@traits(reads_path=True)
def tsv_rows(request: SourceRequest) -> list[PromptExample]:
    """Every row of a tab-separated file with a header row; ``prompt_id`` is ``"{file}:{line}"``."""
    check_options(request, "tsv_rows")
    path = Path(request.location)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(f"cannot read prompts from {path}: {err}") from None
    if not lines:
        raise DataError(f"{path}: no header row (the file is empty)")
    header = lines[0].split("\t")
    columns = []
    for field in (request.data.prompt_field, request.data.answer_field):
        if field not in header:
            raise DataError(f"{path}:1: no column {field!r} (columns: {', '.join(header)})")
        columns.append(header.index(field))
    rows = []
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        cells = line.split("\t")
        if len(cells) != len(header):
            raise DataError(f"{path}:{number}: {len(cells)} cells, the header has {len(header)}")
        prompt, answer = (cells[column] for column in columns)
        if not prompt or not answer:
            raise DataError(f"{path}:{number}: an empty prompt or answer")
        rows.append(PromptExample(f"{path.name}:{number}", prompt, answer))
    return rows
