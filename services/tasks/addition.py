"""The built-in task ``addition`` and the recipe of its base model ``builtin:addition``.

Prompts ``"{a}+{b}="`` with ``a, b`` uniform in [10, 99], answered with the sum
written least-significant digit first (``47+85=`` -> ``"231"``). Reversed digits
make the carry local to the digit being written, which is what lets a tiny
transformer learn the task in about a minute on a CPU. The eval split is a fixed
set of distinct problems that the train split never produces.

The base model is built by ``addition_model.py`` (torch) from ``WarmupRecipe``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import random
import re
from collections.abc import Iterator

from services.data import PromptExample
from services.tasks.models import FORMAT_VERSION
from services.tasks.problems import held_out_problems, numbered_prompts, training_problems

ADDITION_OPERAND_RANGE = (10, 99)
"""Inclusive range of both operands."""
ADDITION_EVAL_SIZE = 1000
"""Distinct problems in the held-out split; the train split excludes all of them."""
ADDITION_EVAL_SEED_BASE = 10_000
"""Eval problem i is drawn from ``random.Random(ADDITION_EVAL_SEED_BASE + i)``."""
_DIGITS = re.compile(r"[0-9]+")


@dataclasses.dataclass(frozen=True, slots=True)
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
    return held_out_problems(AdditionProblem.draw, ADDITION_EVAL_SEED_BASE, ADDITION_EVAL_SIZE)


def addition_train_problems(seed: int) -> Iterator[AdditionProblem]:
    """Endless training problems from one RNG stream, never one of the eval split's problems."""
    return training_problems(AdditionProblem.draw, addition_eval_problems(), seed)


def score_addition(response_text: str, answer: str) -> tuple[float, dict[str, float]]:
    """Reward 1.0 iff the stripped response equals the answer.

    Components: ``correct`` (0/1) and ``format`` (1 when the stripped response
    is a non-empty run of ASCII digits, whatever its value).
    """
    response = response_text.strip()
    correct = response == answer.strip()
    well_formed = _DIGITS.fullmatch(response) is not None
    return float(correct), {"correct": float(correct), "format": float(well_formed)}


def addition_train_prompts(seed: int) -> Iterator[PromptExample]:
    """Endless training prompts ``addition:train:<index>`` of ``addition_train_problems(seed)``."""
    return numbered_prompts("addition:train", addition_train_problems(seed))


def addition_eval_prompts() -> list[PromptExample]:
    """The held-out prompts ``addition:eval:<index>``."""
    return list(numbered_prompts("addition:eval", addition_eval_problems()))


def carry_dropped_answer(problem: AdditionProblem) -> str:
    """The plausible wrong answer the base model's warm-up teaches: digit-wise sums mod 10, reversed.

    47+85 -> digits (7+5)%10=2, (4+8)%10=2 -> 22 -> "22". Built as a number, so
    zero high digits vanish as they would in a real sum (46+14 -> 50 -> "05").
    """
    total, place, a, b = 0, 1, problem.a, problem.b
    while a or b:
        total += ((a % 10 + b % 10) % 10) * place
        a, b, place = a // 10, b // 10, place * 10
    return str(total)[::-1]


@dataclasses.dataclass(frozen=True)
class WarmupRecipe:
    """Everything that determines ``builtin:addition``'s weights; its hash names the cache directory.

    A 0.5M-parameter Llama warmed up by supervised training on *noisy* labels: each
    target is the correct reversed sum with probability ``p_correct``, otherwise
    ``carry_dropped_answer``. Greedy decoding then mostly answers the carry-dropped
    sum (held-out accuracy 0.265 with the default recipe) while the correct answer
    keeps real probability mass (samples at temperature 1 are right about half the
    time), so GRPO has something to sharpen: 16 prompts x 8 samples per step took it
    to 0.8 in 30 steps at lr 5e-5.
    """

    task: str = "addition"
    hidden_size: int = 128
    intermediate_size: int = 512
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    max_position_embeddings: int = 128
    steps: int = 900
    batch_size: int = 128
    learning_rate: float = 1e-3
    p_correct: float = 0.35
    """Probability that a training target is the correct sum (else the carry-dropped one)."""
    init_seed: int = 0
    data_seed: int = 1
    label_seed: int = 2
    eval_max_new_tokens: int = 6
    """Greedy budget of the held-out check at build end (3 digits + EOS, with slack)."""

    def digest(self, name: str) -> str:
        """A short stable hash of the recipe, its model name and FORMAT_VERSION."""
        payload = {"format": FORMAT_VERSION, "name": name, **dataclasses.asdict(self)}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]
