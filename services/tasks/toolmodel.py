"""``builtin:multiply``: a tiny model that answers multiplications by calling the python tool.

The model is the same 2-layer Llama as ``builtin:addition`` (``basemodel.py``), with a
character tokenizer of its own that also has ``\\n`` (tool observations span lines), warmed
up by supervised training on synthetic multi-turn transcripts of the ``multiply`` task::

    What is 347*829?<tool_call>{"name": "python", "arguments": {"code": "print(347*829)"}}</tool_call>
    <tool_response>\\n287663\\n\\n</tool_response>\\n287663</s>

(the prompt, then a hermes tool call, the observation the runner appends — rendered with
``RolloutConfig.tool_observation``'s default — and the answer copied from it), or, with
probability 1 - ``p_tool``, a direct answer that is always wrong (the operands' digits run
together, ``347829</s>``): a 0.5M-parameter model cannot multiply 3-digit numbers. The
loss covers the model's tokens only (the call, the answer, EOS), never the prompt or the
observation, as the trainer's loss mask does.

So the base model samples a well-formed call about ``p_tool`` of the time and then copies
the tool's output reliably, and otherwise answers wrong: the reward at the start is about
``p_tool``, and GRPO can raise it towards 1 only by calling the tool more often. The build
records these rates (``verst.json``: ``sampled_tool_call_rate``, ``copy_accuracy``,
``simulated_reward``; the tool is simulated there: only ``print(a*b)`` is run, by
computing the product) so a change in the recipe that breaks them shows at once.

Cached exactly as ``basemodel`` caches its models (same directory layout, stamp, lock and
atomic rename); ``basemodel.resolve_model_path`` sends the names of ``TOOL_MODELS`` here.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import random
import re
import shutil
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import filelock
import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from tqdm.auto import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from services.common.config import RolloutConfig
from services.tasks.basemodel import (
    FORMAT_VERSION,
    LOCK_TIMEOUT_S,
    SPECIAL_TOKENS,
    STAMP_FILE,
    ModelPathError,
    _acquire_build_lock,
    _torch_threads,
    available_cpus,
    default_cache_dir,
    read_stamp,
    tiny_llama_config,
)
from services.tasks.catalog import (
    BUILTIN_PREFIX,
    MultiplyProblem,
    encode_prompt,
    multiply_eval_problems,
    multiply_train_problems,
)

log = logging.getLogger(__name__)

TOOL_FORMAT_VERSION = 1
"""Part of every recipe hash, with basemodel's FORMAT_VERSION: raise it when this build changes."""
DEFAULT_OBSERVATION: str = RolloutConfig.model_fields["tool_observation"].default
"""The runner's default observation template: the warm-up shows the model exactly this."""
TOOL_CHARS = "\n" + "".join(chr(code) for code in range(32, 127))
"""The tokenizer's characters after the special tokens: newline and printable ASCII."""
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_PRODUCT_CODE = re.compile(r"print\(([0-9]+)\*([0-9]+)\)")


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


TOOL_MODELS: dict[str, ToolRecipe] = {"multiply": ToolRecipe()}
"""Builtin tool-using model name -> the recipe that builds it."""


# --- tokenizer, architecture, transcripts ------------------------------------------------------


def build_tool_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character of ``TOOL_CHARS`` (ids 4..99) after the four special tokens."""
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    for char in TOOL_CHARS:
        vocab[char] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    # [\s\S], not ".": the dot does not match a newline.
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,  # decoded turns must be the generated text exactly
    )


def tool_llama_config(recipe: ToolRecipe, tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    """The Llama architecture of a tool model: basemodel's, with this tokenizer and rope base."""
    return tiny_llama_config(recipe, tokenizer, rope_theta=recipe.rope_theta)  # type: ignore[arg-type]


def python_call(code: str) -> str:
    """A hermes call of the python tool, as the runner's parser reads it."""
    return "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}}) + "</tool_call>"


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


