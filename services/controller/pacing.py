"""The pacing rule of a job's prompts, as pure functions of what has been issued and trained.

Batch k is issued as soon as k <= trainer version + max_staleness, and never beyond
``trainer.steps`` batches: the engines always have ``max_staleness`` versions of work ahead
of the trainer, so they never wait for its next version to start generating. Each prompt
carries the trainer's version when it was issued, and an engine samples it only with that
version or a newer one (GenerateRequest.min_policy_version; an engine still loading it waits
for it), so a batch is never sampled by weights more than max_staleness versions older than
those it is trained into. Every group the trainer dropped, and every prompt task or
trajectory dead-lettered (dead_letters.py), gets one replacement prompt, whatever the versions.

Over-sampling (``algorithm.oversample``, for jobs whose ``algorithm.filters`` drop groups): a
cushion of oversample x prompts_per_step prompts (rounded up) rides ahead of the batches, issued
as replacement prompts with the first ones, and every drop is still replaced at once. A group the
filters drop is covered by a cushion group already generated, so the step fills without waiting
for a replacement's round trip; the replacement refills the cushion. What is issued but not yet
trained or dropped stays bounded, at most (max_staleness + 1) x prompts_per_step plus the cushion
(and drops not yet reported): the cushion never grows with the steps. Set ``oversample`` near the
share the filters drop over the share they keep (drop a third: 0.5); with a larger one the
surplus groups wait, and one that waits beyond max_staleness is dropped as stale and replaced,
about the surplus each step (tests/unit/test_oversampling.py simulates both).
"""

from __future__ import annotations

import math
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


def cushion(*, prompts_per_step: int, oversample: float) -> int:
    """Prompts over-sampled ahead of the batches: ``oversample`` x one batch, rounded up."""
    return math.ceil(oversample * prompts_per_step - 1e-9)  # float error: 0.1 x 30 is 3, not 4


def plan_issue(
    *,
    issued_batches: int,
    issued_extra: int,
    dropped: int,
    trainer_version: int,
    max_staleness: int,
    steps: int,
    prompts_per_step: int,
    oversample: float,
) -> Issue:
    """The prompts to publish, given ``issued_batches`` batches and ``issued_extra`` replacements
    out so far, ``dropped`` groups dropped by the trainer, and the trainer's version: the batches
    the pacing lets out, and replacements for every drop plus the over-sampling cushion."""
    limit = batch_limit(trainer_version, max_staleness=max_staleness, steps=steps)
    spare = (
        cushion(prompts_per_step=prompts_per_step, oversample=oversample) if trainer_version < steps else 0
    )
    return Issue(
        replacements=max(0, dropped + spare - issued_extra),
        batches=range(issued_batches, max(issued_batches, limit)),
    )
