"""The pure parts of bench/e2e.py: the shared hyper-parameters, what one run records, the time to
the target accuracy, medians and the final line. Nothing here starts a process or loads a model."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

Side = Literal["verst", "trl"]


@dataclass(frozen=True, slots=True)
class Hyper:
    """What both sides of the race train with; each side maps it onto its own configuration."""

    task: str
    """The bench task's name (bench/e2e_tasks.py)."""
    model_dir: str
    """The base model: a local Hugging Face directory, the same one for both sides."""
    group_size: int
    """Samples per prompt (verst algorithm.group_size, TRL num_generations)."""
    prompts_per_step: int
    """Prompts per optimiser step."""
    max_new_tokens: int
    """Longest sampled response, in tokens."""
    learning_rate: float
    """Constant learning rate of AdamW (no warm-up, no weight decay, gradient norm clipped at 1)."""
    clip_low: float
    """The ratio is clipped below at 1 - clip_low (TRL epsilon)."""
    clip_high: float
    """The ratio is clipped above at 1 + clip_high (TRL epsilon_high)."""
    seed: int
    """Seed of the training prompts' order, sampling and initialisation."""
    max_steps: int
    """Optimiser steps of one run."""
    eval_every: int
    """A checkpoint is evaluated every this many steps (and at step 0 and the last step)."""
    temperature: float = 1.0
    """Sampling temperature of the training rollouts."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute precision of both sides: float32, or bfloat16 matmuls over float32 weights (verst's
    trainer.autocast; TRL's bf16 mixed precision, its default)."""

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.group_size

    def eval_steps(self) -> list[int]:
        """The steps whose checkpoints are evaluated: 0, every eval_every, and the last."""
        return sorted({0, *range(self.eval_every, self.max_steps + 1, self.eval_every), self.max_steps})


@dataclass(slots=True)
class Point:
    """One evaluated checkpoint of a run."""

    step: int
    seconds: float
    """Training seconds from the end of step 1 to this checkpoint (evaluation excluded; 0 at step 0)."""
    accuracy: float | None = None
    """Held-out greedy accuracy (None until evaluated)."""
    checkpoint: str = ""
    """The checkpoint's directory (empty once it is deleted)."""


@dataclass(slots=True)
class Run:
    """One training run of one side: its evaluated checkpoints and what the machine did meanwhile."""

    side: Side
    pair: int
    points: list[Point] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    """Training seconds of every step from step 2 on, in order."""
    first_step_s: float = math.nan
    """Seconds from the side's start (TRL's on_train_begin, verst's checkpoint v0) to the end of step
    1: one-off warm-up that both clocks leave out."""
    other_load: float = math.nan
    """Average CPU cores that other processes kept busy during the run."""
    wall_s: float = math.nan
    """Wall seconds of the whole run, start-up and evaluation included."""
    note: str = ""
    seed: int | None = None
    """The seed it trained with (Hyper.seed, or that plus the pair's offset under --seed-per-pair)."""

    @property
    def steps(self) -> int:
        return max((p.step for p in self.points), default=0)

    @property
    def train_seconds(self) -> float:
        """Training seconds to the last step."""
        return max((p.seconds for p in self.points), default=0.0)

    @property
    def seconds_per_step(self) -> float:
        """Mean training seconds of the steps after step 1 (a mean, not a median: verst's steps
        come in pairs, one short and one long, when rollouts run a version ahead)."""
        if self.step_seconds:
            return sum(self.step_seconds) / len(self.step_seconds)
        return self.train_seconds / (self.steps - 1) if self.steps > 1 else math.nan

    def reached(self, target: float) -> Point | None:
        """The first evaluated checkpoint at or above ``target``; None if no checkpoint got there."""
        for point in sorted(self.points, key=lambda p: p.step):
            if point.accuracy is not None and point.accuracy >= target:
                return point
        return None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Run:
        points = [Point(**p) for p in data.get("points", [])]
        return cls(**{**data, "points": points})


def write_run(run: Run, path: Path) -> None:
    path.write_text(json.dumps(run.to_json(), indent=1))


def read_run(path: Path) -> Run:
    return Run.from_json(json.loads(path.read_text()))


@dataclass(frozen=True, slots=True)
class Outcome:
    """The race's result: per side the median training seconds to the target over its runs."""

    task: str
    target: float
    verst_s: float
    trl_s: float
    all_reached: bool
    """Every run of both sides reached the target (else the medians count a miss as infinite)."""

    @property
    def ratio(self) -> float:
        if not (math.isfinite(self.verst_s) and self.verst_s > 0):
            return math.nan
        return self.trl_s / self.verst_s

    def line(self) -> str:
        """The race's last line, e.g. ``e2e: task=addition verst_s=12.3 trl_s=25.0 ratio=2.03``."""
        return (
            f"e2e: task={self.task} verst_s={self.verst_s:.1f} trl_s={self.trl_s:.1f} ratio={self.ratio:.2f}"
        )


def seconds_to_target(run: Run, target: float) -> float:
    """Training seconds to the target accuracy; infinite when the run never got there."""
    point = run.reached(target)
    return point.seconds if point is not None else math.inf


def steps_to_target(run: Run, target: float) -> float:
    """The step of the run's first checkpoint at or above the target; infinite when none got there."""
    point = run.reached(target)
    return point.step if point is not None else math.inf


def median_of(runs: Sequence[Run], side: Side, measure: Callable[[Run], float]) -> float:
    """Median of ``measure`` over one side's runs (nan when it has none)."""
    values = [measure(run) for run in runs if run.side == side]
    return statistics.median(values) if values else math.nan


def median_seconds(runs: Sequence[Run], target: float) -> float:
    """Median over the runs of their seconds to target (a run that missed counts as infinite)."""
    if not runs:
        return math.nan
    return statistics.median(seconds_to_target(run, target) for run in runs)


def outcome(task: str, target: float, runs: Sequence[Run]) -> Outcome:
    verst = [r for r in runs if r.side == "verst"]
    trl = [r for r in runs if r.side == "trl"]
    return Outcome(
        task=task,
        target=target,
        verst_s=median_seconds(verst, target),
        trl_s=median_seconds(trl, target),
        all_reached=all(r.reached(target) is not None for r in runs),
    )


def pair_seed(base: int, pair: int, per_pair: bool) -> int:
    """The seed of both runs of ``pair`` (numbered from 1): ``base``, or ``base + pair - 1`` when
    each pair draws its own, so that a side's runs sample, order and initialise differently."""
    return base + pair - 1 if per_pair else base


def run_order(pairs: int) -> list[tuple[int, Side]]:
    """The alternating order of the runs: verst, TRL, verst, TRL, … (pairs numbered from 1)."""
    sides: tuple[Side, Side] = ("verst", "trl")
    return [(pair, side) for pair in range(1, pairs + 1) for side in sides]
