"""Over-sampling (algorithm.oversample) in the pacing rule (controller/pacing.py), simulated with
a trainer whose group filters drop groups: the cushion spares the trainer the replacements' round
trips, and what is issued but unused stays bounded whatever the filters do."""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from services.controller.pacing import cushion, plan_issue


@dataclass
class Loop:
    """The controller issues by ``plan_issue`` at each new version and at each drop (the trainer
    reports drops at once); a prompt issued at tick t is a generated group at tick t + 1; the
    trainer takes generated groups in the order issued, drops those beyond max_staleness and
    those ``filtered`` names (by issue number), and waits a tick when none is generated yet."""

    prompts_per_step: int
    oversample: float
    filtered: Callable[[int], bool]
    max_staleness: int = 1
    steps: int = 60
    batches: int = 0
    extra: int = 0
    dropped: int = 0
    stale: int = 0
    version: int = 0
    tick: int = 0
    waits: int = 0
    lags: list[int] = field(default_factory=list)
    outstanding: list[int] = field(default_factory=list)
    """Issued but neither trained nor dropped, after each step's issue."""
    queue: deque[tuple[int, int, int]] = field(default_factory=deque)
    """(issue number, version when issued, tick when generated)."""

    @property
    def issued(self) -> int:
        return self.batches * self.prompts_per_step + self.extra

    def issue(self) -> None:
        plan = plan_issue(
            issued_batches=self.batches, issued_extra=self.extra, dropped=self.dropped,
            trainer_version=self.version, max_staleness=self.max_staleness, steps=self.steps,
            prompts_per_step=self.prompts_per_step, oversample=self.oversample,
        )  # fmt: skip
        new = plan.replacements + len(plan.batches) * self.prompts_per_step
        self.queue.extend((self.issued + i, self.version, self.tick + 1) for i in range(new))
        self.extra += plan.replacements
        self.batches = max(self.batches, plan.batches.stop)

    def run(self) -> Loop:
        self.issue()
        self.tick += 1
        while self.version < self.steps:
            taken = 0
            while taken < self.prompts_per_step:
                if self.queue[0][2] > self.tick:  # nothing generated yet: wait for it
                    self.waits += 1
                    self.tick += 1
                    continue
                number, issued_at, _ = self.queue.popleft()
                lag = self.version - issued_at
                if lag > self.max_staleness or self.filtered(number):
                    self.stale += lag > self.max_staleness
                    self.dropped += 1
                    self.issue()
                else:
                    taken += 1
                    self.lags.append(lag)
            self.version += 1
            self.tick += 1
            self.issue()
            self.outstanding.append(self.issued - self.version * self.prompts_per_step - self.dropped)
        return self


def every_third(number: int) -> bool:
    return number % 3 == 2


def test_a_cushion_matched_to_the_filters_spares_every_round_trip() -> None:
    """A third of the groups filtered and oversample 0.5: no step waits for a replacement and no
    group goes stale; without over-sampling nearly every step waits."""
    matched = Loop(6, 0.5, every_third).run()
    assert (matched.waits, matched.stale, max(matched.lags)) == (0, 0, 1)
    plain = Loop(6, 0.0, every_third).run()
    assert plain.waits >= plain.steps - 1 and plain.stale == 0
    # The cushion costs its own prompts once: every drop is replaced, one for one, either way.
    assert matched.extra == matched.dropped + cushion(prompts_per_step=6, oversample=0.5)
    assert plain.extra == plain.dropped
    assert matched.issued - plain.issued == 3 + matched.dropped - plain.dropped


@pytest.mark.parametrize(
    ("oversample", "share", "max_staleness"),
    [(0.5, 0.0, 1), (1.0, 0.0, 1), (2.0, 0.0, 2), (0.5, 1 / 3, 1), (1.0, 1 / 3, 1), (0.25, 0.5, 2)],
)
def test_issued_but_unused_work_stays_bounded(oversample: float, share: float, max_staleness: int) -> None:
    """Whether the cushion is too large (nothing filtered), matched or too small, what is out stays
    within the pacing's window plus the cushion, never growing with the steps; a surplus the
    filters do not use waits, and what waits beyond max_staleness is dropped, about the cushion
    per step at most."""
    rng = random.Random(0)
    drops = [rng.random() < share for _ in range(100_000)]
    loop = Loop(8, oversample, drops.__getitem__, max_staleness=max_staleness, steps=120).run()
    spare = cushion(prompts_per_step=8, oversample=oversample)
    window = (max_staleness + 1) * 8
    assert max(loop.outstanding) <= window + spare
    assert max(loop.outstanding[60:]) <= max(loop.outstanding[:60])  # no growth
    assert max(loop.lags) <= max_staleness
    assert loop.stale <= spare * loop.steps
    assert loop.extra == loop.dropped + spare  # every drop replaced, the cushion once


def test_the_cushion_is_oversample_times_one_batch_rounded_up() -> None:
    assert cushion(prompts_per_step=16, oversample=0.5) == 8
    assert cushion(prompts_per_step=30, oversample=0.1) == 3  # not 4 from 0.1 * 30's float error
    assert cushion(prompts_per_step=5, oversample=0.5) == 3
    assert cushion(prompts_per_step=8, oversample=0.0) == 0


def plan(**values: float) -> int:
    defaults = {"issued_batches": 2, "issued_extra": 0, "dropped": 0, "trainer_version": 0,
                "max_staleness": 1, "steps": 4, "prompts_per_step": 8, "oversample": 0.5}  # fmt: skip
    return plan_issue(**(defaults | values)).replacements  # type: ignore[arg-type]


def test_the_cushion_is_issued_once_and_refilled_drop_for_drop() -> None:
    assert plan() == 4  # with the first batches
    assert plan(issued_extra=4) == 0
    assert plan(issued_extra=4, dropped=3) == 3  # each drop refills it
    assert plan(issued_extra=4, dropped=3, trainer_version=3) == 3
    assert plan(issued_extra=4, dropped=3, trainer_version=4) == 0  # after the last step: no cushion
