"""The pure parts of bench/e2e.py: time to target, medians and ratio, the final line, and the
mapping of one set of hyper-parameters onto verst's JobSpec and TRL's GRPOConfig."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench.e2e_report import curves_table, medians_line, section
from bench.e2e_runs import (
    Hyper,
    Outcome,
    Point,
    Run,
    median_of,
    outcome,
    pair_seed,
    read_run,
    run_order,
    seconds_to_target,
    steps_to_target,
    write_run,
)
from bench.e2e_tasks import BENCH_TASKS
from bench.e2e_trl import TrainingClock, make_callback, trl_config
from bench.e2e_verst import CheckpointCatcher, created_at, job_spec
from services.common.config import parse_job_spec

HP = Hyper(
    task="addition",
    model_dir="/models/a",
    seed=3,
    **{**BENCH_TASKS["addition"].hyper, "max_steps": 12, "eval_every": 5},
)


def run_of(side: str, pair: int, curve: list[tuple[int, float, float]]) -> Run:
    return Run(side=side, pair=pair, points=[Point(step, seconds, acc) for step, seconds, acc in curve])  # type: ignore[arg-type]


def test_eval_steps_are_zero_every_k_and_the_last() -> None:
    assert HP.eval_steps() == [0, 5, 10, 12]
    assert dataclasses.replace(HP, max_steps=10).eval_steps() == [0, 5, 10]


def test_time_to_target_is_the_first_checkpoint_at_or_above_it() -> None:
    run = run_of("verst", 1, [(10, 8.0, 0.7), (0, 0.0, 0.3), (5, 4.0, 0.6), (15, 12.0, 0.5)])
    assert run.reached(0.6) == Point(5, 4.0, 0.6)
    assert seconds_to_target(run, 0.6) == 4.0
    assert seconds_to_target(run, 0.65) == 8.0
    assert seconds_to_target(run, 0.8) == math.inf
    assert run.reached(0.8) is None


def test_unevaluated_points_never_reach_the_target() -> None:
    run = Run("trl", 1, [Point(0, 0.0, 0.2), Point(5, 3.0, None), Point(10, 6.0, 0.9)])
    assert seconds_to_target(run, 0.5) == 6.0


def test_seconds_per_step_is_the_mean_of_the_measured_steps() -> None:
    run = run_of("trl", 1, [(0, 0.0, 0.1), (11, 5.0, 0.5)])
    assert run.seconds_per_step == 0.5  # 10 steps after step 1 in 5 s
    run.step_seconds = [0.2, 0.8, 0.2, 0.8, 0.2, 0.8]  # verst's pairs: the median would say 0.5 by luck
    assert run.seconds_per_step == pytest.approx(0.5)
    run.step_seconds = [0.2, 0.2, 1.1]
    assert run.seconds_per_step == pytest.approx(0.5)


def test_medians_ratio_and_misses() -> None:
    runs = [
        run_of("verst", 1, [(0, 0, 0.3), (5, 2.0, 0.7)]),
        run_of("trl", 1, [(0, 0, 0.3), (5, 3.0, 0.5), (10, 6.0, 0.6)]),
        run_of("verst", 2, [(0, 0, 0.3), (5, 3.0, 0.6)]),
        run_of("trl", 2, [(0, 0, 0.3), (5, 3.5, 0.6)]),
        run_of("verst", 3, [(0, 0, 0.3), (5, 9.0, 0.5)]),  # missed: counts as infinite
        run_of("trl", 3, [(0, 0, 0.3), (5, 8.0, 0.65)]),
    ]
    result = outcome("addition", 0.6, runs)
    assert (result.verst_s, result.trl_s) == (3.0, 6.0)
    assert [steps_to_target(r, 0.6) for r in runs] == [5, 10, 5, 5, math.inf, 5]
    assert median_of(runs, "trl", lambda r: steps_to_target(r, 0.6)) == 5
    assert median_of(runs, "verst", lambda r: steps_to_target(r, 0.6)) == 5
    assert medians_line(runs, result).endswith("NOT every run reached the target")
    assert result.ratio == 2.0
    assert not result.all_reached
    assert outcome("addition", 0.6, [r for r in runs if r.pair < 3]).all_reached


def test_the_final_line() -> None:
    line = Outcome("addition", 0.6, verst_s=12.345, trl_s=25.0, all_reached=True).line()
    assert line == "e2e: task=addition verst_s=12.3 trl_s=25.0 ratio=2.03"
    missed = Outcome("addition", 0.6, verst_s=math.inf, trl_s=25.0, all_reached=False)
    assert missed.line() == "e2e: task=addition verst_s=inf trl_s=25.0 ratio=nan"


def test_runs_alternate_starting_with_verst() -> None:
    assert run_order(2) == [(1, "verst"), (1, "trl"), (2, "verst"), (2, "trl")]


def test_each_pair_draws_its_own_seed_only_when_asked() -> None:
    assert [pair_seed(7, pair, per_pair=True) for pair in (1, 2, 3)] == [7, 8, 9]
    assert [pair_seed(7, pair, per_pair=False) for pair in (1, 2, 3)] == [7, 7, 7]


def test_the_curves_end_with_each_sides_mean_and_name_the_seeds() -> None:
    runs = [
        run_of("verst", 1, [(0, 0, 0.25), (5, 2.0, 0.7)]),
        run_of("trl", 1, [(0, 0, 0.25), (5, 4.0, 0.6)]),
        run_of("verst", 2, [(0, 0, 0.25), (5, 2.0, 0.5)]),
        run_of("trl", 2, [(0, 0, 0.25), (5, 4.0, 0.3)]),
    ]
    for run in runs:
        run.seed = run.pair - 1
    head, _, first, last = curves_table(runs)
    assert head.startswith("| step | verst 1 (seed 0) | trl 1 (seed 0) | verst 2 (seed 1) |")
    assert head.endswith("| verst mean | trl mean |")
    assert first == "| 0 | 0.250 | 0.250 | 0.250 | 0.250 | 0.250 | 0.250 |"
    assert last == "| 5 | 0.700 | 0.600 | 0.500 | 0.300 | 0.600 | 0.450 |"


def test_run_json_round_trip(tmp_path: Path) -> None:
    run = Run("verst", 2, [Point(0, 0.0, 0.25), Point(5, 3.5, 0.5, "/x/v5")], [0.7, 0.6], 0.3, 40.0, "n")
    write_run(run, tmp_path / "run.json")
    assert read_run(tmp_path / "run.json") == run


def test_the_clock_leaves_out_paused_work() -> None:
    now = iter([0.0, 10.0, 11.0, 15.0, 18.0]).__next__
    clock = TrainingClock(now)  # reads 0.0
    clock.start()  # 10.0
    clock.pause_for(lambda: None)  # 11.0 .. 15.0 paused
    assert clock.seconds() == 18.0 - 10.0 - 4.0


def test_verst_spec_and_trl_config_carry_the_same_hyper_parameters(tmp_path: Path) -> None:
    task = BENCH_TASKS["addition"]
    spec = parse_job_spec(job_spec(HP, task, tmp_path / "ckpt", max_staleness=1))
    trl = trl_config(HP, tmp_path / "trl")
    assert spec.model.path == HP.model_dir and spec.seed == trl["seed"] == HP.seed
    assert spec.algorithm.group_size == trl["num_generations"] == HP.group_size
    assert spec.rollout.prompts_per_step == HP.prompts_per_step
    # TRL: one generation of prompts x group samples per optimiser step
    assert trl["per_device_train_batch_size"] * trl["gradient_accumulation_steps"] == HP.samples_per_step
    assert spec.rollout.max_new_tokens == trl["max_completion_length"] == HP.max_new_tokens
    assert spec.trainer.learning_rate == trl["learning_rate"] == HP.learning_rate
    assert (spec.algorithm.clip_low, spec.algorithm.clip_high) == (trl["epsilon"], trl["epsilon_high"])
    assert (HP.clip_low, HP.clip_high) == (trl["epsilon"], trl["epsilon_high"])
    assert spec.algorithm.kl_coef == trl["beta"] == 0.0
    assert spec.rollout.temperature == trl["temperature"] == 1.0
    assert (spec.rollout.top_p, spec.rollout.top_k) == (trl["top_p"], trl["top_k"]) == (1.0, 0)
    assert spec.trainer.steps == trl["max_steps"] == 12
    assert spec.trainer.max_grad_norm == trl["max_grad_norm"] == 1.0
    assert spec.trainer.weight_decay == trl["weight_decay"] == 0.0
    assert spec.trainer.warmup_steps == trl["warmup_steps"] == 0
    assert spec.trainer.scheduler == trl["lr_scheduler_type"] == "constant"
    assert (spec.algorithm.advantage, trl["scale_rewards"]) == ("grpo", "group")
    assert (spec.algorithm.loss_aggregation, trl["loss_type"]) == ("token_mean", "dapo")
    assert spec.trainer.ppo_epochs == trl["num_iterations"] == 1
    assert spec.data.train == task.data and spec.data.eval is None  # the race evaluates, not the job
    assert spec.reward.verifier == task.verifier
    assert trl["shuffle_dataset"] is False  # the prompts in verst's order


def test_the_trl_config_is_one_trl_accepts(tmp_path: Path) -> None:
    trl = pytest.importorskip("trl")
    config = trl.GRPOConfig(**trl_config(HP, tmp_path / "trl"))
    assert config.generation_batch_size == HP.samples_per_step
    assert config.steps_per_generation == 1
    assert config.activation_checkpointing is False and config.gradient_checkpointing is False
    assert (config.bf16, config.use_cpu, config.shuffle_dataset) == (False, True, False)


def weights_dir(job_dir: Path, version: int) -> Path:
    return job_dir / "weights" / f"v{version:06d}-e0"


def write_checkpoint(job_dir: Path, version: int, stamp: str) -> None:
    """A published version as the trainer writes it (services/trainer/checkpoints.py)."""
    directory = weights_dir(job_dir, version)
    directory.mkdir(parents=True)
    (directory / "model.safetensors").write_bytes(b"w")
    (directory / "handle.json").write_text(f'{{"version": {version}, "createdAt": "{stamp}"}}')


def test_the_catcher_times_every_version_and_keeps_the_eval_steps(tmp_path: Path) -> None:
    job_dir, out = tmp_path / "job", tmp_path / "out"
    catcher = CheckpointCatcher(job_dir, out, [0, 2, 3])
    catcher.poll()  # no directory yet
    write_checkpoint(job_dir, 0, "2026-01-01T00:00:00Z")
    write_checkpoint(job_dir, 1, "2026-01-01T00:00:01.250Z")
    (job_dir / "weights" / ".v000002-e0.tmp-1").mkdir()  # being written: not a version yet
    catcher.poll()
    write_checkpoint(job_dir, 2, "2026-01-01T00:00:02.500Z")
    write_checkpoint(job_dir, 3, "2026-01-01T00:00:04.000000001Z")
    catcher.poll()
    assert created_at(weights_dir(job_dir, 1)) - created_at(weights_dir(job_dir, 0)) == pytest.approx(1.25)
    run = catcher.run_of(pair=1)
    # the clock starts at v1: v0 to v1 is the first step's warm-up, kept apart
    assert [p.step for p in run.points] == [0, 2, 3]
    assert [p.seconds for p in run.points] == pytest.approx([0.0, 1.25, 2.75])
    assert run.step_seconds == pytest.approx([1.25, 1.5])
    assert run.first_step_s == pytest.approx(1.25)
    kept = Path(run.points[1].checkpoint)
    assert sorted(p.name for p in kept.iterdir()) == ["handle.json", "model.safetensors"]


def test_a_pruned_eval_checkpoint_is_an_error(tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    catcher = CheckpointCatcher(job_dir, tmp_path / "out", [0, 1, 2])
    write_checkpoint(job_dir, 0, "2026-01-01T00:00:00Z")
    write_checkpoint(job_dir, 2, "2026-01-01T00:00:02Z")  # v1 came and went between two polls
    with pytest.raises(RuntimeError, match="pruned"):
        catcher.poll()


def test_the_section_has_the_curves_and_the_final_line() -> None:
    runs = [
        run_of("verst", 1, [(0, 0, 0.25), (5, 2.0, 0.7)]),
        run_of("trl", 1, [(0, 0, 0.25), (5, 4.0, 0.6)]),
    ]
    result = outcome("addition", 0.6, runs)
    text = section("cmd", {"cpu": "x"}, ["- settings"], runs, result)
    assert "    e2e: task=addition verst_s=2.0 trl_s=4.0 ratio=2.00" in text
    assert curves_table(runs)[2:] == ["| 0 | 0.250 | 0.250 |", "| 5 | 0.700 | 0.600 |"]
    assert "warning" not in text  # the load of both runs is unknown (nan), not high
    runs[1].other_load = 0.8
    assert "warning: other processes kept more than 0.1 cores busy during trl 1 (0.80)" in section(
        "cmd", {}, [], runs, result
    )


def test_the_trl_callback_saves_at_the_eval_steps_and_leaves_step_one_out(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    saved: list[Path] = []

    class Model:
        def save_pretrained(self, directory: Path) -> None:
            saved.append(directory)

    run = Run("trl", 1)
    callback = make_callback(HP, run, tmp_path)
    callback.on_train_begin(None, None, None)
    for step in range(1, HP.max_steps + 1):
        callback.on_step_end(None, SimpleNamespace(global_step=step), None, model=Model())
    assert [p.step for p in run.points] == HP.eval_steps()
    assert saved == [tmp_path / f"step{s:06d}" for s in HP.eval_steps()[1:]]
    assert len(run.step_seconds) == HP.max_steps - 1 and run.first_step_s >= 0
    assert [p.seconds for p in run.points] == sorted(p.seconds for p in run.points)
