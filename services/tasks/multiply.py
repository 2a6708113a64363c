"""The built-in task ``multiply`` and the recipe of its base model ``builtin:multiply``.

``"What is 347*829?"`` with both operands in [317, 999], answered with the exact
product (``"287663"``). It is a multi-turn task: a tiny model cannot multiply, so it
is solved by calling the python tool and copying the result.

The base model is the same 2-layer Llama as ``builtin:addition``, with a character
tokenizer of its own that also has ``\\n`` (tool observations span lines), warmed up by
supervised training on synthetic multi-turn transcripts of this task::

    What is 347*829?<tool_call>{"name": "python", "arguments": {"code": "print(347*829)"}}</tool_call>
    <tool_response>\\n287663\\n\\n</tool_response>\\n287663</s>

(the prompt, then a hermes tool call, the observation the runner appends — rendered with
``RolloutConfig.tool_observation``'s default — and the answer copied from it), or, with
probability 1 - ``p_tool``, a direct answer that is always wrong (the operands' digits run
together, ``347829</s>``): a 0.5M-parameter model cannot multiply 3-digit numbers. The
loss covers the model's tokens only (the call, the answer, EOS), never the prompt or the
observation, as the trainer's loss mask does. This module holds the transcripts and
``ToolRecipe``; ``multiply_model.py`` (torch) trains on them.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import random
import re
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from services.common.config import RolloutConfig
from services.data import PromptExample, PromptTokenizer, encode_prompt
from services.tasks.models import FORMAT_VERSION
from services.tasks.problems import held_out_problems, numbered_prompts, training_problems

MULTIPLY_OPERAND_RANGE = (317, 999)
"""Inclusive range of both operands: 3-digit numbers whose product always has 6 digits (317² =
100489), so every answer has the same shape; the product is beyond a tiny model's arithmetic."""
MULTIPLY_EVAL_SIZE = 500
"""Distinct problems in the held-out split; the train split excludes all of them."""
MULTIPLY_EVAL_SEED_BASE = 20_000
"""Eval problem i is drawn from ``random.Random(MULTIPLY_EVAL_SEED_BASE + i)``."""
TOOL_FORMAT_VERSION = 1
"""Part of every tool recipe hash, with models.FORMAT_VERSION: raise it when this build changes."""
DEFAULT_OBSERVATION: str = RolloutConfig.model_fields["tool_observation"].default
"""The runner's default observation template: the warm-up shows the model exactly this."""
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclasses.dataclass(frozen=True, slots=True)
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
    return held_out_problems(MultiplyProblem.draw, MULTIPLY_EVAL_SEED_BASE, MULTIPLY_EVAL_SIZE)


def multiply_train_problems(seed: int) -> Iterator[MultiplyProblem]:
    """Endless training problems from one RNG stream, never one of the eval split's problems."""
    return training_problems(MultiplyProblem.draw, multiply_eval_problems(), seed)


def multiply_train_prompts(seed: int) -> Iterator[PromptExample]:
    """Endless training prompts ``multiply:train:<index>`` of ``multiply_train_problems(seed)``."""
    return numbered_prompts("multiply:train", multiply_train_problems(seed))


def multiply_eval_prompts() -> list[PromptExample]:
    """The held-out prompts ``multiply:eval:<index>``."""
    return list(numbered_prompts("multiply:eval", multiply_eval_problems()))


# --- the base model's recipe and transcripts ----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ToolRecipe:
    """Everything that determines a tool model's weights; its hash names the cache directory."""

    task: str = "multiply"
    hidden_size: int = 128
    intermediate_size: int = 512
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    max_position_embeddings: int = 256
    rope_theta: float = 10_000.0
    """Prompt (17 tokens) + a whole episode (about 130) with room to spare."""
    steps: int = 500
    """Copying is learnt by about step 200; the rest sharpens it for sampling at temperature 1
    (calls whose sampled code is exactly right: 92% after 300 steps, 96% after 500)."""
    batch_size: int = 32
    learning_rate: float = 3e-3
    warmup_steps: int = 30
    """Linear warm-up of the learning rate, then a cosine decay to ``final_lr_fraction`` of it."""
    final_lr_fraction: float = 0.1
    p_tool: float = 0.4
    """Share of warm-up transcripts that call the tool (the rest guess an answer)."""
    observation: str = DEFAULT_OBSERVATION
    """How tool output is shown; a job must use the same ``rollout.tool_observation``."""
    init_seed: int = 0
    data_seed: int = 1
    label_seed: int = 2
    check_prompts: int = 256
    """Held-out prompts of the build-end checks."""
    check_seed: int = 3

    def digest(self, name: str) -> str:
        """A short stable hash of the recipe, its model name and both format versions."""
        payload = {
            "format": FORMAT_VERSION,
            "tool_format": TOOL_FORMAT_VERSION,
            "name": name,
            **dataclasses.asdict(self),
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]


