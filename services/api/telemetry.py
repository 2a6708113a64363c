"""Prometheus metrics of the api: jobs by state, and the latest metrics of running jobs.

The controller's own metrics are services/controller/telemetry.py's.

Job gauges are refreshed from the job store on a scrape, so they are right
whichever api process drove the job, at most every ``refresh_every_s`` (the
scrapes in between, and those that arrive during a refresh, get that reading):
a crowd of scrapers costs the store no more than one. The counters count this
process's work.
"""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry, Gauge, generate_latest

from services.common.jobs import RUNNING, JobStore

EVAL_ACCURACY = "eval/accuracy"
"""The metrics_json key of the latest eval accuracy."""


class ApiMetrics:
    """The api's metrics, in a registry of its own (one per app, so tests can make many)."""

    def __init__(self, refresh_every_s: float = 0.0) -> None:
        self.refresh_every_s = refresh_every_s
        self._refreshed_at = -float("inf")
        self._refreshing = asyncio.Lock()
        self.registry = CollectorRegistry(auto_describe=True)
        self.jobs = Gauge("verst_jobs", "Jobs by state.", ["state"], registry=self.registry)
        self.policy_version = Gauge(
            "verst_job_policy_version",
            "Newest policy version of a running job.",
            ["job_id"],
            registry=self.registry,
        )
        self.eval_accuracy = Gauge(
            "verst_job_eval_accuracy",
            "Latest held-out accuracy of a running job.",
            ["job_id"],
            registry=self.registry,
        )
        self.job_metric = Gauge(
            "verst_job_metric",
            "Latest value of every metric of a running job (name is source/metric).",
            ["job_id", "name"],
            registry=self.registry,
        )

    async def refresh(self, store: JobStore) -> None:
        """Reset the job gauges from the store, unless they were within ``refresh_every_s``."""
        async with self._refreshing:
            if time.monotonic() - self._refreshed_at >= self.refresh_every_s:
                await self._read(store)
                self._refreshed_at = time.monotonic()

    async def _read(self, store: JobStore) -> None:
        for state, count in (await store.count_by_state()).items():
            self.jobs.labels(state=state).set(count)
        for gauge in (self.policy_version, self.eval_accuracy, self.job_metric):
            gauge.clear()
        for record in await store.briefs(await store.running_job_ids()):
            if record.state != RUNNING:
                continue
            self.policy_version.labels(job_id=record.job_id).set(record.policy_version)
            if EVAL_ACCURACY in record.metrics:
                self.eval_accuracy.labels(job_id=record.job_id).set(record.metrics[EVAL_ACCURACY])
            for name, value in record.metrics.items():
                self.job_metric.labels(job_id=record.job_id, name=name).set(value)

    def render(self, *others: CollectorRegistry) -> bytes:
        """The exposition of this registry and ``others`` (the controller's, when it runs here)."""
        return b"".join(generate_latest(registry) for registry in (self.registry, *others))
