"""The pacing rule of a job's prompts, as pure functions of what has been issued and trained.

Batch k is issued as soon as k <= trainer version + max_staleness, and never beyond
``trainer.steps`` batches: the engines always have ``max_staleness`` versions of work ahead
of the trainer, so they never wait for its next version to start generating. Each prompt
carries the trainer's version when it was issued, and an engine samples it only with that
version or a newer one (GenerateRequest.min_policy_version; an engine still loading it waits
for it), so a batch is never sampled by weights more than max_staleness versions older than
those it is trained into. Every group the trainer dropped, and every prompt task or
trajectory dead-lettered (dead_letters.py), gets one replacement prompt, whatever the versions.
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


def batch_limit(trainer_version: int, *, max_staleness: int, steps: int) -> int:
    """How many prompt batches (0 up to ``steps``) may have been issued in all."""
    return max(0, min(steps, trainer_version + max_staleness + 1))


def plan_issue(
    *,
    issued_batches: int,
    issued_extra: int,
    dropped: int,
    trainer_version: int,
    max_staleness: int,
    steps: int,
) -> Issue:
    """The prompts to publish, given ``issued_batches`` batches and ``issued_extra`` replacements
    out so far, ``dropped`` groups dropped by the trainer, and the trainer's version."""
    limit = batch_limit(trainer_version, max_staleness=max_staleness, steps=steps)
    return Issue(
        replacements=max(0, dropped - issued_extra),
        batches=range(issued_batches, max(issued_batches, limit)),
    )
