"""Prometheus metrics of the trainer: steps, where each step's time went, the policy version, and
(with a ``BusLagCollector``) the lag of the trajectories stream of the job it trains.

The stage seconds are those each step already reports in its Metric (report.py's
``step_metric_values``); they are observed here when the step's report goes out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.common.bus_lag import BusLagCollector

STEP_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
STEP_STAGES = {
    "wait": "wait_seconds",
    "optimise": "optimise_seconds",
    "publish": "publish_seconds",
    "write": "publish_write_seconds",
    "checkpoint": "checkpoint_seconds",
}
"""Stage label -> the step metric (report.py) that holds its seconds."""


class TrainerMetrics:
    """The trainer's series, in a registry of its own (tests run several trainers in one process)."""

    def __init__(self, bus_lag: BusLagCollector | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.bus_lag = bus_lag
        if bus_lag is not None:
            self.registry.register(bus_lag)
        self.steps = Counter("verst_trainer_steps", "Optimisation steps reported.", registry=self.registry)
        self.trajectories = Counter(
            "verst_trainer_trajectories", "Trajectories trained on, over all steps.", registry=self.registry
        )
        self.stage_seconds = Histogram(
            "verst_trainer_step_stage_seconds",
            "Seconds of each stage of a step: wait (for its groups), optimise, publish (what the step "
            "waits of the weights' publication), write (writing them, beside the next step), checkpoint "
            "(durable ones only).",
            ["stage"],
            buckets=STEP_BUCKETS,
            registry=self.registry,
        )
        self.policy_version = Gauge(
            "verst_trainer_policy_version",
            "Policy version of the job being trained (0 when idle).",
            registry=self.registry,
        )

    def follow_version(self, version: Callable[[], int]) -> None:
        """Read the policy version from ``version`` at each scrape (a plain attribute read)."""
        self.policy_version.set_function(version)

    def watch(self, stream: str, group: str) -> None:
        if self.bus_lag is not None:
            self.bus_lag.watch(stream, group)

    def unwatch(self, stream: str, group: str) -> None:
        if self.bus_lag is not None:
            self.bus_lag.unwatch(stream, group)

    def stepped(self, values: Mapping[str, float], trajectories: int) -> None:
        """One step's report went out, with these metric ``values``."""
        self.steps.inc()
        self.trajectories.inc(trajectories)
        for stage, key in STEP_STAGES.items():
            seconds = values.get(key)
            if seconds is None or (stage == "checkpoint" and seconds <= 0):
                continue  # a step without a durable checkpoint took none
            self.stage_seconds.labels(stage).observe(max(0.0, seconds))

    def close(self) -> None:
        if self.bus_lag is not None:
            self.bus_lag.close()
