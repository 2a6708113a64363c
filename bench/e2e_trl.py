"""The TRL side of bench/e2e.py: one run of TRL's GRPOTrainer on the CPU (no vLLM), in its own
process so that its start-up and memory stay out of the next run.

    python -m bench.e2e_trl RUN_DIR      # reads RUN_DIR/hyper.json, writes RUN_DIR/run.json

The training clock starts at the end of optimiser step 1 (before it: building the model, tokenizer
and trainer, and the first step's one-off warm-up) and runs to the end of each later step; it is
paused while a callback saves the checkpoints that the race evaluates afterwards, so neither
start-up nor evaluation counts.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.e2e_runs import Hyper, Point, Run, write_run

HYPER_FILE = "hyper.json"
RUN_FILE = "run.json"


def trl_config(hp: Hyper, output_dir: Path) -> dict[str, Any]:
    """GRPOConfig keyword arguments that train with ``hp`` as verst does (bench/e2e_verst.py's spec).

    One generation of prompts_per_step x group_size samples per optimiser step, in one micro-batch;
    ``loss_type="dapo"`` divides the summed token losses by all the step's loss tokens, as
    verst's ``loss_aggregation: token_mean`` does; advantages are GRPO's (group mean and std).
    """
    return {
        "output_dir": str(output_dir),
        "seed": hp.seed,
        "data_seed": hp.seed,
        "max_steps": hp.max_steps,
        "learning_rate": hp.learning_rate,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "weight_decay": 0.0,
        "max_grad_norm": hp.max_grad_norm,
        "per_device_train_batch_size": hp.samples_per_step,
        "gradient_accumulation_steps": 1,
        "num_generations": hp.group_size,
        "max_completion_length": hp.max_new_tokens,
        "temperature": hp.temperature,
        "top_p": 1.0,
        "top_k": 0,
        "beta": 0.0,
        "epsilon": hp.clip_low,
        "epsilon_high": hp.clip_high,
        "num_iterations": 1,
        "loss_type": "dapo",
        "scale_rewards": "group",
        "shuffle_dataset": False,
        "use_cpu": True,
        "bf16": hp.dtype == "bfloat16",
        "fp16": False,
        "activation_checkpointing": False,  # TRL turns it on by default
        "model_init_kwargs": {"dtype": "float32"},  # master weights; bf16 autocasts the compute
        "report_to": "none",
        "logging_steps": hp.eval_every,
        "save_strategy": "no",
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "log_completions": False,
    }


class TrainingClock:
    """Training seconds since ``start``, less the paused intervals."""

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self.now = now
        self.started = now()
        self.paused = 0.0

    def start(self) -> None:
        self.started, self.paused = self.now(), 0.0

    def seconds(self) -> float:
        return self.now() - self.started - self.paused

    def pause_for(self, work: Callable[[], None]) -> None:
        """Run ``work`` with the clock stopped."""
        begin = self.now()
        try:
            work()
        finally:
            self.paused += self.now() - begin


def make_callback(hp: Hyper, run: Run, out_dir: Path) -> Any:
    """A TrainerCallback that times each step and saves the model at the race's eval steps."""
    from transformers import TrainerCallback

    eval_steps = set(hp.eval_steps())

    class RaceCallback(TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.clock = TrainingClock()
            self.last = 0.0

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.clock.start()
            run.points.append(Point(step=0, seconds=0.0))

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            seconds = self.clock.seconds()
            step = int(state.global_step)
            if step == 1:
                run.first_step_s = seconds
                self.clock.start()
                seconds = 0.0
            else:
                run.step_seconds.append(seconds - self.last)
            self.last = seconds
            if step in eval_steps:
                directory = out_dir / f"step{step:06d}"
                self.clock.pause_for(lambda: kwargs["model"].save_pretrained(directory))
                run.points.append(Point(step=step, seconds=seconds, checkpoint=str(directory)))

    return RaceCallback()


def train(hp: Hyper, run: Run, out_dir: Path, train_rows: list[dict[str, Any]], score: Any) -> None:
    """One GRPOTrainer run over ``train_rows`` (``prompt_rows``) in order; ``score(text, row)``
    rewards a completion of row number ``row``."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    def reward(prompts: list[Any], completions: list[Any], row: list[int], **_: Any) -> list[float]:
        return [score(completion_text(c), index) for c, index in zip(completions, row, strict=True)]

    tokenizer = AutoTokenizer.from_pretrained(hp.model_dir)
    trainer = GRPOTrainer(
        model=hp.model_dir,
        reward_funcs=[reward],
        args=GRPOConfig(**trl_config(hp, out_dir / "trainer")),
        train_dataset=Dataset.from_list(train_rows),
        processing_class=tokenizer,
        callbacks=[make_callback(hp, run, out_dir)],
    )
    trainer.train()


def completion_text(completion: str | list[dict[str, Any]]) -> str:
    """A completion's text: TRL gives a chat prompt's completion as ``[{"role": "assistant",
    "content": <its tokens decoded without special tokens>}]``, as verst's runner decodes them."""
    return completion if isinstance(completion, str) else str(completion[-1]["content"])


CHECKED_PROMPTS = 64
"""Leading training prompts whose TRL token ids are checked against verst's at every start."""


def prompt_rows(hp: Hyper, tokenizer: Any) -> tuple[list[dict[str, Any]], list[Any]]:
    """The training prompts of verst's job, in its order, as TRL rows (and the examples, which row
    ``row`` numbers) that TRL tokenizes to exactly the ids verst's prompt encoding gives: a text
    prompt with BOS written out as text, a chat prompt as the messages verst renders."""
    from bench.e2e_tasks import get_bench_task

    task = get_bench_task(hp.task)
    # one step's prompts more than the run takes: the last step is not also the end of an epoch
    examples = task.train_examples(hp.seed, (hp.max_steps + 1) * hp.prompts_per_step)
    if task.builtin:
        prompts: list[Any] = [tokenizer.bos_token + ex.text for ex in examples]
    else:
        prompts = [task.messages(tokenizer, ex) for ex in examples]
    checked = examples[:CHECKED_PROMPTS]
    trl_ids = trl_prompt_ids(tokenizer, prompts[: len(checked)])
    for prompt, ids, example in zip(prompts, trl_ids, checked, strict=False):
        if ids != task.encode(tokenizer, example):
            raise RuntimeError(f"TRL's prompt {prompt!r} tokenizes to {ids}, not verst's ids")
    return [{"prompt": prompt, "row": index} for index, prompt in enumerate(prompts)], examples


def trl_prompt_ids(tokenizer: Any, prompts: list[Any]) -> list[list[int]]:
    """The ids GRPOTrainer generates from (TRL 1.x ``_tokenize_prompts``): a text prompt through the
    tokenizer, chat messages through ``apply_chat_template`` with the assistant's turn opened."""
    if not prompts or isinstance(prompts[0], str):
        return [list(ids) for ids in tokenizer(text=prompts)["input_ids"]]
    rendered = tokenizer.apply_chat_template(
        conversation=prompts, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return [list(ids) for ids in rendered["input_ids"]]


def main(run_dir: Path) -> None:
    import torch
    from transformers import AutoTokenizer

    from bench.e2e_tasks import get_bench_task

    settings = json.loads((run_dir / HYPER_FILE).read_text())
    hp = Hyper(**settings["hyper"])
    torch.set_num_threads(settings["threads"])
    run = Run(side="trl", pair=settings["pair"])
    rows, examples = prompt_rows(hp, AutoTokenizer.from_pretrained(hp.model_dir))
    score = get_bench_task(hp.task).example_scorer()
    train(hp, run, run_dir, rows, lambda text, row: score(text, examples[row]))
    write_run(run, run_dir / RUN_FILE)


def write_settings(run_dir: Path, hp: Hyper, pair: int, threads: int) -> None:
    """What ``main`` reads in the child process."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / HYPER_FILE).write_text(json.dumps({"hyper": asdict(hp), "pair": pair, "threads": threads}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
