"""bench/e2e.py's section of bench/RESULTS.md and its per-run lines."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from bench.e2e_runs import Hyper, Outcome, Run, median_of, seconds_to_target, steps_to_target
from bench.e2e_tasks import BenchTask
from bench.report import BUSY_MACHINE

SECTION_TITLE = "## e2e (bench/e2e.py)"
"""The addition race's section; every other task has its own (``section_title``)."""
NOTES_MARKER = "<!-- notes: written by hand; bench/e2e.py keeps everything from here to the next section -->"
DESCRIPTION = """
The race: verst (the real services started by `services.stack.Stack`, one job submitted over
REST) against TRL's `GRPOTrainer` (CPU, no vLLM, in its own process) on the same base model, the
same training prompts in the same order, the same reward (the task's scorer), group size, prompts
per step, max new tokens, learning rate (constant AdamW, no warm-up, no weight decay, gradient norm
clipped at 1), clip range and seed, with no KL term. The runs alternate verst, TRL, verst, TRL, …;
each trains for the same number of steps and saves a checkpoint every `eval_every` steps, and
afterwards one evaluator (plain transformers, batched greedy decoding, left padding) scores every
checkpoint of both sides on the same held-out prompts. A run's time to target is its training
seconds to its first checkpoint at or above the target accuracy, counted on both sides from the
end of step 1: everything before it is start-up (services, model loads, verst's engines loading
checkpoint v0, the first step's one-off warm-up; its seconds are listed as "start to step 1").
For TRL the clock runs to the end of the optimiser step and is paused while the checkpoint is
saved; for verst it runs from checkpoint v1's `created_at` to that version's `created_at`.
Evaluation is outside both clocks. ratio = median TRL seconds / median verst seconds.
"""
DIFFERENCES = """
Differences between the sides that the race does not remove:

- verst overlaps rollout and training (`algorithm.max_staleness`, see the settings above): a
  step's samples may come from the policy one version behind, each token's loss weighed by decoupled
  PPO's behaviour weight p_old / p_behaviour (capped at 5; `off_policy_correction`, the default);
  TRL samples each step with the current weights. On both sides the ratio's denominator is the
  trainer's own logprobs under the weights before the step, taken from the training forward itself
  (one optimiser step per batch), so the ratio is 1 and the clip never acts.
- Advantages: both (r - group mean) / (group std + eps) with the unbiased std; eps is 1e-6 in
  verst, 1e-4 in TRL.
- Sampling: verst's engine samples with its own RNG (seeded by the job's seed), TRL with
  transformers' `generate` (seeded by `seed`), so the samples differ; TRL's runs repeat exactly on
  the CPU, verst's vary with the timing of its asynchronous services.
- TRL writes a text prompt with BOS spelled out as text, and gets a chat prompt (`--task smollm2`)
  as the messages verst renders, which it renders with the same chat template; either way its
  prompt ids are exactly those verst's prompt encoding gives (checked at every TRL start).
- Precision (`--dtype`): in float32 both sides compute in float32. In bfloat16 verst runs
  `trainer.autocast: bfloat16` with its LM head in float32 and its engines in float32; TRL runs
  accelerate's bf16 autocast (`bf16=True`) over its whole forward, LM head included. Both keep float32
  weights and AdamW state.
"""


def fmt_s(value: float) -> str:
    """Seconds to target as text: ``10.6 s``, or ``not reached``."""
    return f"{value:.1f} s" if math.isfinite(value) else "not reached"


def run_line(run: Run, target: float) -> str:
    """One run's figures, as printed after it and listed in the section."""
    hit = run.reached(target)
    final = max(run.points, key=lambda p: p.step)
    reached = f"step {hit.step} (accuracy {hit.accuracy:.3f})" if hit else "not reached"
    parts = [
        f"{run.side} run {run.pair}: target {target:g} at {reached}",
        f"{fmt_s(seconds_to_target(run, target))} to target",
        f"{run.seconds_per_step:.3f} s/step",
        f"accuracy {final.accuracy or 0:.3f} at step {final.step}",
        f"other load {run.other_load:.2f} cores",
    ]
    return ", ".join(parts) + (f"; {run.note}" if run.note else "")


def settings_lines(
    hp: Hyper, task: BenchTask, max_staleness: int, threads: int, seed_per_pair: bool = False
) -> list[str]:
    seed = f"seed {hp.seed} + pair - 1 (both runs of a pair alike)" if seed_per_pair else f"seed {hp.seed}"
    data = "" if task.builtin else f" (chat template, options {dict(task.options)})"
    return [
        f"- task {task.name} ({task.bound}-bound): base model {task.model} ({hp.model_dir}), prompts"
        f" {task.data}{data}, reward: the task's scorer (verst verifier `{task.verifier}`)",
        f"- {hp.prompts_per_step} prompts x {hp.group_size} samples per step, max_new_tokens"
        f" {hp.max_new_tokens}, temperature {hp.temperature:g}, learning rate {hp.learning_rate:g}, clip"
        f" {hp.clip_low:g} / {hp.clip_high:g}, {seed}, {hp.max_steps} steps, checkpoints evaluated"
        f" every {hp.eval_every} steps, {hp.dtype}",
        f"- verst: algorithm.max_staleness {max_staleness}, the services' default threads; TRL:"
        f" torch threads {threads}, loss_type dapo (token mean over the step), one micro-batch per step",
    ]


