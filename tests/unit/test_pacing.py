"""The pacing rule of a job's prompts, against cases worked out by hand."""

from __future__ import annotations

import pytest

from services.api.pacing import Issue, batch_limit, plan_issue


@pytest.mark.parametrize(
    ("trainer", "served", "staleness", "steps", "limit"),
    [
        (0, 0, 1, 4, 2),  # batches 0 and 1: k <= 0 + 1
        (0, 0, 0, 4, 1),  # max_staleness 0: only batch 0 before v1
        (3, 3, 0, 4, 4),  # batch 3 at v3, and no batch 4 (steps 4)
        (1, 0, 1, 4, 2),  # the engines lag: bound by what they serve
        (1, 1, 1, 4, 3),
        (5, 2, 1, 4, 4),  # never beyond trainer.steps
        (2, 5, 1, 10, 4),  # engines ahead of the trainer's published version: bound by the trainer
        (0, None, 3, 4, 0),  # no engine serves the job: nothing goes out
    ],
)
def test_batch_limit(trainer: int, served: int | None, staleness: int, steps: int, limit: int) -> None:
    assert batch_limit(trainer, served, max_staleness=staleness, steps=steps) == limit


def plan(**values: int | None) -> Issue:
    defaults: dict[str, int | None] = {
        "issued_batches": 0,
        "issued_extra": 0,
        "dropped": 0,
        "trainer_version": 0,
        "served_version": 0,
        "max_staleness": 1,
        "steps": 4,
    }
    return plan_issue(**(defaults | values))  # type: ignore[arg-type]


def test_a_new_job_issues_the_first_batches_at_once() -> None:
    assert plan() == Issue(replacements=0, batches=range(0, 2), waiting_for_engines=False)
    assert plan(max_staleness=0) == Issue(0, range(0, 1), False)


def test_issued_batches_are_not_issued_again() -> None:
    assert plan(issued_batches=2) == Issue(0, range(2, 2), False)
    assert plan(issued_batches=2, trainer_version=1, served_version=1) == Issue(0, range(2, 3), False)


def test_lagging_engines_hold_batches_back_and_are_asked_again() -> None:
    """The trainer is at v2, the engines still serve v0: batch 2 waits (k <= 0 + 1)."""
    lagging = plan(issued_batches=2, trainer_version=2, served_version=0)
    assert lagging == Issue(0, range(2, 2), waiting_for_engines=True)
    caught_up = plan(issued_batches=2, trainer_version=2, served_version=2)
    assert caught_up == Issue(0, range(2, 4), waiting_for_engines=False)
    assert plan(issued_batches=1, trainer_version=3, served_version=None, max_staleness=0) == Issue(
        0, range(1, 1), True
    )


def test_no_waiting_once_every_batch_is_out() -> None:
    assert plan(issued_batches=4, trainer_version=3, served_version=0) == Issue(0, range(4, 4), False)


def test_every_dropped_group_gets_one_replacement_whatever_the_versions() -> None:
    assert plan(issued_batches=2, dropped=3).replacements == 3
    assert plan(issued_batches=2, dropped=3, issued_extra=1).replacements == 2
    assert plan(issued_batches=2, dropped=3, issued_extra=3).replacements == 0
    assert plan(dropped=2, served_version=None, max_staleness=0).replacements == 2
