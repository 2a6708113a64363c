"""Builds ``builtin:addition``: a character tokenizer, a tiny Llama, a supervised warm-up.

The recipe (``addition.WarmupRecipe``) says what the warm-up teaches and why; a build is
deterministic (seeded) and takes one to two minutes on two CPU cores. ``catalog.py``
registers it as the addition task's base model, cached by ``models.py``.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from services.data import PromptExample, encode_prompt
from services.tasks.addition import (
    WarmupRecipe,
    addition_eval_prompts,
    addition_train_problems,
    carry_dropped_answer,
    score_addition,
)
from services.tasks.models import FORMAT_VERSION
from services.tasks.tiny_llama import (
    Batch,
    build_tiny_llama,
    char_tokenizer,
    generate_texts,
    prompt_target_batch,
    supervised_steps,
    tiny_llama_config,
)

PRINTABLE_ASCII = "".join(chr(code) for code in range(32, 127))
"""The addition tokenizer's characters after the special tokens."""


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable ASCII character (ids 4..98) after the four special tokens."""
    return char_tokenizer(PRINTABLE_ASCII, ".")


def _noisy_batches(recipe: WarmupRecipe, tokenizer: PreTrainedTokenizerFast) -> Iterator[Batch]:
    """Endless (input_ids, labels) batches, right-padded; labels are -100 outside the answer+EOS."""
    problems = addition_train_problems(recipe.data_seed)
    label_rng = random.Random(recipe.label_seed)
    eos = tokenizer.eos_token_id
    # A few thousand distinct texts recur all through the warm-up: tokenize each once.
    prompt_ids_of = functools.cache(lambda text: encode_prompt(tokenizer, text))
    target_ids_of = functools.cache(
        lambda text: [*tokenizer(text, add_special_tokens=False)["input_ids"], eos]
    )
    while True:
        rows = []
        for problem in (next(problems) for _ in range(recipe.batch_size)):
            correct = label_rng.random() < recipe.p_correct
            target = problem.answer if correct else carry_dropped_answer(problem)
            rows.append((prompt_ids_of(problem.prompt), target_ids_of(target)))
        yield prompt_target_batch(rows, tokenizer.pad_token_id)


def warm_up(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    recipe: WarmupRecipe,
    *,
    progress: bool = True,
) -> float:
    """Supervised training on noisy labels (AdamW, constant lr); returns the last batch's loss."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.learning_rate, weight_decay=0.0)
    batches = _noisy_batches(recipe, tokenizer)
    pad = tokenizer.pad_token_id
    return supervised_steps(model, batches, recipe.steps, optimizer, pad, desc="warm-up", progress=progress)


def greedy_accuracy(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    examples: Sequence[PromptExample],
    score: Callable[[str, str], tuple[float, dict[str, float]]],
    max_new_tokens: int,
) -> float:
    """Fraction of ``examples`` whose greedy response ``score`` rewards 1, in one batch."""
    prompts = [encode_prompt(tokenizer, example.text) for example in examples]
    responses = generate_texts(model, tokenizer, prompts, max_new_tokens, sample=False)
    rewards = [score(text, example.answer)[0] for text, example in zip(responses, examples, strict=True)]
    return sum(rewards) / len(rewards)


def build_addition_model(
    name: str, recipe: WarmupRecipe, out_dir: Path, *, progress: bool = True
) -> dict[str, Any]:
    """Build ``builtin:addition`` into ``out_dir`` (created) and return what was written to verst.json."""
    if recipe.task != "addition":
        raise ValueError(f"no warm-up for task {recipe.task!r}: only 'addition' has one")
    tokenizer = build_char_tokenizer()

    def train(model: LlamaForCausalLM) -> dict[str, Any]:
        final_loss = warm_up(model, tokenizer, recipe, progress=progress)
        examples = addition_eval_prompts()
        budget = recipe.eval_max_new_tokens
        accuracy = greedy_accuracy(model, tokenizer, examples, score_addition, budget)
        return {
            "final_train_loss": final_loss,
            "eval_greedy_accuracy": accuracy,
            "eval_prompts": len(examples),
        }

    config = tiny_llama_config(recipe, tokenizer)
    versions = {"format_version": FORMAT_VERSION}
    return build_tiny_llama(name, recipe, out_dir, tokenizer, config, train, versions)