def runs_table(runs: Sequence[Run], target: float) -> list[str]:
    rows = [
        "| run | steps to target | time to target | s/step (mean) | final accuracy"
        " | start to step 1, s | other load, cores |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for run in runs:
        hit = run.reached(target)
        final = max(run.points, key=lambda p: p.step)
        rows.append(
            f"| {run.side} {run.pair} | {hit.step if hit else '-'} | {fmt_s(seconds_to_target(run, target))}"
            f" | {run.seconds_per_step:.3f} | {final.accuracy or 0:.3f} | {run.first_step_s:.1f}"
            f" | {run.other_load:.2f} |"
        )
    return rows


def curves_table(runs: Sequence[Run]) -> list[str]:
    """Held-out greedy accuracy per evaluated step, one column per run, then each side's mean over
    its runs where it has more than one."""
    steps = sorted({p.step for run in runs for p in run.points})
    by_run = [{p.step: p.accuracy for p in run.points} for run in runs]
    sides = [side for side in ("verst", "trl") if sum(run.side == side for run in runs) > 1]
    seeded = len({run.seed for run in runs}) > 1
    names = [f"{run.side} {run.pair}" + (f" (seed {run.seed})" if seeded else "") for run in runs]
    head = "| step | " + " | ".join([*names, *(f"{side} mean" for side in sides)]) + " |"
    rows = [head, "|---:|" + "---:|" * (len(runs) + len(sides))]
    for step in steps:
        cells = [f"{acc[step]:.3f}" if acc.get(step) is not None else "" for acc in by_run]
        for side in sides:
            values = [acc[step] for run, acc in zip(runs, by_run, strict=True)
                      if run.side == side and acc.get(step) is not None]  # fmt: skip
            cells.append(f"{statistics.mean(values):.3f}" if values else "")
        rows.append(f"| {step} | " + " | ".join(cells) + " |")
    return rows


def load_warning(runs: Sequence[Run]) -> str:
    """A warning naming the runs during which other processes kept the machine busy ('' if none)."""
    busy = [f"{run.side} {run.pair} ({run.other_load:.2f})" for run in runs if run.other_load > BUSY_MACHINE]
    if not busy:
        return ""
    return (
        f"warning: other processes kept more than {BUSY_MACHINE} cores busy during {', '.join(busy)}:"
        " those runs' seconds are high"
    )


def medians_line(runs: Sequence[Run], result: Outcome) -> str:
    """Per side, the medians over its runs: seconds and steps to target, seconds per step."""
    target = result.target
    steps = {side: median_of(runs, side, lambda r: steps_to_target(r, target)) for side in ("verst", "trl")}
    per_step = {side: median_of(runs, side, lambda r: r.seconds_per_step) for side in ("verst", "trl")}
    return (
        f"Medians: verst {fmt_s(result.verst_s)}, TRL {fmt_s(result.trl_s)} to accuracy {target:g};"
        f" steps to it verst {steps['verst']:g}, TRL {steps['trl']:g}; seconds per step verst"
        f" {per_step['verst']:.3f}, TRL {per_step['trl']:.3f}"
        + ("" if result.all_reached else "; NOT every run reached the target")
    )


def final_accuracy(run: Run) -> float:
    """Held-out accuracy at the run's last evaluated step (nan when it is not evaluated)."""
    final = max(run.points, key=lambda p: p.step, default=None)
    return math.nan if final is None or final.accuracy is None else final.accuracy


def steps_line(task: str, runs: Sequence[Run]) -> str:
    """What a race of a fixed number of steps shows, per side the median over its runs: seconds per
    step, held-out accuracy after the last step; and TRL's seconds per step over verst's, e.g.
    ``e2e steps: task=smollm2 steps=30 verst_step_s=13.100 trl_step_s=20.000 step_ratio=1.53
    verst_accuracy=0.700 trl_accuracy=0.675``."""
    per_step = {side: median_of(runs, side, lambda r: r.seconds_per_step) for side in ("verst", "trl")}
    accuracy = {side: median_of(runs, side, final_accuracy) for side in ("verst", "trl")}
    ratio = per_step["trl"] / per_step["verst"] if per_step["verst"] > 0 else math.nan
    return (
        f"e2e steps: task={task} steps={max((run.steps for run in runs), default=0)}"
        f" verst_step_s={per_step['verst']:.3f} trl_step_s={per_step['trl']:.3f} step_ratio={ratio:.2f}"
        f" verst_accuracy={accuracy['verst']:.3f} trl_accuracy={accuracy['trl']:.3f}"
    )


def section_title(task: str) -> str:
    """The RESULTS.md section of the race on ``task``: one per task, so that a race on one task
    leaves the others' results alone."""
    return SECTION_TITLE if task == "addition" else f"## e2e (bench/e2e.py --task {task})"


def section(
    command: str, host: dict[str, str], settings: list[str], runs: Sequence[Run], result: Outcome
) -> str:
    """This benchmark's section of RESULTS.md, up to (not including) its notes."""
    lines = [
        section_title(result.task),
        "",
        *DESCRIPTION.strip("\n").splitlines(),
        "",
        f"    {command}",
        "",
        *(f"- {key}: {value}" for key, value in host.items()),
        *settings,
        "",
        *runs_table(runs, result.target),
        "",
        medians_line(runs, result),
        *([load_warning(runs)] if load_warning(runs) else []),
        "",
        f"    {steps_line(result.task, runs)}",
        f"    {result.line()}",
        "",
        "Held-out greedy accuracy per step (every run, the same evaluator and held-out prompts):",
        "",
        *curves_table(runs),
        "",
        *DIFFERENCES.strip("\n").splitlines(),
    ]
    return "\n".join(lines) + "\n"
