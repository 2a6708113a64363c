"""What the controller does with a job's dead letters: replace the work, stop a failure that repeats.

A dead-lettered prompt task, or trajectory (unless the trainer reports its group dropped itself:
``DeadLetter.no_replacement``), stood for one prompt's worth of work. The controller counts it
with the groups the trainer dropped (``JobStore.count_dropped``) and the feed publishes one
replacement prompt for it, so the job still gets its full number of groups. The entry may be
undecodable, so what is replaced is one prompt of the job's feed, not necessarily its prompt.

Replacing what fails would spin when every replacement fails the same way (a prompt no engine
accepts, a verifier that fails every sample): ``RepeatedFailures`` counts a job's dead letters by
reason since its last new policy version, with what differs from one entry to the next masked
(quoted text, numbers), and names the failure once one reason reaches the job's limit.
"""

from __future__ import annotations

import re
from collections import Counter

from services.common.config import JobSpec
from services.common.pb import common_pb2
from services.common.streams import JobStreams

_VARYING = re.compile(r"'[^']*'|\"[^\"]*\"|\b0x[0-9a-fA-F]+\b|\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
"""Parts of a reason that name one entry (ids, sizes, offsets) rather than the failure."""
_REASON_CHARS = 500
"""Characters of the repeated reason quoted in the job's failure."""


def failure_kind(reason: str) -> str:
    """A dead letter's reason with its entry-specific parts masked: the same failure, the same kind."""
    return _VARYING.sub("#", reason)


def replaces_work(letter: common_pb2.DeadLetter, streams: JobStreams) -> bool:
    """Whether a dead letter of the job (``streams``) stands for work a replacement prompt redoes."""
    if letter.source_stream == streams.prompts:
        return True
    return letter.source_stream == streams.trajectories and not letter.no_replacement


def failure_limit(minimum: int, spec: JobSpec) -> int:
    """Dead letters with one reason that fail the job: ``minimum``, or one step's samples if more."""
    return max(minimum, spec.rollout.prompts_per_step * spec.algorithm.group_size)


class RepeatedFailures:
    """A job's dead letters by kind of failure, since its last new policy version."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, not {limit}")
        self.limit = limit
        self._counts: Counter[str] = Counter()

    def progress(self) -> None:
        """The job made a new policy version: what failed before may have been passing trouble."""
        self._counts.clear()

    def add(self, letter: common_pb2.DeadLetter) -> str | None:
        """Count one dead letter; the job's failure reason when its kind reached the limit."""
        kind = failure_kind(letter.reason)
        self._counts[kind] += 1
        count = self._counts[kind]
        if count < self.limit:
            return None
        source = letter.source_stream.rsplit(":", 1)[-1]
        return (
            f"the same failure repeated: {count} entries dead-lettered for it without a new policy "
            f"version (the last from the {source} stream): {letter.reason[:_REASON_CHARS]}"
        )
