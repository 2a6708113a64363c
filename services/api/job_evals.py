"""The evaluations of one job, as its driver schedules them: each version once, the results on
the job's metrics stream (source ``eval``), every outcome counted.

One evaluation is ``evaluation.Evaluator``'s: it waits for an engine to serve the version, and
makes a call again when its engine, the router or the reward service failed (retries counted in
``verst_controller_evaluation_retries``). An evaluation that fails all the same is lost, never
silently: an ERROR line and ``verst_controller_evaluations{outcome="failed"}``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

from services.api.config import ApiSettings
from services.api.evaluation import EvalError, Evaluator
from services.api.stubs import ServiceStubs
from services.api.telemetry import ApiMetrics
from services.common.bus import Bus
from services.common.config import JobSpec
from services.common.jobs import JobStore
from services.tasks import PromptExample

log = logging.getLogger(__name__)

DUE_VERSION = "due_version"
"""The value of an evaluation's metric row that names the version whose due it was made for."""


def dues_without_result(
    evaluated: Iterable[tuple[int, float | None]], dues: Iterable[int], every: int
) -> list[int]:
    """The ``dues`` no evaluation covers. ``evaluated``: (version evaluated, the due it was made
    for, or None in rows written before dues were recorded). An evaluation made for due ``u`` of
    version ``v`` (v >= u: engines may have moved on) covers every due from ``u`` to ``v``, so one
    evaluation may serve two dues; a row without its due covers the due of its own interval."""
    spans = [
        (int(due), version) if due is not None else (version - version % every, version)
        for version, due in evaluated
    ]
    return [d for d in dues if not any(low <= d <= high for low, high in spans)]


class JobEvals:
    """Evaluates versions of one job on demand (``evaluate``) or as they come due (``due``, ``run``)."""

    def __init__(
        self,
        bus: Bus,
        stubs: ServiceStubs,
        settings: ApiSettings,
        metrics: ApiMetrics,
        job_id: str,
        spec: JobSpec,
    ) -> None:
        self.bus, self.stubs, self.settings, self.metrics = bus, stubs, settings, metrics
        self.job_id = job_id
        self.spec = spec
        self.examples: list[PromptExample] = []
        """The held-out prompts (none: no evaluation runs)."""
        self.tokenizer: Any = None
        self.done: set[int] = set()
        """Versions evaluated (labelled by the oldest version among the answers' tokens)."""
        self._due: asyncio.Queue[int] = asyncio.Queue()
        self._running: asyncio.Future[str] | None = None
        """The periodic evaluation in flight, if any."""
        self._closing = False

    def due(self, version: int) -> None:
        """``version`` is due for its periodic evaluation (``run`` makes it)."""
        self._due.put_nowait(version)

    async def catch_up(self, store: JobStore, latest: int) -> None:
        """For a driver taking over a running job: mark what its predecessors evaluated done, and
        make due again each periodic evaluation up to version ``latest`` that has no result in
        its interval (the api died before it ran, or while it ran)."""
        every = self.spec.eval.every_steps
        if not every or not self.examples:
            return
        rows = await store.history(self.job_id, source="eval")
        self.done |= {row.step for row in rows}
        dues = range(every, min(latest, self.spec.trainer.steps - 1) + 1, every)
        for version in dues_without_result([(r.step, r.values.get(DUE_VERSION)) for r in rows], dues, every):
            log.info(
                "%s: the evaluation due at version %d left no result; making it now", self.job_id, version
            )
            self.due(version)

    async def run(self, stopping: asyncio.Event) -> None:
        """Evaluate the versions that come due, one at a time, until ``stopping`` or ``close``."""
        while not (stopping.is_set() or self._closing):
            version = await self._due.get()
            if version in self.done:
                self._covered(version, version)
            elif not self._closing:
                self._running = asyncio.ensure_future(self.evaluate(version))
                try:
                    await self._running
                finally:
                    self._running = None

    async def close(self) -> None:
        """Training ended: let the periodic evaluation in flight finish (its calls have deadlines),
        start none; a version still due cannot be evaluated any more (the engines serve the final
        one), which is said, not dropped silently."""
        self._closing = True
        if self._running is not None:
            await asyncio.wait([self._running])
        while not self._due.empty():
            version = self._due.get_nowait()
            if not any(version <= done for done in self.done):
                self.metrics.evaluations.labels(outcome="missed").inc()
                log.warning(
                    "%s: the evaluation due at version %d did not run before training ended",
                    self.job_id, version,
                )  # fmt: skip

    def _covered(self, due: int, version: int) -> None:
        """The evaluation due at ``due`` is that of ``version``, made already (for an earlier due,
        when the engines had moved on by the time it ran), which covers it too."""
        self.metrics.evaluations.labels(outcome="covered").inc()
        log.info(
            "%s: the evaluation due at version %d is version %d's, made already", self.job_id, due, version
        )

    async def evaluate(self, version: int) -> str:
        """Evaluate the policy once an engine serves ``version``; returns an error text or ""."""
        settings = self.settings
        evaluator = Evaluator(
            self.stubs.router(),
            self.stubs.reward(self.spec),
            self.spec,
            self.job_id,
            concurrency=settings.eval_concurrency,
            attempts=settings.eval_attempts,
            engine_timeout_s=settings.eval_engine_timeout_s,
        )
        try:
            served = await evaluator.wait_for_version(version, settings.eval_engine_timeout_s)
            if served in self.done:
                self._covered(version, served)
                return ""
            result = await evaluator.evaluate(version, self.examples, self.tokenizer)
        except EvalError as err:
            self.metrics.evaluations.labels(outcome="failed").inc()
            log.error("%s: evaluation of version %d lost: %s", self.job_id, version, err)
            return str(err)
        finally:
            self.metrics.evaluation_retries.inc(evaluator.retries)
        self.done.add(result.version)
        self.metrics.evaluations.labels(outcome="ok").inc()
        values = result.metric_values() | {DUE_VERSION: float(version)}
        await self.bus.publish_metric(
            self.job_id, "eval", values, step=result.version, policy_version=result.version
        )
        log.info("%s: eval of version %d: accuracy %.3f", self.job_id, result.version, result.accuracy)
        return ""
