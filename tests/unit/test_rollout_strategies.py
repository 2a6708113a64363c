"""Rollout strategies: the registry of names and traits the JobSpec checks against, and how the
runner loads a strategy (a built-in, or a user's ``module:function``) or fails its task clearly."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from services.common.config import JobSpecError, RolloutConfig, parse_job_spec
from services.common.pb import common_pb2
from services.common.rollout_strategies import ROLLOUT_STRATEGIES, strategy_name
from services.runner.episode import roll_out_episodes
from services.runner.group import InvalidTaskError, roll_out_group
from services.runner.strategy import check_trajectories, load_strategy

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = "examples.plugins.rollout_strategy:retry_with_hint"


def errors_of(data: object) -> dict[str, str]:
    with pytest.raises(JobSpecError) as caught:
        parse_job_spec(data)
    return dict(caught.value.errors)


def test_the_built_ins_and_their_traits() -> None:
    assert ROLLOUT_STRATEGIES.names() == ("group", "tool_episode")
    assert ROLLOUT_STRATEGIES.where(multi_turn=True) == {"tool_episode"}
    assert ROLLOUT_STRATEGIES.where(uses_tools=True) == {"tool_episode"}
    assert ROLLOUT_STRATEGIES.get("group").fn is roll_out_group
    assert ROLLOUT_STRATEGIES.get("tool_episode").fn is roll_out_episodes


def test_auto_picks_by_turns() -> None:
    assert strategy_name("auto", 1) == "group" and strategy_name("auto", 3) == "tool_episode"
    assert strategy_name("group", 1) == "group" and strategy_name(EXAMPLE, 5) == EXAMPLE
    assert load_strategy(RolloutConfig()).fn is roll_out_group
    assert load_strategy(RolloutConfig(max_turns=3, tools=["python"])).fn is roll_out_episodes


@pytest.mark.parametrize(
    ("rollout", "says"),
    [
        (
            {"strategy": "beam"},
            "rollout.strategy 'beam' is not available in this runner (available: group, tool_episode)",
        ),
        (
            {"strategy": "tool_episode"},
            "'tool_episode' is multi-turn: it needs rollout.max_turns >= 2, not 1",
        ),
        ({"strategy": "group", "max_turns": 3}, "'group' takes one turn: rollout.max_turns must be 1, not 3"),
        ({"strategy": "my loop:run"}, "'my loop:run' is not module:function"),
        ({"strategy": ""}, "at least 1 character"),
    ],
)
def test_the_job_spec_rejects_a_strategy_naming_the_field(rollout: dict[str, object], says: str) -> None:
    errors = errors_of({"rollout": rollout})
    assert set(errors) == {"rollout.strategy"}, errors
    assert says in errors["rollout.strategy"]


def test_the_job_spec_takes_a_user_path_without_importing_it() -> None:
    spec = parse_job_spec({"rollout": {"strategy": "nowhere_module.loops:mine", "max_turns": 2}})
    assert spec.rollout.strategy == "nowhere_module.loops:mine"
    assert "nowhere_module" not in sys.modules


def test_validating_a_job_spec_imports_neither_the_runner_nor_grpc() -> None:
    """The API validates JobSpecs: the names and traits it checks come without the implementations."""
    code = textwrap.dedent(
        """
        import sys
        from services.common.config import parse_job_spec
        parse_job_spec({"rollout": {"strategy": "tool_episode", "max_turns": 2},
                        "reward": {"shaping": [{"type": "overlong_penalty", "buffer_tokens": 4}]}})
        loaded = [m for m in ("services.runner.group", "services.runner.episode", "grpc", "torch")
                  if m in sys.modules]
        assert loaded == [], loaded
        """
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, timeout=60)


def test_a_user_strategy_is_loaded_with_the_traits_it_declares() -> None:
    entry = load_strategy(RolloutConfig(strategy=EXAMPLE, max_turns=2))
    assert (entry.name, entry.multi_turn, entry.uses_tools) == (EXAMPLE, True, False)
    with pytest.raises(
        InvalidTaskError, match=r"rollout.strategy .*multi-turn: it needs rollout.max_turns >= 2"
    ):
        load_strategy(RolloutConfig(strategy=EXAMPLE))


@pytest.fixture
def user_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder on the import path for modules a test writes."""
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


@pytest.mark.parametrize(
    ("source", "path", "says"),
    [
        (
            None,
            "missing_strategies:loop",
            "rollout.strategy (rollout strategy) 'missing_strategies:loop': cannot import",
        ),
        ("", "empty_strategies:loop", "module 'empty_strategies' has no 'loop'"),
        (
            "raise RuntimeError('no GPU here')",
            "failing_strategies:loop",
            "cannot be loaded: RuntimeError('no GPU here')",
        ),
        (
            "from services.common.plugins import traits\n@traits(beam_width=4)\nasync def loop(task, c): ...",
            "odd_strategies:loop",
            "declares unknown traits ['beam_width']",
        ),
        ("", "os:system", "may not come from the standard library"),
    ],
)
def test_a_strategy_that_cannot_be_loaded_fails_the_task_naming_the_field(
    user_modules: Path, source: str | None, path: str, says: str
) -> None:
    module = path.split(":")[0]
    if source is not None and module != "os":
        (user_modules / f"{module}.py").write_text(source)
    with pytest.raises(InvalidTaskError) as caught:
        load_strategy(RolloutConfig(strategy=path))
    assert "rollout.strategy" in str(caught.value) and says in str(caught.value)


def _trajectory(task: common_pb2.PromptTask, index: int, tokens: int = 2) -> common_pb2.Trajectory:
    return common_pb2.Trajectory(
        id=f"{task.prompt_id}:{index}",
        job_id=task.job_id,
        prompt_id=task.prompt_id,
        sample_index=index,
        response_token_ids=[5] * tokens,
        behaviour_logprobs=[-0.1] * tokens,
        policy_versions=[1] * tokens,
        loss_mask=[True] * tokens,
    )


def test_what_a_strategy_returns_must_be_the_tasks_group() -> None:
    task = common_pb2.PromptTask(prompt_id="j:0:0", job_id="j", n_samples=3)
    group = [_trajectory(task, i) for i in range(3)]
    check_trajectories("mine", task, group)
    with pytest.raises(InvalidTaskError, match=r"'mine' returned samples \[0, 1\] for n_samples=3"):
        check_trajectories("mine", task, group[:2])
    misaligned = [*group[:2], _trajectory(task, 2)]
    misaligned[2].loss_mask.append(True)
    with pytest.raises(InvalidTaskError, match="do not align"):
        check_trajectories("mine", task, misaligned)
    foreign = [*group[:2], _trajectory(common_pb2.PromptTask(prompt_id="j:0:1", job_id="j"), 2)]
    with pytest.raises(InvalidTaskError, match="is not of task 'j:0:0'"):
        check_trajectories("mine", task, foreign)
