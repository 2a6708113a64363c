"""The pacing rule of a job's prompts, against cases worked out by hand."""

from __future__ import annotations

import pytest

from services.controller.pacing import Issue, batch_limit, plan_issue


@pytest.mark.parametrize(
    ("trainer", "staleness", "steps", "limit"),
    [
        (0, 1, 4, 2),  # batches 0 and 1: k <= 0 + 1
        (0, 0, 4, 1),  # max_staleness 0: only batch 0 before v1
        (3, 0, 4, 4),  # batch 3 at v3, and no batch 4 (steps 4)
        (1, 1, 4, 3),
        (1, 3, 10, 5),  # three versions of work ahead of the trainer
        (5, 1, 4, 4),  # never beyond trainer.steps
    ],
)
def test_batch_limit(trainer: int, staleness: int, steps: int, limit: int) -> None:
    assert batch_limit(trainer, max_staleness=staleness, steps=steps) == limit


def plan(**values: int) -> Issue:
    defaults = {
        "issued_batches": 0,
        "issued_extra": 0,
        "dropped": 0,
        "trainer_version": 0,
        "max_staleness": 1,
        "steps": 4,
        "prompts_per_step": 8,
        "oversample": 0.0,
    }
    return plan_issue(**(defaults | values))


def test_a_new_job_issues_the_first_batches_at_once() -> None:
    assert plan() == Issue(replacements=0, batches=range(0, 2))
    assert plan(max_staleness=0) == Issue(0, range(0, 1))


def test_issued_batches_are_not_issued_again() -> None:
    assert plan(issued_batches=2) == Issue(0, range(2, 2))
    assert plan(issued_batches=2, trainer_version=1) == Issue(0, range(2, 3))


def test_each_new_version_releases_the_next_batch_at_once() -> None:
    """max_staleness batches stay ahead of the trainer: at v2 batches up to 3 are out."""
    assert plan(issued_batches=2, trainer_version=2) == Issue(0, range(2, 4))
    assert plan(issued_batches=3, trainer_version=3, steps=10, max_staleness=2) == Issue(0, range(3, 6))


def test_nothing_more_once_every_batch_is_out() -> None:
    assert plan(issued_batches=4, trainer_version=3) == Issue(0, range(4, 4))


def test_every_dropped_group_gets_one_replacement_whatever_the_versions() -> None:
    assert plan(issued_batches=2, dropped=3).replacements == 3
    assert plan(issued_batches=2, dropped=3, issued_extra=1).replacements == 2
    assert plan(issued_batches=2, dropped=3, issued_extra=3).replacements == 0
    assert plan(dropped=2, max_staleness=0).replacements == 2
