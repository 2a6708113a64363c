"""What the builtin models share: a character tokenizer, a tiny Llama, supervised warm-up
steps, generation, saving.

``builtin:addition`` (``addition_model.py``) and ``builtin:multiply``
(``multiply_model.py``) are a 2-layer Llama, ``builtin:reverse`` (``reverse_model.py``)
a 6-layer one, each over one token per character, built on every CPU core the process
may use, checked by generating from held-out prompts, and saved as a Hugging Face
directory with its ``verst.json`` (``models.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from tqdm.auto import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from services.tasks.models import STAMP_FILE

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
"""Ids 0..3 of the character tokenizers, in this order."""
Batch = tuple[torch.Tensor, torch.Tensor]
"""(input_ids, labels) of a supervised warm-up step."""


class LlamaShape(Protocol):
    """The recipe fields that fix a tiny Llama's architecture."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    max_position_embeddings: int


def char_tokenizer(chars: str, split_pattern: str, **options: Any) -> PreTrainedTokenizerFast:
    """One token per character of ``chars`` (ids 4, 5, …) after the four special tokens.

    ``split_pattern`` matches one character; ``options`` go to ``PreTrainedTokenizerFast``.
    It adds no special tokens on its own; ``encode_prompt`` prepends BOS.
    """
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    for char in chars:
        vocab[char] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(split_pattern), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        **options,
    )


def tiny_llama_config(
    recipe: LlamaShape, tokenizer: PreTrainedTokenizerFast, *, rope_theta: float = 10_000.0
) -> LlamaConfig:
    """The Llama architecture of a builtin model (537,600 parameters with the addition recipe)."""
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_hidden_layers,
        num_attention_heads=recipe.num_attention_heads,
        num_key_value_heads=recipe.num_attention_heads,
        max_position_embeddings=recipe.max_position_embeddings,
        rope_theta=rope_theta,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def available_cpus() -> int:
    """CPUs this process may run on (the affinity mask, which containers narrow)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Run with ``count`` intra-op threads, then restore the caller's setting."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@torch.no_grad()
def generate_texts(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    prefixes: Sequence[list[int]],
    max_new_tokens: int,
    *,
    sample: bool,
    cut_after: str | None = None,
) -> list[str]:
    """Each prefix's continuation (temperature 1 when ``sample``, else greedy), decoded, in one batch,
    and cut after the first ``cut_after`` when given (as a stop string cuts a turn).

    Prefixes are left-padded so that every row's continuation starts at the same column.
    """
    width = max(len(ids) for ids in prefixes)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in prefixes])
    attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prefixes])
    sampling: dict[str, Any] = {"temperature": 1.0, "top_k": 0, "top_p": 1.0} if sample else {}
    was_training = model.training
    model.eval()
    output = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=max_new_tokens,
        do_sample=sample,
        pad_token_id=pad,
        eos_token_id=tokenizer.eos_token_id,
        **sampling,
    )
    model.train(was_training)
    texts = tokenizer.batch_decode(output[:, width:], skip_special_tokens=True)
    if cut_after is None:
        return texts
    return [text.split(cut_after)[0] + cut_after if cut_after in text else text for text in texts]


def prompt_target_batch(rows: Sequence[tuple[list[int], list[int]]], pad: int) -> Batch:
    """(input_ids, labels) of (prompt ids, target ids) rows, right-padded with ``pad``; labels are
    -100 outside the targets, so the loss covers the targets only."""
    length = max(len(p) + len(t) for p, t in rows)
    input_ids = torch.full((len(rows), length), pad, dtype=torch.long)
    labels = torch.full((len(rows), length), -100, dtype=torch.long)
    for row, (prompt_ids, target_ids) in enumerate(rows):
        end = len(prompt_ids) + len(target_ids)
        input_ids[row, :end] = torch.tensor(prompt_ids + target_ids)
        labels[row, len(prompt_ids) : end] = torch.tensor(target_ids)
    return input_ids, labels


def supervised_steps(
    model: LlamaForCausalLM,
    batches: Iterator[Batch],
    steps: int,
    optimizer: torch.optim.Optimizer,
    pad: int,
    *,
    desc: str,
    progress: bool,
    schedule: torch.optim.lr_scheduler.LRScheduler | None = None,
    max_grad_norm: float | None = None,
) -> float:
    """``steps`` optimiser steps of the causal-LM loss on ``batches`` (padding masked out of the
    attention), the gradient clipped at ``max_grad_norm`` when given; returns the last batch's loss."""
    model.train()
    loss_value = float("nan")
    bar = tqdm(range(steps), desc=desc, unit="step", disable=not progress, mininterval=1.0)
    for step in bar:
        input_ids, labels = next(batches)
        attention_mask = (input_ids != pad).long()
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        if schedule is not None:
            schedule.step()
        loss_value = loss.item()
        if step % 20 == 0:
            bar.set_postfix(loss=f"{loss_value:.3f}")
    bar.close()
    return loss_value


class BuildRecipe(Protocol):
    """What every builtin model's build reads of its recipe, a dataclass (saved whole in verst.json)."""

    init_seed: int

    def digest(self, name: str) -> str: ...


def build_tiny_llama(
    name: str,
    recipe: BuildRecipe,
    out_dir: Path,
    tokenizer: PreTrainedTokenizerFast,
    config: LlamaConfig,
    train: Callable[[LlamaForCausalLM], dict[str, Any]],
    versions: dict[str, int],
) -> dict[str, Any]:
    """Initialise a Llama from ``recipe.init_seed``, ``train`` it, save it into ``out_dir`` (created).

    ``train`` returns the results the stamp records (its loss, its build-end checks);
    ``versions`` are the format versions the recipe hash covers. Runs on every available
    CPU, and seeding does not disturb the caller's random state. Returns the verst.json written.
    """
    started = time.monotonic()
    with torch_threads(available_cpus()), torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.init_seed)
        model = LlamaForCausalLM(config)
        results = train(model)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    stamp = {
        "name": name,
        "recipe_hash": recipe.digest(name),
        **versions,
        "recipe": dataclasses.asdict(recipe),
        "parameters": sum(p.numel() for p in model.parameters()),
        **results,
        "build_seconds": round(time.monotonic() - started, 2),
        "built_at": time.time(),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
    }
    (out_dir / STAMP_FILE).write_text(json.dumps(stamp, indent=2) + "\n")
    return stamp
