"""The pacing rule of a job's prompts, as pure functions of what has been issued and served.

Batch k is issued only while k <= min(trainer version, oldest version an engine
of the job serves) + max_staleness, and never beyond ``trainer.steps`` batches,
so rollouts never run more than max_staleness versions ahead of the trainer or
of the engines that generate them. Every group the trainer dropped gets one
replacement prompt, whatever the versions.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Issue:
    """What to publish now."""

    replacements: int
    """Replacement prompts for dropped groups (numbered from the issued ones on)."""
    batches: range
    """Indexes of the prompt batches to publish, in order."""
    waiting_for_engines: bool
    """The trainer's version allows more batches than the engines' does: look again soon."""


def batch_limit(trainer_version: int, served_version: int | None, *, max_staleness: int, steps: int) -> int:
    """How many prompt batches (0 up to ``steps``) may have been issued in all.

    ``served_version`` is the oldest version an engine of the job serves; None when
    no engine serves the job, and then no batch may go out.
    """
    if served_version is None:
        return 0
    return max(0, min(steps, min(trainer_version, served_version) + max_staleness + 1))


def plan_issue(
    *,
    issued_batches: int,
    issued_extra: int,
    dropped: int,
    trainer_version: int,
    served_version: int | None,
    max_staleness: int,
    steps: int,
) -> Issue:
    """The prompts to publish, given ``issued_batches`` batches and ``issued_extra`` replacements
    out so far, ``dropped`` groups dropped by the trainer, and the versions."""
    limit = batch_limit(trainer_version, served_version, max_staleness=max_staleness, steps=steps)
    trainer_limit = batch_limit(trainer_version, trainer_version, max_staleness=max_staleness, steps=steps)
    batches = range(issued_batches, max(issued_batches, limit))
    return Issue(
        replacements=max(0, dropped - issued_extra),
        batches=batches,
        waiting_for_engines=trainer_limit > batches.stop,
    )
