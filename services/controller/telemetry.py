"""Prometheus metrics of the job controller: what this process issued, drove and evaluated.

A registry of its own: the api renders it beside its own on /metrics when the controller runs in
its process, and `python -m services.controller` serves it on its metrics port.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class ControllerMetrics:
    """The controller's counters and gauges (one registry per instance, so tests can make many)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.prompts_issued = Counter(
            "verst_controller_prompts_issued",
            "PromptTasks published by this controller.",
            registry=self.registry,
        )
        self.drivers = Gauge(
            "verst_controller_drivers",
            "Job drivers this controller runs (queued jobs whose trainer has not spoken have none).",
            registry=self.registry,
        )
        self.evaluations = Counter(
            "verst_controller_evaluations",
            "Evaluations by outcome (ok; covered: due, of a version already evaluated; failed: lost after"
            " every attempt; missed: due when training ended).",
            ["outcome"],
            registry=self.registry,
        )
        self.evaluation_retries = Counter(
            "verst_controller_evaluation_retries",
            "Evaluation calls (Generate, ScoreBatch) made again after their engine, router or "
            "reward service failed.",
            registry=self.registry,
        )
