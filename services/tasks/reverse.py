"""The built-in task ``reverse`` and the recipe of its base model ``builtin:reverse``.

Prompts ``"{letters}="`` of 8 to 16 lowercase letters, answered with the letters
reversed (``"verst="`` -> ``"tsrev"``): the compute-bound task of the race in
bench/e2e.py, a 5.1M-parameter model whose answers are 8-16 tokens plus EOS. The
eval split is a fixed set of distinct strings that the train split never produces.

The reward gives partial credit, the share of positions right: ``score_reverse``
says why. Held-out accuracy is exact match (the ``exact`` component,
``Task.accuracy``), not the partial-credit reward.

The base model is built by ``reverse_model.py`` (torch) from ``ReverseRecipe``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import random
import re
import string
from collections.abc import Iterator

from services.data import PromptExample
from services.tasks.models import FORMAT_VERSION
from services.tasks.problems import held_out_problems, numbered_prompts, training_problems

REVERSE_LENGTHS = (8, 16)
"""Inclusive range of a prompt's number of letters."""
REVERSE_ALPHABET = string.ascii_lowercase
"""The letters prompts are made of."""
REVERSE_SEPARATOR = "="
"""Ends every prompt: after it comes the answer."""
REVERSE_EVAL_SIZE = 500
"""Distinct strings in the held-out split; the train split excludes all of them."""
REVERSE_EVAL_SEED_BASE = 30_000
"""Eval problem i is drawn from ``random.Random(REVERSE_EVAL_SEED_BASE + i)``."""
_LETTERS = re.compile(r"[a-z]+")


@dataclasses.dataclass(frozen=True, slots=True)
class ReverseProblem:
    """A string of letters; the prompt is the string and ``=``, the answer the string reversed."""

    letters: str

    @property
    def prompt(self) -> str:
        return f"{self.letters}{REVERSE_SEPARATOR}"

    @property
    def answer(self) -> str:
        return self.letters[::-1]

    @classmethod
    def draw(cls, rng: random.Random) -> ReverseProblem:
        low, high = REVERSE_LENGTHS
        length = rng.randint(low, high)
        return cls("".join(rng.choice(REVERSE_ALPHABET) for _ in range(length)))


@functools.cache
def reverse_eval_problems() -> tuple[ReverseProblem, ...]:
    """The held-out split: the first ``REVERSE_EVAL_SIZE`` distinct strings of seeds 30000, 30001, …"""
    return held_out_problems(ReverseProblem.draw, REVERSE_EVAL_SEED_BASE, REVERSE_EVAL_SIZE)


def reverse_train_problems(seed: int) -> Iterator[ReverseProblem]:
    """Endless training problems from one RNG stream, never one of the eval split's strings."""
    return training_problems(ReverseProblem.draw, reverse_eval_problems(), seed)


def reverse_train_prompts(seed: int) -> Iterator[PromptExample]:
    """Endless training prompts ``reverse:train:<index>`` of ``reverse_train_problems(seed)``."""
    return numbered_prompts("reverse:train", reverse_train_problems(seed))


def reverse_eval_prompts() -> list[PromptExample]:
    """The held-out prompts ``reverse:eval:<index>``."""
    return list(numbered_prompts("reverse:eval", reverse_eval_problems()))


def score_reverse(response_text: str, answer: str) -> tuple[float, dict[str, float]]:
    """Partial credit: the share of positions where the stripped response has the answer's letter,
    over the longer of the two lengths; 1.0 exactly when the response is the answer.

    Why positions: the answer is written one letter per token, left to right, and each letter is
    right or wrong on its own, so the reward counts the tokens the model got right, and a sample
    that fixes one more letter than its group scores higher (GRPO's advantage sees it). Dividing
    by the longer length makes a response that stops early or runs on lose the missing or extra
    positions. Exact match alone would leave a base model at 0.3 with most groups all-wrong
    (no signal).

    Components: ``exact`` (0/1, what held-out accuracy counts), ``positions`` (the reward) and
    ``format`` (1 when the stripped response is a non-empty run of lowercase letters).
    """
    response, target = response_text.strip(), answer.strip()
    longest = max(len(response), len(target))
    right = sum(a == b for a, b in zip(response, target, strict=False))
    positions = right / longest if longest else 1.0
    exact = float(response == target)
    well_formed = float(_LETTERS.fullmatch(response) is not None)
    return positions, {"exact": exact, "positions": positions, "format": well_formed}


@dataclasses.dataclass(frozen=True)
class ReverseRecipe:
    """Everything that determines ``builtin:reverse``'s weights; its hash names the cache directory.

    A 5.1M-parameter Llama (hidden 256, 6 layers) trained from scratch, supervised, on
    correct reversals for only ``steps`` steps: long enough that it reverses most letters
    right, short of the point where whole strings come out right: the build's greedy exact
    match on the 500 held-out strings is 0.36 (per-position share 0.785), so GRPO has room to
    raise it (``reverse_model.py``). The build took 339 s on two CPU cores shared with other
    work (0.23 to 1.3 steps/s); a step took 0.55-0.67 s when the cores were free.
    """

    task: str = "reverse"
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 6
    num_attention_heads: int = 4
    max_position_embeddings: int = 64
    """Prompt (18 tokens with BOS) + the longest answer with EOS (17), with room to spare."""
    steps: int = 230
    """Held-out greedy exact match of this recipe by step (the first 200 held-out strings): 0.005
    at 100, 0.055 at 150, 0.185 at 200, 0.37 at 250, 0.385 at 300, 0.47 at 350; the per-position
    share 0.29, 0.51, 0.69, 0.81, 0.81, 0.88. At 230, all 500: 0.36 and 0.785."""
    batch_size: int = 64
    learning_rate: float = 1e-3
    warmup_steps: int = 30
    """Linear warm-up of the learning rate, then constant."""
    init_seed: int = 0
    data_seed: int = 1
    eval_max_new_tokens: int = 20
    """Greedy budget of the held-out check at build end (the race's max_new_tokens)."""

    def digest(self, name: str) -> str:
        """A short stable hash of the recipe, its model name and FORMAT_VERSION."""
        payload = {"format": FORMAT_VERSION, "name": name, **dataclasses.asdict(self)}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]
