"""Prometheus metrics of the rollout runner: groups through each stage, the stages' seconds,
the groups in flight, and (with a ``BusLagCollector``) the lag of the prompts streams it reads."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.common.bus_lag import BusLagCollector
from services.common.metrics_http import LATENCY_BUCKETS
from services.common.pb import common_pb2

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class RunnerMetrics:
    """The runner's series, in a registry of its own (tests run several runners in one process)."""

    def __init__(self, bus_lag: BusLagCollector | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.bus_lag = bus_lag
        if bus_lag is not None:
            self.registry.register(bus_lag)
        self.groups = Counter(
            "verst_runner_groups",
            "Groups through each stage: generated (samples back from the router), scored, published.",
            ["stage"],
            registry=self.registry,
        )
        self.groups_failed = Counter(
            "verst_runner_groups_failed",
            "Tasks that ended without a publish: invalid (dead-lettered), retry (a service failed) or error.",
            ["reason"],
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "verst_runner_groups_in_flight", "Tasks (groups) being rolled out now.", registry=self.registry
        )
        self.stage_seconds = Histogram(
            "verst_runner_stage_seconds",
            "Seconds of one group in each stage: generate (router, resumes included), score, publish.",
            ["stage"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )

        self.batch_groups = Histogram(
            "verst_runner_batch_groups",
            "Groups in one batch: a read of the prompts stream, a router GenerateBatch, a reward "
            "ScoreBatch, a publish of trajectories.",
            ["call"],
            buckets=BATCH_BUCKETS,
            registry=self.registry,
        )
        # the children of a group's series, looked up once (``labels`` takes a lock each call)
        self._counted = {stage: self.groups.labels(stage) for stage in ("generated", "scored", "published")}
        self._timed = {stage: self.stage_seconds.labels(stage) for stage in ("generate", "score", "publish")}

    def batch_observer(self, call: str) -> Callable[[int], None]:
        """What a batching client tells the size of each of its batches (``call`` names it)."""
        return self.batch_groups.labels(call).observe

    def watch(self, stream: str, group: str) -> None:
        if self.bus_lag is not None:
            self.bus_lag.watch(stream, group)

    def unwatch(self, stream: str, group: str) -> None:
        if self.bus_lag is not None:
            self.bus_lag.unwatch(stream, group)

    def rolled_out(self, trajectories: list[common_pb2.Trajectory], picked: float) -> None:
        """A group came back scored: its generate and score stages, from its StageTimes."""
        if not trajectories:
            return
        stages = trajectories[0].stages
        if stages.generated > 0:
            self._counted["generated"].inc()
            self._timed["generate"].observe(max(0.0, stages.generated - picked))
        if stages.scored > 0:
            self._counted["scored"].inc()
            self._timed["score"].observe(max(0.0, stages.scored - stages.generated))

    def published(self, seconds: float) -> None:
        self._counted["published"].inc()
        self._timed["publish"].observe(seconds)

    def close(self) -> None:
        if self.bus_lag is not None:
            self.bus_lag.close()