def encode_transcript(
    tokenizer: PreTrainedTokenizerFast, prompt: str, segments: Sequence[Segment]
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
    recipe: ToolRecipe, tokenizer: PreTrainedTokenizerFast
) -> Iterator[tuple[list[int], list[bool]]]:
    """Endless encoded warm-up transcripts: tool use with probability ``p_tool``, else a guess."""
    choice_rng = random.Random(recipe.label_seed)
    for problem in multiply_train_problems(recipe.data_seed):
        if choice_rng.random() < recipe.p_tool:
            segments = tool_transcript(problem, recipe.observation)
        else:
            segments = guess_transcript(problem)
        yield encode_transcript(tokenizer, problem.prompt, segments)


# --- warm-up ------------------------------------------------------------------------------------


SHORT_ROW = 64
"""Warm-up rows up to this many tokens (direct guesses) are batched apart from the long ones."""


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
    """Supervised training on the transcripts (AdamW, constant lr); returns the last batch's
    loss, the mean over the batch's model tokens."""
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


@torch.no_grad()
def continue_texts(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    prefixes: Sequence[list[int]],
    max_new_tokens: int,
    *,
    sample: bool,
) -> list[str]:
    """Each prefix's continuation (temperature 1 when ``sample``, else greedy), decoded, cut
    after the first ``</tool_call>`` as the runner's stop string cuts a turn."""
    width = max(len(ids) for ids in prefixes)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in prefixes])
    attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prefixes])
    was_training = model.training
    model.eval()
    output = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=max_new_tokens,
        do_sample=sample,
        temperature=1.0 if sample else None,
        top_k=0 if sample else None,
        top_p=1.0 if sample else None,
        pad_token_id=pad,
        eos_token_id=tokenizer.eos_token_id,
    )
    model.train(was_training)
    texts = tokenizer.batch_decode(output[:, width:], skip_special_tokens=True)
    return [
        text.split("</tool_call>")[0] + "</tool_call>" if "</tool_call>" in text else text for text in texts
    ]


def python_code_of(turn: str) -> str | None:
    """The code of a well-formed python call that is the whole turn; None for anything else."""
    match = _CALL.fullmatch(turn.strip())
    if match is None:
        return None
    try:
        body = json.loads(match.group(1))
    except ValueError:
        return None
    if not isinstance(body, dict) or body.get("name") != "python":
        return None
    arguments = body.get("arguments")
    if not isinstance(arguments, dict):
        return None
    code = arguments.get("code")
    return code if isinstance(code, str) else None


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
    firsts = continue_texts(model, tokenizer, prompts, call_budget, sample=True)
    codes = [python_code_of(text) for text in firsts]
    # Up to the observation's end, without the EOS that encode_transcript closes a transcript with.
    ideal = [
        encode_transcript(tokenizer, p.prompt, tool_transcript(p, recipe.observation)[:2])[0][:-1]
        for p in problems
    ]
    answers = continue_texts(model, tokenizer, ideal, 10, sample=False)
    rewards = [float(first.strip() == p.answer) for first, p in zip(firsts, problems, strict=True)]
    followups = []
    for index, (problem, first, code) in enumerate(zip(problems, firsts, codes, strict=True)):
        match = _PRODUCT_CODE.fullmatch(code or "")
        if match is not None:
            output = f"{int(match.group(1)) * int(match.group(2))}\n"
            segments = [(first, True), (observation_text(recipe.observation, output), False)]
            followups.append((index, encode_transcript(tokenizer, problem.prompt, segments)[0][:-1]))
    if followups:
        finals = continue_texts(model, tokenizer, [ids for _, ids in followups], 10, sample=True)
        for (index, _), final in zip(followups, finals, strict=True):
            rewards[index] = float(final.strip() == problems[index].answer)
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


# --- build and cache ----------------------------------------------------------------------------


