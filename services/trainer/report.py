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

    zero_variance: int = 0
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
        "response_tokens": float(sum(len(s.response_token_ids) for s in prepared.samples)),
        "zero_variance_filtered": float(drops.zero_variance),
        "stale_groups_dropped": float(drops.stale_groups),
        "duplicates_skipped": float(drops.duplicates),
        "step_seconds": step_s,
        "publish_seconds": times.publish_s,
        "checkpoint_seconds": times.checkpoint_s,
        "saving_share": (times.publish_s + times.checkpoint_s) / step_s if step_s > 0 else 0.0,
        "bytes_written": float(times.bytes_written),
        "tokens_per_s": stats.tokens / times.optimise_s if times.optimise_s > 0 else 0.0,
    }
