"""Builds ``builtin:multiply``: a tiny model that answers multiplications by calling the python tool.

It trains on ``multiply.warmup_transcripts`` (the recipe, ``multiply.ToolRecipe``, says
what they are). So the base model samples a well-formed call about ``p_tool`` of the time
and then copies the tool's output reliably, and otherwise answers wrong: the reward at
the start is about ``p_tool``, and GRPO can raise it towards 1 only by calling the tool
more often. The build records these rates (``verst.json``: ``sampled_tool_call_rate``,
``copy_accuracy``, ``simulated_reward``; the tool is simulated there: only ``print(a*b)``
is run, by computing the product) so a change in the recipe that breaks them shows at once.

``catalog.py`` registers it as the multiply task's base model, cached by ``models.py``
exactly as ``builtin:addition`` is.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from services.data import encode_prompt
from services.tasks.models import FORMAT_VERSION
from services.tasks.multiply import (
    TOOL_FORMAT_VERSION,
    MultiplyProblem,
    ToolRecipe,
    encode_transcript,
    multiply_eval_problems,
    observation_text,
    python_call,
    python_code_of,
    tool_transcript,
    warmup_transcripts,
)
from services.tasks.tiny_llama import build_tiny_llama, char_tokenizer, generate_texts, tiny_llama_config

TOOL_CHARS = "\n" + "".join(chr(code) for code in range(32, 127))
"""The tokenizer's characters after the special tokens: newline and printable ASCII."""
SHORT_ROW = 64
"""Warm-up rows up to this many tokens (direct guesses) are batched apart from the long ones."""
_PRODUCT_CODE = re.compile(r"print\(([0-9]+)\*([0-9]+)\)")


def build_tool_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character of ``TOOL_CHARS`` (ids 4..99) after the four special tokens."""
    # [\s\S], not ".": the dot does not match a newline.
    # No space clean-up: decoded turns must be the generated text exactly.
    return char_tokenizer(TOOL_CHARS, r"[\s\S]", clean_up_tokenization_spaces=False)


def tool_llama_config(recipe: ToolRecipe, tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    """The Llama architecture of a tool model: the addition model's, with this tokenizer and rope base."""
    return tiny_llama_config(recipe, tokenizer, rope_theta=recipe.rope_theta)


# --- warm-up ------------------------------------------------------------------------------------


def _padded(rows: list[tuple[list[int], list[bool]]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) of ``rows``, right-padded; labels are -100 off the model's tokens."""
    length = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), length), pad, dtype=torch.long)
    labels = torch.full((len(rows), length), -100, dtype=torch.long)
    for row, (ids, in_loss) in enumerate(rows):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, : len(ids)] = torch.tensor(
            [i if keep else -100 for i, keep in zip(ids, in_loss, strict=True)]
        )
    return input_ids, labels


def _batches(
    recipe: ToolRecipe, tokenizer: PreTrainedTokenizerFast
) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Endless batches of ``batch_size`` transcripts, each as padded parts of similar lengths.

    A guess is ~25 tokens and a tool transcript ~150: padded together, most of a batch's
    compute would go to padding, so they are split, and the step's loss sums over both parts.
    """
    transcripts = warmup_transcripts(recipe, tokenizer)
    while True:
        rows = [next(transcripts) for _ in range(recipe.batch_size)]
        parts = [
            [row for row in rows if len(row[0]) <= SHORT_ROW],
            [row for row in rows if len(row[0]) > SHORT_ROW],
        ]
        yield [_padded(part, tokenizer.pad_token_id) for part in parts if part]


def lr_factor(recipe: ToolRecipe, step: int) -> float:
    """The learning rate of ``step`` as a fraction of the recipe's: warm-up, then cosine decay."""
    if step < recipe.warmup_steps:
        return (step + 1) / recipe.warmup_steps
    progress = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return recipe.final_lr_fraction + (1.0 - recipe.final_lr_fraction) * cosine


def warm_up_tools(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, recipe: ToolRecipe, *, progress: bool = True
) -> float:
    """Supervised training on the transcripts (AdamW, warm-up then cosine lr); returns the last
    batch's loss, the mean over the batch's model tokens."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(lr_factor, recipe))
    batches = _batches(recipe, tokenizer)
    model.train()
    loss_value = float("nan")
    bar = tqdm(range(recipe.steps), desc="tool warm-up", unit="step", disable=not progress, mininterval=1.0)
    for step in bar:
        parts = next(batches)
        # HF averages over a part's predicted tokens (labels shifted by one): weight parts by them.
        counts = [int((labels[:, 1:] != -100).sum()) for _, labels in parts]
        optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for (input_ids, labels), count in zip(parts, counts, strict=True):
            attention_mask = (input_ids != tokenizer.pad_token_id).long()
            loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
            (loss * (count / sum(counts))).backward()
            loss_sum += loss.item() * count
        optimizer.step()
        schedule.step()
        loss_value = loss_sum / sum(counts)
        if step % 20 == 0:
            bar.set_postfix(loss=f"{loss_value:.3f}")
    bar.close()
    return loss_value


# --- build-end checks ---------------------------------------------------------------------------


END_OF_CALL = "</tool_call>"
"""Where the runner's stop string cuts a turn that calls a tool."""


