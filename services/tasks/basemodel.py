"""The models verst prepares itself (``builtin:<name>``), built once and cached.

``builtin:addition`` is a 0.5M-parameter Llama with a character tokenizer,
warmed up by supervised training on *noisy* labels: each target is the correct
reversed sum with probability ``p_correct``, otherwise the sum with the carries
dropped. Greedy decoding then mostly answers the carry-dropped sum (held-out
accuracy 0.265 with the default recipe) while the correct answer keeps real
probability mass (samples at temperature 1 are right about half the time), so
GRPO has something to sharpen: 16 prompts x 8 samples per step took it to 0.8
in 30 steps at lr 5e-5.

A build is deterministic (seeded) and takes one to two minutes on two CPU cores.
It lands in ``$VERST_CACHE`` (default ``~/.cache/verst``) under
``models/<name>-<recipe hash>``, a Hugging Face directory (model.safetensors,
config.json, tokenizer files) plus ``verst.json``, the recipe and the build's
held-out accuracy. The directory is built under a temporary name and renamed
into place, with a file lock so that concurrent processes build it once; a
changed recipe has a new hash, hence a new directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import random
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

from services.tasks.catalog import (
    BUILTIN_PREFIX,
    AdditionProblem,
    PromptExample,
    addition_train_problems,
    encode_prompt,
    get_task,
)

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
"""Part of every recipe hash: raise it when the build code changes what it produces."""
STAMP_FILE = "verst.json"
"""The file in a built model directory that records its recipe and build results."""
LOCK_TIMEOUT_S = 900.0
"""How long a process waits for another one's build of the same model before giving up."""
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
"""Ids 0..3 of the character tokenizer, in this order."""


class ModelPathError(ValueError):
    """A model path names no builtin model or no existing directory."""


@dataclasses.dataclass(frozen=True)
class WarmupRecipe:
    """Everything that determines a builtin model's weights; its hash names the cache directory."""

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


BUILTIN_MODELS: dict[str, WarmupRecipe] = {"addition": WarmupRecipe()}
"""Builtin model name -> the recipe that builds it."""


