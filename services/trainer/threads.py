"""How many torch threads a CPU trainer's steps run on: tried over a job's first steps, not guessed.

On a CPU the trainer shares the host's cores with its engines. Whether a step is faster on all
of its threads or on half depends on the model and on how busy the engines are: an OpenMP team
waits at the end of every operation for its slowest thread, and a thread that an engine has
preempted holds up all of them. On two cores the demo's addition model (537,600 parameters)
stepped faster in the loop on one thread than on two (0.080 against 0.085-0.090 s a step) although
alone it trains 1.4x faster on two; the reversal model (5.1M) stepped faster on two (1.35
against 1.77 s). So the first steps of a job alternate between the candidates, timed per token,
and the trainer keeps the faster (``ThreadChoice``).
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Sequence

import torch

log = logging.getLogger(__name__)

TORCH_DEFAULT_THREADS = torch.get_num_threads()
"""Torch's threads before any job chose its own (a job's choice stays set in the process)."""

MIN_TRIALS = 3
"""Steps timed on each candidate at least: the choice is made then if one stands apart."""
MAX_TRIALS = 8
"""Steps timed on each candidate at most: then the lower median wins."""
WARMUP_STEPS = 2
"""A job's first steps, not timed: their one-off work (allocations, first kernels) would count."""
LONGEST_TRIED_STEP_S = 5.0
"""A job whose second step takes longer keeps all its threads untried: each trial on the slower
count would cost seconds, and such steps vary too much for a few trials to tell (SmolLM2 in float32
on two cores: 20.6-59.9 s over steps 3-10 of one job, alternating the counts, undecided after
four each)."""


def job_threads(configured: int) -> int:
    """The threads a job starts from: ``trainer.torch_threads``, or with 0 torch's default (not
    what the last job chose)."""
    return configured or TORCH_DEFAULT_THREADS


def candidates(threads: int, tune: bool) -> tuple[int, ...]:
    """The thread counts to try: ``threads`` and half of it, or ``threads`` alone."""
    half = max(1, threads // 2)
    return (threads, half) if tune and half < threads else (threads,)


class ThreadChoice:
    """The thread count of each step of one job: the first candidate over the warm-up steps, then
    the candidates in turn, each step timed, until one stands apart (after ``min_trials`` each:
    its median below every step of the others, its slowest step below their medians) or
    ``max_trials`` each are timed (then the lower median wins); then that one for good. A warm-up
    step but the first (its one-off work) longer than ``longest_step_s`` ends it at once, on the
    first candidate. On two cores the demo's model's candidates differ by 10-20% a step, about
    as much as its steps vary, while the reversal model's differ by 15-20% with steps that vary
    less."""

    def __init__(
        self,
        choices: Sequence[int],
        min_trials: int = MIN_TRIALS,
        max_trials: int = MAX_TRIALS,
        warmup: int = WARMUP_STEPS,
        longest_step_s: float = LONGEST_TRIED_STEP_S,
    ) -> None:
        if (
            not choices
            or min(choices) < 1
            or not 1 <= min_trials <= max_trials
            or min(warmup, longest_step_s) < 0
        ):
            raise ValueError(
                "ThreadChoice needs thread counts >= 1, 1 <= min_trials <= max_trials, warmup >= 0, "
                "longest_step_s >= 0"
            )
        self.choices = tuple(choices)
        self.min_trials, self.max_trials = min_trials, max_trials
        self.warmup = warmup
        self.longest_step_s = longest_step_s
        self.chosen: int | None = self.choices[0] if len(self.choices) == 1 else None
        """The count kept, once the trials are over (at once with one candidate)."""
        self.seconds_per_token: dict[int, list[float]] = {count: [] for count in self.choices}
        self._steps = 0

    def next(self) -> int:
        """The thread count of the coming step."""
        if self.chosen is not None:
            return self.chosen
        timed = self._steps - self.warmup
        return self.choices[0] if timed < 0 else self.choices[timed % len(self.choices)]

    def record(self, threads: int, seconds: float, tokens: int) -> None:
        """A step on ``threads`` took ``seconds`` over ``tokens`` (a step without tokens, or one
        of the warm-up, is not timed)."""
        timed = self._steps >= self.warmup
        self._steps += 1
        if self.chosen is None and not timed and self._steps > 1 and seconds > self.longest_step_s:
            self.chosen = self.choices[0]
            log.info("trainer steps on %d torch threads, untried: a step took %.1f s", self.chosen, seconds)
        if self.chosen is not None or not timed or tokens <= 0 or threads not in self.seconds_per_token:
            return
        self.seconds_per_token[threads].append(seconds / tokens)
        self.chosen = self._decided()
        if self.chosen is not None:
            shown = ", ".join(
                f"{count}: median {statistics.median(times) * 1e6:.1f} us/token over {len(times)} steps"
                for count, times in self.seconds_per_token.items()
            )
            log.info("trainer steps on %d torch threads from now on (%s)", self.chosen, shown)

    def _decided(self) -> int | None:
        times = self.seconds_per_token
        trials = min(len(t) for t in times.values())
        if trials >= self.max_trials:
            return min(self.choices, key=lambda count: statistics.median(times[count]))
        if trials >= self.min_trials:
            for count in self.choices:
                others = [times[other] for other in self.choices if other != count]
                if statistics.median(times[count]) < min(min(t) for t in others) and max(times[count]) < min(
                    statistics.median(t) for t in others
                ):
                    return count
        return None