def _simulated_rewards(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    recipe: ToolRecipe,
    problems: Sequence[MultiplyProblem],
    firsts: Sequence[str],
    codes: Sequence[str | None],
) -> list[float]:
    """Each episode's reward: a first turn calling ``print(x*y)`` is shown the product and
    its sampled answer scored; any other first turn is scored as the final answer."""
    rewards = [float(first.strip() == p.answer) for first, p in zip(firsts, problems, strict=True)]
    followups = []
    for index, (problem, first, code) in enumerate(zip(problems, firsts, codes, strict=True)):
        match = _PRODUCT_CODE.fullmatch(code or "")
        if match is not None:
            output = f"{int(match.group(1)) * int(match.group(2))}\n"
            segments = [(first, True), (observation_text(recipe.observation, output), False)]
            followups.append((index, encode_transcript(tokenizer, problem.prompt, segments)[0][:-1]))
    if followups:
        finals = generate_texts(
            model, tokenizer, [ids for _, ids in followups], 10, sample=True, cut_after=END_OF_CALL
        )
        for (index, _), final in zip(followups, finals, strict=True):
            rewards[index] = float(final.strip() == problems[index].answer)
    return rewards


def check_tool_use(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    recipe: ToolRecipe,
    problems: Sequence[MultiplyProblem],
) -> dict[str, float]:
    """Rates of the model on ``problems``: sampled calls, exact copying, simulated episode reward.

    ``sampled_tool_call_rate``: first turns (temperature 1) that are a well-formed python call.
    ``correct_call_rate``: first turns whose code is exactly ``print(a*b)``.
    ``copy_accuracy``: greedy answers equal to the output of an ideal call shown to the model.
    ``simulated_reward``: episodes sampled end to end, a call of ``print(x*y)`` answered with
    the product (any other code counts as a failure), scored exactly as the verifier does.
    """
    prompts = [encode_prompt(tokenizer, p.prompt) for p in problems]
    call_budget = len(python_call("print(999*999)")) + 4
    firsts = generate_texts(model, tokenizer, prompts, call_budget, sample=True, cut_after=END_OF_CALL)
    codes = [python_code_of(text) for text in firsts]
    # Up to the observation's end, without the EOS that encode_transcript closes a transcript with.
    ideal = [
        encode_transcript(tokenizer, p.prompt, tool_transcript(p, recipe.observation)[:2])[0][:-1]
        for p in problems
    ]
    answers = generate_texts(model, tokenizer, ideal, 10, sample=False, cut_after=END_OF_CALL)
    rewards = _simulated_rewards(model, tokenizer, recipe, problems, firsts, codes)
    count = len(problems)
    return {
        "sampled_tool_call_rate": sum(code is not None for code in codes) / count,
        "correct_call_rate": sum(
            code == f"print({p.a}*{p.b})" for code, p in zip(codes, problems, strict=True)
        )
        / count,
        "copy_accuracy": sum(a.strip() == p.answer for a, p in zip(answers, problems, strict=True)) / count,
        "simulated_reward": sum(rewards) / count,
    }


def build_tool_model(
    name: str, recipe: ToolRecipe, out_dir: Path, *, progress: bool = True
) -> dict[str, Any]:
    """Build a tool model into ``out_dir`` (created) and return what was written to verst.json."""
    if recipe.task != "multiply":
        raise ValueError(f"no tool warm-up for task {recipe.task!r}: only 'multiply' has one")
    tokenizer = build_tool_tokenizer()

    def train(model: LlamaForCausalLM) -> dict[str, Any]:
        final_loss = warm_up_tools(model, tokenizer, recipe, progress=progress)
        torch.manual_seed(recipe.check_seed)
        problems = multiply_eval_problems()[: recipe.check_prompts]
        checks = check_tool_use(model, tokenizer, recipe, problems)
        return {"final_train_loss": final_loss, **checks, "check_prompts": recipe.check_prompts}

    config = tool_llama_config(recipe, tokenizer)
    versions = {"format_version": FORMAT_VERSION, "tool_format_version": TOOL_FORMAT_VERSION}
    return build_tiny_llama(name, recipe, out_dir, tokenizer, config, train, versions)
