"""Builds ``builtin:reverse``: a character tokenizer, a 5.1M-parameter Llama, a short supervised warm-up.

The recipe (``reverse.ReverseRecipe``) says what the warm-up teaches and why; a build is
deterministic (seeded) and records its held-out greedy exact match and per-position share
in ``verst.json``. ``catalog.py`` registers it as the reverse task's base model, cached by
``models.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from services.data import PromptExample, encode_prompt
from services.tasks.models import FORMAT_VERSION
from services.tasks.reverse import (
    REVERSE_ALPHABET,
    REVERSE_SEPARATOR,
    ReverseRecipe,
    reverse_eval_prompts,
    reverse_train_problems,
    score_reverse,
)
from services.tasks.tiny_llama import (
    Batch,
    build_tiny_llama,
    char_tokenizer,
    generate_texts,
    prompt_target_batch,
    supervised_steps,
    tiny_llama_config,
)

REVERSE_CHARS = REVERSE_ALPHABET + REVERSE_SEPARATOR
"""The tokenizer's characters after the special tokens: the letters and the separator."""


def build_reverse_tokenizer() -> PreTrainedTokenizerFast:
    """One token per letter and one for ``=`` (ids 4..30) after the four special tokens."""
    return char_tokenizer(REVERSE_CHARS, ".")


def _batches(recipe: ReverseRecipe, tokenizer: PreTrainedTokenizerFast) -> Iterator[Batch]:
    """Endless (input_ids, labels) batches, right-padded; labels are -100 outside the answer+EOS."""
    problems = reverse_train_problems(recipe.data_seed)
    eos = tokenizer.eos_token_id
    while True:
        rows = [
            (
                encode_prompt(tokenizer, problem.prompt),
                [*tokenizer(problem.answer, add_special_tokens=False)["input_ids"], eos],
            )
            for problem in (next(problems) for _ in range(recipe.batch_size))
        ]
        yield prompt_target_batch(rows, tokenizer.pad_token_id)


def lr_factor(recipe: ReverseRecipe, step: int) -> float:
    """The learning rate of ``step`` as a fraction of the recipe's: linear warm-up, then constant."""
    return min(1.0, (step + 1) / recipe.warmup_steps) if recipe.warmup_steps else 1.0


def warm_up_reverse(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    recipe: ReverseRecipe,
    *,
    progress: bool = True,
) -> float:
    """Supervised training on correct reversals (AdamW, warm-up then constant lr, gradient norm
    clipped at 1); returns the last batch's loss."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(lr_factor, recipe))
    return supervised_steps(
        model,
        _batches(recipe, tokenizer),
        recipe.steps,
        optimizer,
        tokenizer.pad_token_id,
        desc="reverse warm-up",
        progress=progress,
        schedule=schedule,
        max_grad_norm=1.0,
    )


def held_out_scores(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    examples: Sequence[PromptExample],
    max_new_tokens: int,
    batch_size: int = 250,
) -> dict[str, float]:
    """Greedy ``exact`` match and mean ``positions`` share (the reward) over ``examples``."""
    exact = positions = 0.0
    for first in range(0, len(examples), batch_size):
        chunk = examples[first : first + batch_size]
        prompts = [encode_prompt(tokenizer, example.text) for example in chunk]
        texts = generate_texts(model, tokenizer, prompts, max_new_tokens, sample=False)
        for text, example in zip(texts, chunk, strict=True):
            _, components = score_reverse(text, example.answer)
            exact += components["exact"]
            positions += components["positions"]
    return {"eval_exact_match": exact / len(examples), "eval_positions": positions / len(examples)}


def build_reverse_model(
    name: str, recipe: ReverseRecipe, out_dir: Path, *, progress: bool = True
) -> dict[str, Any]:
    """Build ``builtin:reverse`` into ``out_dir`` (created) and return what was written to verst.json."""
    if recipe.task != "reverse":
        raise ValueError(f"no reverse warm-up for task {recipe.task!r}: only 'reverse' has one")
    tokenizer = build_reverse_tokenizer()

    def train(model: LlamaForCausalLM) -> dict[str, Any]:
        final_loss = warm_up_reverse(model, tokenizer, recipe, progress=progress)
        examples = reverse_eval_prompts()
        scores = held_out_scores(model, tokenizer, examples, recipe.eval_max_new_tokens)
        return {"final_train_loss": final_loss, **scores, "eval_prompts": len(examples)}

    config = tiny_llama_config(recipe, tokenizer)
    versions = {"format_version": FORMAT_VERSION}
    return build_tiny_llama(name, recipe, out_dir, tokenizer, config, train, versions)
