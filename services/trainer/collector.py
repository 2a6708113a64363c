"""Gathers a job's trajectories into complete groups (the samples of one prompt).

The bus has checked each entry's payload (services/common/payloads.py: an id, a group, this
job); what makes a group untrainable is checked here, so that the whole group is dropped.

Idempotent by trajectory id: an id trained before is reported so the caller
acks it without training it again; a second delivery of an id still buffered
is kept only for its ack, and one of a group already trained or dropped
is reported for an immediate ack. A group is complete with ``group_size`` distinct
trajectories. A complete group is unusable when a member is malformed or
unscored (dead-lettered by the caller with the reason), or stale: its oldest
token was sampled by a policy version below the allowed minimum.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass, field

from services.common.bus import Delivery
from services.common.pb import common_pb2

Trajectory = common_pb2.Trajectory


class Outcome(enum.Enum):
    BUFFERED = "buffered"
    """Kept: its group is not complete yet, or it just completed it."""
    REDELIVERED = "redelivered"
    """An id already buffered: kept only to be acked with its group."""
    DONE = "done"
    """An id trained in an earlier step, or of a group already dropped: ack it now."""
    REJECTED = "rejected"
    """Cannot join any group (see the reason): dead-letter it now."""
    SURPLUS = "surplus"
    """Another member of a group that was complete without it: dead-letter it now (its group
    needs no replacement)."""


@dataclass(slots=True)
class Group:
    group_id: str
    trajectories: dict[str, Trajectory] = field(default_factory=dict)
    deliveries: list[Delivery[Trajectory]] = field(default_factory=list)
    """Every delivery of its members, redeliveries included: all are acked together."""
    problems: list[str] = field(default_factory=list)

    @property
    def oldest_version(self) -> int | None:
        """The lowest policy version of any token of the group; None without tokens."""
        versions = [min(t.policy_versions) for t in self.trajectories.values() if t.policy_versions]
        return min(versions) if versions else None

    @property
    def newest_version(self) -> int | None:
        """The highest policy version of any token of the group; None without tokens."""
        versions = [max(t.policy_versions) for t in self.trajectories.values() if t.policy_versions]
        return max(versions) if versions else None

    def ordered(self) -> list[Trajectory]:
        """The members by sample index (then id), so advantages line up deterministically."""
        return sorted(self.trajectories.values(), key=lambda t: (t.sample_index, t.id))


@dataclass(slots=True)
class Unusable:
    """Complete groups that will not be trained, and why."""

    stale: list[Group] = field(default_factory=list)
    invalid: list[Group] = field(default_factory=list)
    foreign: list[Group] = field(default_factory=list)
    """Sampled by weights that are not this trainer's lineage, or older than its de-duplication
    window (see ``discard_unusable``); reported like stale ones."""


def trajectory_problem(trajectory: Trajectory, job_id: str, group_size: int) -> str | None:
    """Why a trajectory cannot be trained on, or None when it can."""
    n = len(trajectory.response_token_ids)
    aligned = {
        "behaviour_logprobs": len(trajectory.behaviour_logprobs),
        "loss_mask": len(trajectory.loss_mask),
        "policy_versions": len(trajectory.policy_versions),
    }
    misaligned = [f"{name} has {count}" for name, count in aligned.items() if count != n]
    if trajectory.job_id != job_id:
        return f"job_id {trajectory.job_id!r} is not this job {job_id!r}"
    if trajectory.reward_error:
        return f"scoring failed: {trajectory.reward_error}"
    if misaligned:
        return f"{n} response tokens but " + ", ".join(misaligned)
    if not trajectory.prompt_token_ids:
        return "no prompt tokens"
    if trajectory.group_size and trajectory.group_size != group_size:
        return f"group_size {trajectory.group_size} differs from the job's {group_size}"
    if not 0 <= trajectory.sample_index < group_size:
        return f"sample_index {trajectory.sample_index} is outside 0..{group_size - 1}"
    if not math.isfinite(trajectory.reward):
        return f"reward {trajectory.reward} is not finite"
    if not all(math.isfinite(value) for value in trajectory.behaviour_logprobs):
        return "a behaviour logprob is not finite"
    return None


class GroupCollector:
    """Buffers trajectories by group until groups are complete."""

    def __init__(self, job_id: str, group_size: int, trained_ids: Container[str]) -> None:
        self.job_id = job_id
        self.group_size = group_size
        self.trained_ids = trained_ids
        """Ids trained recently (a TrainedWindow); shared with the caller, which adds each step's ids."""
        self._open: dict[str, Group] = {}
        self._complete: dict[str, Group] = {}
        self._finished: set[str] = set()
        self._group_of: dict[str, str] = {}

    def add(self, delivery: Delivery[Trajectory]) -> tuple[Outcome, str]:
        """File one delivery; returns what happened and, for REJECTED, why."""
        trajectory = delivery.message
        group_id = self._group_of.get(trajectory.id)
        if trajectory.id in self.trained_ids or group_id in self._finished:
            return Outcome.DONE, ""
        if group_id is not None:
            group = self._open.get(group_id) or self._complete[group_id]
            group.deliveries.append(delivery)
            return Outcome.REDELIVERED, ""
        if not trajectory.id or not trajectory.group_id:
            return Outcome.REJECTED, "trajectory has no id or no group_id"
        if trajectory.group_id in self._finished or trajectory.group_id in self._complete:
            return Outcome.SURPLUS, f"group {trajectory.group_id!r} already had {self.group_size} members"
        group = self._open.setdefault(trajectory.group_id, Group(trajectory.group_id))
        group.trajectories[trajectory.id] = trajectory
        group.deliveries.append(delivery)
        self._group_of[trajectory.id] = group.group_id
        problem = trajectory_problem(trajectory, self.job_id, self.group_size)
        if problem:
            group.problems.append(f"trajectory {trajectory.id!r}: {problem}")
        if len(group.trajectories) >= self.group_size:
            self._complete[group.group_id] = self._open.pop(group.group_id)
        return Outcome.BUFFERED, ""

    def discard_unusable(self, min_version: int, foreign: Callable[[Group], bool] | None = None) -> Unusable:
        """Remove complete groups that are invalid, older than ``min_version``, or ``foreign``."""
        unusable = Unusable()
        for group in list(self._complete.values()):
            oldest = group.oldest_version
            if group.problems:
                unusable.invalid.append(group)
            elif oldest is not None and oldest < min_version:
                unusable.stale.append(group)
            elif foreign is not None and foreign(group):
                unusable.foreign.append(group)
            else:
                continue
            self._finish(group)
        return unusable

    @property
    def complete(self) -> int:
        return len(self._complete)

    def take(self, count: int) -> list[Group]:
        """The ``count`` earliest complete groups, removed from the buffer."""
        taken = list(self._complete.values())[:count]
        for group in taken:
            self._finish(group)
        return taken

    def buffered_entry_ids(self) -> list[str]:
        """Stream entries held in the buffer (unacked), for keep-alives."""
        groups = [*self._open.values(), *self._complete.values()]
        return [delivery.entry_id for group in groups for delivery in group.deliveries]

    def _finish(self, group: Group) -> None:
        del self._complete[group.group_id]
        self._finished.add(group.group_id)


