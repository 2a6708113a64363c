"""What a running job reports: its progress (the Trainer service's GetStatus) and each step's
metric values."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field

from services.common.pb import common_pb2, trainer_pb2
from services.trainer.collector import Group
from services.trainer.objective import StepStats
from services.trainer.prepare import Prepared


@dataclass(slots=True)
class Progress:
    """What the Trainer service's GetStatus reports; updated by the running job."""

    trainer_id: str
    job_id: str = ""
    state: int = trainer_pb2.TRAINER_STATE_IDLE
    policy_version: int = 0
    step: int = 0
    consumed_trajectories: int = 0
    last_checkpoint: common_pb2.CheckpointHandle | None = None
    last_metrics: dict[str, float] = field(default_factory=dict)

    def to_proto(self) -> trainer_pb2.TrainerStatus:
        status = trainer_pb2.TrainerStatus(
            trainer_id=self.trainer_id,
            job_id=self.job_id,
            state=self.state,
            policy_version=self.policy_version,
            step=self.step,
            consumed_trajectories=self.consumed_trajectories,
            last_metrics=self.last_metrics,
        )
        if self.last_checkpoint is not None:
            status.last_checkpoint.CopyFrom(self.last_checkpoint)
        return status


@dataclass(slots=True)
class DropCounts:
    """What one step skipped, reported in its Metric. (Dropped groups are reported at once.)"""

    filtered: dict[str, int] = field(default_factory=dict)
    """Groups each group filter dropped, by its ``type``."""
    stale_groups: int = 0
    duplicates: int = 0


@dataclass(slots=True)
class StepTimes:
    """Where one step's time went, and what it wrote."""

    optimise_s: float
    publish_s: float
    """Writing the weights-only directory and publishing its handle."""
    checkpoint_s: float
    """The durable checkpoint and its acks (0 on steps without one)."""
    bytes_written: int
    wait_s: float = 0.0
    """Waiting for the step's groups (from the end of the previous step)."""
    write_s: float = 0.0
    """Writing and announcing the weights, beside the next step (``publish_s`` is what the step
    itself waits: the snapshot, and the previous step's publication if still out)."""


def tool_use_rate(groups: Iterable[Group]) -> float:
    """Share of the groups' trajectories whose episode ran at least one tool call (the runner
    counts them in ``metadata["tool_calls"]``)."""
    counts = [t.metadata.get("tool_calls", "0") for g in groups for t in g.trajectories.values()]
    return sum(1 for c in counts if c.isdigit() and int(c) > 0) / len(counts) if counts else 0.0


def step_metric_values(
    stats: StepStats, prepared: Prepared, times: StepTimes, drops: DropCounts
) -> dict[str, float]:
    """The values of one step's trainer Metric (the step's groups are ``prepared``)."""
    step_s = times.optimise_s + times.publish_s + times.checkpoint_s
    return {
        **stats.metrics(),
        **prepared.metrics(),
        "reward_mean": statistics.fmean(prepared.rewards),
        "reward_std": statistics.pstdev(prepared.rewards),
        "verifier_reward_mean": statistics.fmean(prepared.verifier_rewards),
        "response_tokens": float(sum(len(s.response_token_ids) for s in prepared.samples)),
        "groups_filtered": float(sum(drops.filtered.values())),
        **{f"groups_filtered/{label}": float(count) for label, count in drops.filtered.items()},
        "stale_groups_dropped": float(drops.stale_groups),
        "duplicates_skipped": float(drops.duplicates),
        "step_seconds": step_s,
        "wait_seconds": times.wait_s,
        "optimise_seconds": times.optimise_s,
        "publish_seconds": times.publish_s,
        "publish_write_seconds": times.write_s,
        "checkpoint_seconds": times.checkpoint_s,
        "saving_share": (times.publish_s + times.checkpoint_s) / step_s if step_s > 0 else 0.0,
        "bytes_written": float(times.bytes_written),
        "tokens_per_s": stats.tokens / times.optimise_s if times.optimise_s > 0 else 0.0,
    }


STAGES: dict[str, tuple[str, str]] = {
    "stage_queue_s": ("issued", "picked"),
    "stage_generate_s": ("picked", "generated"),
    "stage_score_s": ("generated", "scored"),
    "stage_publish_s": ("scored", "published"),
}
"""Per-stage metric -> the StageTimes fields it spans: the prompt waiting on its stream for a
runner, the router and engine (resumes included), the reward service, building and
publishing the trajectories."""


def stage_metric_values(groups: Iterable[Group], trained_at: float) -> dict[str, float]:
    """Mean seconds over the step's groups of each stage of the loop (``STAGES``), plus
    ``stage_deliver_s``: from the runner's publish to this step's start (``trained_at``, Unix
    seconds), which includes waiting for the step's other groups. The stamps come from several
    processes' clocks: across hosts they are only as good as the hosts' clock sync."""
    stamps = [next(iter(group.trajectories.values())).stages for group in groups if group.trajectories]
    stamps = [
        s
        for s in stamps
        if all(getattr(s, name) > 0 for name in common_pb2.StageTimes.DESCRIPTOR.fields_by_name)
    ]
    if not stamps:
        return {}
    values = {
        metric: statistics.fmean(getattr(s, end) - getattr(s, start) for s in stamps)
        for metric, (start, end) in STAGES.items()
    }
    values["stage_deliver_s"] = statistics.fmean(trained_at - s.published for s in stamps)
    return values
