"""Prometheus metrics of the reward service: items scored, failures and seconds, per verifier."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

SCORE_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""From a quick verifier (microseconds) to a sandboxed program's tests (seconds)."""
UNKNOWN = "unknown"
"""The verifier label of a request naming no registered verifier (any name would grow the series)."""


class RewardMetrics:
    """The reward service's series, in a registry of its own (tests run several in one process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.items = Counter(
            "verst_reward_items",
            "Items scored (a response each, with or without an error), by verifier or plugin.",
            ["verifier"],
            registry=self.registry,
        )
        self.errors = Counter(
            "verst_reward_errors",
            "Items that got no score, by verifier and why: timeout, or error (raised, malformed, unknown).",
            ["verifier", "kind"],
            registry=self.registry,
        )
        self.score_seconds = Histogram(
            "verst_reward_score_seconds",
            "Seconds one item took its verifier or plugin (a timed-out one: until its deadline).",
            ["verifier"],
            buckets=SCORE_BUCKETS,
            registry=self.registry,
        )
        self._series: dict[str, tuple[Any, Any]] = {}
        """Each verifier's item counter and seconds histogram (one entry per series the metrics
        hold anyway), looked up once: ``labels`` was a sixth of the service's time on a quick
        verifier (bench/control_plane.py --profile reward)."""

    def scored(self, verifier: str, seconds: float, error: BaseException | None) -> None:
        """One item's outcome: ``error`` is why it got no score (None: it got one)."""
        series = self._series.get(verifier)
        if series is None:
            series = self._series[verifier] = (
                self.items.labels(verifier),
                self.score_seconds.labels(verifier),
            )
        items, score_seconds = series
        items.inc()
        score_seconds.observe(max(0.0, seconds))
        if error is not None:
            kind = "timeout" if isinstance(error, TimeoutError) else "error"
            self.errors.labels(verifier, kind).inc()