def python_call(code: str) -> str:
    """A hermes call of the python tool, as the runner's parser reads it."""
    return "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}}) + "</tool_call>"


def python_code_of(turn: str) -> str | None:
    """The code of a well-formed python call that is the whole turn; None for anything else."""
    match = _CALL.fullmatch(turn.strip())
    if match is None:
        return None
    try:
        body: Any = json.loads(match.group(1))
    except ValueError:
        return None
    if not isinstance(body, dict) or body.get("name") != "python":
        return None
    arguments = body.get("arguments")
    if not isinstance(arguments, dict):
        return None
    code = arguments.get("code")
    return code if isinstance(code, str) else None


def observation_text(template: str, output: str) -> str:
    """``template`` with ``{output}`` replaced, as the runner renders an observation."""
    return template.replace("{output}", output)


Segment = tuple[str, bool]
"""A piece of a transcript's response and whether the model wrote it (observations did not)."""


def tool_transcript(problem: MultiplyProblem, observation: str) -> list[Segment]:
    """Call the tool, read its output, answer with it (the answer is followed by EOS)."""
    output = f"{problem.a * problem.b}\n"  # what print() writes to stdout in the sandbox
    return [
        (python_call(f"print({problem.a}*{problem.b})"), True),
        (observation_text(observation, output), False),
        (problem.answer, True),
    ]


def guess_transcript(problem: MultiplyProblem) -> list[Segment]:
    """A direct answer, never the product: the operands' digits run together (347*829 ->
    ``347829``; 1000a + b = ab has no 3-digit solution).

    A copy from the prompt rather than a random number: a random guess is noise the model
    cannot learn, while this short row trains the same copying the tool transcripts need
    (the code's operands, the tool's output). With random guesses the 2-layer model had not
    learnt to copy the tool's output reliably after 1000 steps; with these it has by step 200.
    """
    return [(f"{problem.a}{problem.b}", True)]


class TranscriptTokenizer(PromptTokenizer, Protocol):
    """The part of a Hugging Face tokenizer that ``encode_transcript`` uses."""

    eos_token_id: Any


def encode_transcript(
    tokenizer: TranscriptTokenizer, prompt: str, segments: Sequence[Segment]
) -> tuple[list[int], list[bool]]:
    """Token ids of prompt + response + EOS, and per id whether it is a model token (in the loss).

    Segments are tokenized one by one, as the runner does (model turns come from the engine,
    observations are tokenized on their own), so the ids are what an episode produces.
    """
    ids = encode_prompt(tokenizer, prompt)
    in_loss = [False] * len(ids)
    for text, model in segments:
        piece = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        ids += piece
        in_loss += [model] * len(piece)
    ids.append(int(tokenizer.eos_token_id))
    in_loss.append(True)
    return ids, in_loss


def warmup_transcripts(
    recipe: ToolRecipe, tokenizer: TranscriptTokenizer
) -> Iterator[tuple[list[int], list[bool]]]:
    """Endless encoded warm-up transcripts: tool use with probability ``p_tool``, else a guess."""
    choice_rng = random.Random(recipe.label_seed)
    for problem in multiply_train_problems(recipe.data_seed):
        if choice_rng.random() < recipe.p_tool:
            segments = tool_transcript(problem, recipe.observation)
        else:
            segments = guess_transcript(problem)
        yield encode_transcript(tokenizer, problem.prompt, segments)
