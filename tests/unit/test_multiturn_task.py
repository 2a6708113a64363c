"""The multiply task, its verifier (registered in the reward service's registry), the example
JobSpec that uses them, and the trainer's tool_use_rate metric."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from services.common.config import load_job_spec
from services.common.pb import common_pb2
from services.reward.task_verifiers import verify_multiply
from services.reward.verifiers import VERIFIERS
from services.tasks import TASKS, builtin_model, get_task
from services.tasks.multiply import (
    MULTIPLY_EVAL_SIZE,
    MultiplyProblem,
    ToolRecipe,
    multiply_eval_problems,
    multiply_train_problems,
)
from services.trainer.collector import Group
from services.trainer.report import tool_use_rate

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "multiturn.yaml"


def test_multiply_prompts_answers_and_disjoint_splits() -> None:
    assert MultiplyProblem(347, 829).prompt == "What is 347*829?"
    assert MultiplyProblem(347, 829).answer == "287663"
    held_out = multiply_eval_problems()
    assert len(held_out) == len(set(held_out)) == MULTIPLY_EVAL_SIZE
    train = list(itertools.islice(multiply_train_problems(0), 5000))
    assert not set(train) & set(held_out)
    assert all(317 <= p.a <= 999 and 317 <= p.b <= 999 and len(p.answer) == 6 for p in train)
    assert train == list(itertools.islice(multiply_train_problems(0), 5000))
    task = get_task("multiply")
    first = next(task.train(0))
    assert first.prompt_id == "multiply:train:0" and first.answer == str(train[0].a * train[0].b)
    assert task.eval()[0].text == held_out[0].prompt


def test_multiply_verifier_scores_the_answer_and_reports_tool_use() -> None:
    assert get_task("multiply").verifier == "multiply"
    assert VERIFIERS["multiply"] is verify_multiply
    assert all(task.verifier in VERIFIERS for task in TASKS.values())
    reward, components, info = verify_multiply(" 287663\n", "287663", {"tool_calls": "1", "tool_errors": "0"})
    assert reward == 1.0
    assert components == {"correct": 1.0, "format": 1.0, "used_tool": 1.0, "tool_errors": 0.0}
    assert info == {"parsed": "287663", "tool_calls": "1"}
    reward, components, _ = verify_multiply("512071", "287663", {})  # a direct guess: no counts
    assert reward == 0.0 and components["used_tool"] == 0.0 and components["format"] == 1.0
    reward, components, _ = verify_multiply("<tool_call>{}</tool_call>", "287663", {"tool_calls": "2"})
    assert reward == 0.0 and components["format"] == 0.0 and components["used_tool"] == 1.0
    with pytest.raises(ValueError, match="tool_calls"):
        verify_multiply("1", "1", {"tool_calls": "many"})


def test_the_example_spec_runs_the_multiply_task_with_the_python_tool() -> None:
    spec = load_job_spec(EXAMPLE)
    recipe = builtin_model("multiply").recipe
    assert spec.model.path == "builtin:multiply" and isinstance(recipe, ToolRecipe)
    assert spec.data.train == spec.data.eval == "builtin:multiply"
    assert spec.reward.verifier == "multiply"
    assert spec.rollout.max_turns == 3 and spec.rollout.tools == ["python"]
    # The warm-up showed the model this observation text; the job must show it the same.
    assert spec.rollout.tool_observation == recipe.observation
    assert spec.rollout.tool_call_format in ("hermes", "auto")
    assert spec.rollout.max_new_tokens + 17 <= recipe.max_position_embeddings


def _group(tool_calls: list[str | None]) -> Group:
    group = Group("g")
    for index, count in enumerate(tool_calls):
        metadata = {} if count is None else {"tool_calls": count}
        group.trajectories[f"t{index}"] = common_pb2.Trajectory(id=f"t{index}", metadata=metadata)
    return group


def test_tool_use_rate_counts_trajectories_with_a_call() -> None:
    assert tool_use_rate([_group(["1", "0", "3", None]), _group(["0", "0", "2", "0"])]) == 3 / 8
    assert tool_use_rate([_group([None, None])]) == 0.0
    assert tool_use_rate([]) == 0.0