# --- tokenizer and architecture -----------------------------------------------------------------


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable ASCII character (ids 4..98) after the four special tokens.

    It adds no special tokens on its own; ``tasks.encode_prompt`` prepends BOS.
    """
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    for code in range(32, 127):
        vocab[chr(code)] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )


def tiny_llama_config(
    recipe: WarmupRecipe, tokenizer: PreTrainedTokenizerFast, *, rope_theta: float = 10_000.0
) -> LlamaConfig:
    """The Llama architecture of a builtin model (537,600 parameters with the default recipe);
    ``recipe`` may be any recipe with the same shape fields (the tool models' too)."""
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


# --- warm-up ------------------------------------------------------------------------------------


def carry_dropped_answer(problem: AdditionProblem) -> str:
    """The plausible wrong answer the warm-up teaches: digit-wise sums mod 10, reversed.

    47+85 -> digits (7+5)%10=2, (4+8)%10=2 -> 22 -> "22". Built as a number, so
    zero high digits vanish as they would in a real sum (46+14 -> 50 -> "05").
    """
    total, place, a, b = 0, 1, problem.a, problem.b
    while a or b:
        total += ((a % 10 + b % 10) % 10) * place
        a, b, place = a // 10, b // 10, place * 10
    return str(total)[::-1]


def _noisy_batches(
    recipe: WarmupRecipe, tokenizer: PreTrainedTokenizerFast
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless (input_ids, labels) batches, right-padded; labels are -100 outside the answer+EOS."""
    problems = addition_train_problems(recipe.data_seed)
    label_rng = random.Random(recipe.label_seed)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
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
        length = max(len(p) + len(t) for p, t in rows)
        input_ids = torch.full((len(rows), length), pad, dtype=torch.long)
        labels = torch.full((len(rows), length), -100, dtype=torch.long)
        for row, (prompt_ids, target_ids) in enumerate(rows):
            end = len(prompt_ids) + len(target_ids)
            input_ids[row, :end] = torch.tensor(prompt_ids + target_ids)
            labels[row, len(prompt_ids) : end] = torch.tensor(target_ids)
        yield input_ids, labels


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
    model.train()
    loss_value = float("nan")
    bar = tqdm(range(recipe.steps), desc="warm-up", unit="step", disable=not progress, mininterval=1.0)
    for step in bar:
        input_ids, labels = next(batches)
        attention_mask = (input_ids != tokenizer.pad_token_id).long()
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss_value = loss.item()
        if step % 20 == 0:
            bar.set_postfix(loss=f"{loss_value:.3f}")
    bar.close()
    return loss_value


@torch.no_grad()
def greedy_accuracy(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    examples: Sequence[PromptExample],
    task_name: str,
    max_new_tokens: int,
) -> float:
    """Fraction of ``examples`` whose greedy response the task's verifier scores 1, in one batch.

    Prompts are left-padded so that every row's response starts at the same column.
    """
    score = get_task(task_name).score
    prompts = [encode_prompt(tokenizer, example.text) for example in examples]
    width = max(len(ids) for ids in prompts)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in prompts])
    attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts])
    was_training = model.training
    model.eval()
    output = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=pad,
        eos_token_id=tokenizer.eos_token_id,
    )
    model.train(was_training)
    responses = tokenizer.batch_decode(output[:, width:], skip_special_tokens=True)
    rewards = [score(text, example.answer)[0] for text, example in zip(responses, examples, strict=True)]
    return sum(rewards) / len(rewards)


def available_cpus() -> int:
    """CPUs this process may run on (the affinity mask, which containers narrow)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


@contextlib.contextmanager
def _torch_threads(count: int) -> Iterator[None]:
    """Run with ``count`` intra-op threads, then restore the caller's setting."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def build_model(name: str, recipe: WarmupRecipe, out_dir: Path, *, progress: bool = True) -> dict[str, Any]:
    """Build a builtin model into ``out_dir`` (created) and return what was written to verst.json."""
    if recipe.task != "addition":
        raise ValueError(f"no warm-up for task {recipe.task!r}: only 'addition' has one")
    started = time.monotonic()
    tokenizer = build_char_tokenizer()
    # fork_rng: seeding must not disturb the caller's random state.
    with _torch_threads(available_cpus()), torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.init_seed)
        model = LlamaForCausalLM(tiny_llama_config(recipe, tokenizer))
        final_loss = warm_up(model, tokenizer, recipe, progress=progress)
        eval_examples = get_task(recipe.task).eval()
        accuracy = greedy_accuracy(model, tokenizer, eval_examples, recipe.task, recipe.eval_max_new_tokens)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    stamp = {
        "name": name,
        "recipe_hash": recipe.digest(name),
        "format_version": FORMAT_VERSION,
        "recipe": dataclasses.asdict(recipe),
        "parameters": sum(p.numel() for p in model.parameters()),
        "final_train_loss": final_loss,
        "eval_greedy_accuracy": accuracy,
        "eval_prompts": len(eval_examples),
        "build_seconds": round(time.monotonic() - started, 2),
        "built_at": time.time(),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
    }
    (out_dir / STAMP_FILE).write_text(json.dumps(stamp, indent=2) + "\n")
    return stamp


# --- the cache ----------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """``$VERST_CACHE``, else ``~/.cache/verst``."""
    configured = os.environ.get("VERST_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "verst"


def read_stamp(model_dir: Path) -> dict[str, Any] | None:
    """The verst.json of a built model directory, or None when it is missing or unreadable."""
    try:
        stamp = json.loads((model_dir / STAMP_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return stamp if isinstance(stamp, dict) else None


def _is_built(model_dir: Path, recipe_hash: str) -> bool:
    stamp = read_stamp(model_dir)
    return stamp is not None and stamp.get("recipe_hash") == recipe_hash


def cached_model_paths(name: str, recipe: WarmupRecipe, cache_dir: Path | None = None) -> tuple[Path, Path]:
    """(model directory, lock file) of a builtin model in the cache."""
    models_dir = (cache_dir if cache_dir is not None else default_cache_dir()) / "models"
    model_dir = models_dir / f"{name}-{recipe.digest(name)}"
    return model_dir, models_dir / f".{model_dir.name}.lock"


def ensure_builtin_model(
    name: str = "addition",
    cache_dir: Path | None = None,
    *,
    recipe: WarmupRecipe | None = None,
    progress: bool = True,
    lock_timeout_s: float = LOCK_TIMEOUT_S,
) -> Path:
    """The directory of builtin model ``name``, building it first when the cache lacks it.

    ``recipe`` overrides the registered one (tests use a tiny recipe). Safe to
    call from several processes at once: one builds, the others wait on the
    lock (at most ``lock_timeout_s``, then TimeoutError) and reuse the result.
    """
    if recipe is None:
        if name not in BUILTIN_MODELS:
            known = ", ".join(f"{BUILTIN_PREFIX}{n}" for n in sorted(BUILTIN_MODELS))
            raise ModelPathError(f"unknown builtin model {name!r}; known: {known}")
        recipe = BUILTIN_MODELS[name]
    recipe_hash = recipe.digest(name)
    model_dir, lock_path = cached_model_paths(name, recipe, cache_dir)
    if _is_built(model_dir, recipe_hash):
        return model_dir
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    lock = filelock.FileLock(str(lock_path))
    _acquire_build_lock(lock, model_dir, lock_timeout_s)
    try:
        if not _is_built(model_dir, recipe_hash):  # else another process built it while we waited
            _build_into_place(name, recipe, model_dir, progress=progress)
    finally:
        lock.release()
    return model_dir


def _acquire_build_lock(lock: filelock.FileLock, model_dir: Path, timeout_s: float) -> None:
    try:
        lock.acquire(blocking=False)
        return
    except filelock.Timeout:
        log.info("waiting up to %gs for another process building %s", timeout_s, model_dir)
    try:
        lock.acquire(timeout=timeout_s)
    except filelock.Timeout:
        raise TimeoutError(
            f"waited {timeout_s:g}s for another process building {model_dir}; "
            f"if none is running, delete {lock.lock_file}"
        ) from None


def _build_into_place(name: str, recipe: WarmupRecipe, final_dir: Path, *, progress: bool) -> None:
    """Build in a temporary sibling directory, then rename it to ``final_dir`` (atomic on POSIX)."""
    # Holding the lock, so any leftover temporary or incomplete directory is a crashed build's.
    for stale in final_dir.parent.glob(f".{final_dir.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    if final_dir.exists():
        log.warning("removing %s: it has no valid %s for recipe %s", final_dir, STAMP_FILE, final_dir.name)
        shutil.rmtree(final_dir)
    tmp_dir = final_dir.parent / f".{final_dir.name}.tmp-{os.getpid()}"
    log.info("building builtin model %r into %s (about a minute on a laptop CPU)", name, final_dir)
    try:
        stamp = build_model(name, recipe, tmp_dir, progress=progress)
        tmp_dir.rename(final_dir)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    log.info(
        "built %s in %.1fs: held-out greedy accuracy %.3f",
        final_dir.name,
        stamp["build_seconds"],
        stamp["eval_greedy_accuracy"],
    )


def resolve_model_path(path: str) -> Path:
    """``builtin:<name>`` -> the built model's directory; else an existing local directory."""
    if path.startswith(BUILTIN_PREFIX):
        from services.tasks.toolmodel import TOOL_MODELS, ensure_tool_model  # it imports this module

        name = path.removeprefix(BUILTIN_PREFIX)
        return ensure_tool_model(name) if name in TOOL_MODELS else ensure_builtin_model(name)
    directory = Path(path).expanduser()
    if not directory.exists():
        raise ModelPathError(f"model path {path!r} does not exist")
    if not directory.is_dir():
        raise ModelPathError(f"model path {path!r} is not a directory")
    return directory.resolve()