class TrainedWindow:
    """The trajectory ids a trainer skips as trained already: those trained since the last
    durable checkpoint, and the manifests of the ``depth`` durable checkpoints before (at most
    ``depth + 1`` checkpoint intervals of ids, however long the run).

    Why that is enough: trained trajectories are acked right after the durable checkpoint that
    covers them, before the next one is begun, so the only trained ids the stream can still
    deliver (unacked) are the newest manifest's, when a trainer died between its write and the
    acks; its successor resumes from that checkpoint and skips them. Ids trained after it are
    not in the surviving weights and are trained again, once. What remains is a producer that
    publishes an id again (a runner's retry); one within the window is skipped, and a copy of
    one trained before the window's ``floor`` version has all its tokens older than the floor:
    the trainer drops such groups whatever the stale policy (job.py), so ``downweight`` cannot
    train it twice either.
    """

    def __init__(self, depth: int, floor: int = 0) -> None:
        self._sealed: deque[tuple[int, frozenset[str]]] = deque(maxlen=depth)
        self._open: set[str] = set()
        self._floor = floor

    def __contains__(self, trajectory_id: object) -> bool:
        return trajectory_id in self._open or any(trajectory_id in ids for _, ids in self._sealed)

    @property
    def floor(self) -> int:
        """Every id trained into a version above this one is in the window."""
        return self._sealed[0][0] if self._sealed else self._floor

    def add(self, trajectory_ids: Iterable[str]) -> None:
        self._open.update(trajectory_ids)

    def since_durable(self) -> list[str]:
        """The ids trained since the last durable checkpoint: its successor's manifest."""
        return sorted(self._open)

    def seal(self, since_version: int, ids: Iterable[str] | None = None) -> None:
        """A durable checkpoint covered ``ids`` (default: those since the last one), trained
        after version ``since_version``; the oldest manifest leaves the window when it is full."""
        self._sealed.append((since_version, frozenset(self._open if ids is None else ids)))
        if ids is None:
            self._open = set()