def build_tool_model(
    name: str, recipe: ToolRecipe, out_dir: Path, *, progress: bool = True
) -> dict[str, Any]:
    """Build a tool model into ``out_dir`` (created) and return what was written to verst.json."""
    if recipe.task != "multiply":
        raise ValueError(f"no tool warm-up for task {recipe.task!r}: only 'multiply' has one")
    started = time.monotonic()
    tokenizer = build_tool_tokenizer()
    # fork_rng: seeding must not disturb the caller's random state.
    with _torch_threads(available_cpus()), torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.init_seed)
        model = LlamaForCausalLM(tool_llama_config(recipe, tokenizer))
        final_loss = warm_up_tools(model, tokenizer, recipe, progress=progress)
        torch.manual_seed(recipe.check_seed)
        checks = check_tool_use(model, tokenizer, recipe, multiply_eval_problems()[: recipe.check_prompts])
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    stamp = {
        "name": name,
        "recipe_hash": recipe.digest(name),
        "format_version": FORMAT_VERSION,
        "tool_format_version": TOOL_FORMAT_VERSION,
        "recipe": dataclasses.asdict(recipe),
        "parameters": sum(p.numel() for p in model.parameters()),
        "final_train_loss": final_loss,
        **checks,
        "check_prompts": recipe.check_prompts,
        "build_seconds": round(time.monotonic() - started, 2),
        "built_at": time.time(),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
    }
    (out_dir / STAMP_FILE).write_text(json.dumps(stamp, indent=2) + "\n")
    return stamp


def ensure_tool_model(
    name: str = "multiply",
    cache_dir: Path | None = None,
    *,
    recipe: ToolRecipe | None = None,
    progress: bool = True,
    lock_timeout_s: float = LOCK_TIMEOUT_S,
) -> Path:
    """The directory of tool model ``name``, building it first when the cache lacks it.

    Like ``basemodel.ensure_builtin_model``: ``recipe`` overrides the registered one, and
    concurrent processes build it once under a file lock.
    """
    if recipe is None:
        if name not in TOOL_MODELS:
            known = ", ".join(f"{BUILTIN_PREFIX}{n}" for n in sorted(TOOL_MODELS))
            raise ModelPathError(f"unknown builtin tool model {name!r}; known: {known}")
        recipe = TOOL_MODELS[name]
    recipe_hash = recipe.digest(name)
    models_dir = (cache_dir if cache_dir is not None else default_cache_dir()) / "models"
    model_dir = models_dir / f"{name}-{recipe_hash}"
    if _built(model_dir, recipe_hash):
        return model_dir
    models_dir.mkdir(parents=True, exist_ok=True)
    lock = filelock.FileLock(str(models_dir / f".{model_dir.name}.lock"))
    _acquire_build_lock(lock, model_dir, lock_timeout_s)
    try:
        if not _built(model_dir, recipe_hash):  # else another process built it while we waited
            _build_into_place(name, recipe, model_dir, progress=progress)
    finally:
        lock.release()
    return model_dir


def _built(model_dir: Path, recipe_hash: str) -> bool:
    stamp = read_stamp(model_dir)
    return stamp is not None and stamp.get("recipe_hash") == recipe_hash


def _build_into_place(name: str, recipe: ToolRecipe, final_dir: Path, *, progress: bool) -> None:
    """Build in a temporary sibling directory, then rename it to ``final_dir`` (atomic on POSIX)."""
    # Holding the lock, so any leftover temporary or incomplete directory is a crashed build's.
    for stale in final_dir.parent.glob(f".{final_dir.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    if final_dir.exists():
        log.warning("removing %s: it has no valid %s for recipe %s", final_dir, STAMP_FILE, final_dir.name)
        shutil.rmtree(final_dir)
    tmp_dir = final_dir.parent / f".{final_dir.name}.tmp-{os.getpid()}"
    log.info("building builtin tool model %r into %s (a minute or two on a laptop CPU)", name, final_dir)
    try:
        stamp = build_tool_model(name, recipe, tmp_dir, progress=progress)
        tmp_dir.rename(final_dir)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    log.info(
        "built %s in %.1fs: sampled tool calls %.2f, copy accuracy %.2f, simulated reward %.2f",
        *(final_dir.name, stamp["build_seconds"], stamp["sampled_tool_call_rate"]),
        *(stamp["copy_accuracy"], stamp["simulated_reward"]),
    )
