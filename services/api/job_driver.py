"""The flow of one job, as the controller drives it (design steps 4 and 7).

1. Wait for checkpoint v0 on the job's checkpoints stream; mark the job RUNNING.
2. Evaluate version 0 once an engine serves it (``eval.at_start``).
3. Issue prompt batches: batch k only while k <= v + max_staleness, where v is
   the latest version that the trainer published and every engine of the job
   serves, so rollouts never run more than max_staleness versions ahead; and
   replace every group the trainer reports dropped (stale or invalid) with a
   new prompt, so that it is never left short of groups.
4. On every new version update the job record; evaluate every
   ``eval.every_steps`` versions.
5. On the trainer's SUCCEEDED status evaluate the final version, then mark the
   job SUCCEEDED; on its FAILED (CANCELLED) status, a prompt task dead-lettered
   as invalid, or when no version arrives
   within the stall timeout (or no v0 within the queue timeout), mark it FAILED
   (CANCELLED) with the reason.

Metrics of every source are merged into the job record as they arrive. Each
stream is followed by its own task; every loop checks a stop flag, because a
cancellation can be lost inside redis-py on Python 3.11 (asyncio.wait_for).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

import grpc

from services.api.evaluation import EvalError, Evaluator
from services.api.job_feed import PromptFeed
from services.common.bus import encode
from services.common.consumer import StreamConsumer
from services.common.jobs import CANCELLED, FAILED, RUNNING, SUCCEEDED, JobRecord, load_job_tokenizer
from services.common.pb import common_pb2, router_pb2
from services.common.streams import CONTROLLER_GROUP, JobStreams
from services.tasks import DataError, PromptExample, eval_prompts

if TYPE_CHECKING:
    from services.api.controller import Controller

log = logging.getLogger(__name__)

GROUP = CONTROLLER_GROUP
DRAIN_TIMEOUT_S = 5.0
"""How long a finishing driver keeps reading metrics that are already published."""
Outcome = tuple[str, str] | None
"""(final state, reason), or None when the driver was stopped from outside."""
ENGINE_POLL_S = 0.2
"""How often the router is asked which versions the engines serve while pacing waits on them."""
DROP_METRICS = ("stale_dropped", "invalid_dropped", "zero_variance_dropped")
"""Trainer metric values (groups it just dropped without training a step) that the controller replaces."""


def _drops(values: dict[str, float]) -> int:
    return int(sum(values.get(name, 0.0) for name in DROP_METRICS))


class JobDriver:
    """Drives one job from its first checkpoint to a terminal state."""

    def __init__(self, controller: Controller, record: JobRecord) -> None:
        loop = asyncio.get_running_loop()
        self.ctl = controller
        self.settings = controller.settings
        self.store = controller.store
        self.bus = controller.bus
        self.job_id = record.job_id
        self.spec = record.spec
        self.record = record
        self.streams = JobStreams(record.job_id)
        self.latest_version = record.policy_version
        self.resumed = record.state == RUNNING
        self.tokenizer: Any = None
        self.eval_examples: list[PromptExample] = []
        self._first_handle: asyncio.Future[common_pb2.CheckpointHandle] = loop.create_future()
        self._outcome: asyncio.Future[Outcome] = loop.create_future()
        self._stopping = asyncio.Event()
        self._wake = asyncio.Event()
        """Set when the issuer may have more to do: a new version, or dropped groups."""
        self._dropped = 0
        """Groups the trainer reported dropped, over the whole job."""
        self._issuing = False
        self._finishing = False
        self._draining = False
        self._last_progress = time.monotonic()
        self._evaluated: set[int] = set()
        self._batches = 0
        self._extra = 0
        self._served: int | None = None
        self._eval_queue: asyncio.Queue[int] = asyncio.Queue()
        self._evaluator_tasks: list[asyncio.Task[None]] = []

    def stop(self) -> None:
        """Wind down without touching the job's state (it was cancelled, or the api stops)."""
        self._conclude(None)

    def _conclude(self, outcome: Outcome) -> None:
        if not self._outcome.done():
            self._outcome.set_result(outcome)

    def _fail(self, reason: str) -> None:
        self._conclude((FAILED, reason))

    async def run(self) -> None:
        if self.resumed:
            handle = await self.bus.latest(self.streams.checkpoints, common_pb2.CheckpointHandle)
            if handle is not None:
                self._first_handle.set_result(handle)
            # The drops that the last controller saw (and replaced) are in the metrics history.
            rows = await self.store.history(self.job_id, source="trainer")
            self._dropped = sum(_drops(row.values) for row in rows)
        log.info("driving %s (%s)", self.job_id, "resumed" if self.resumed else "new")
        metrics_task = asyncio.create_task(self._follow_metrics())
        tasks = [
            asyncio.create_task(self._follow_checkpoints()),
            asyncio.create_task(self._follow_status()),
            asyncio.create_task(self._follow_dead_letters()),
            asyncio.create_task(self._watchdog()),
            asyncio.create_task(self._feed()),
        ]
        try:
            outcome = await self._await_outcome([metrics_task, *tasks])
        finally:
            await self._wind_down(metrics_task, tasks)
        if outcome is None:
            log.info("%s: stopped driving", self.job_id)
            return
        state, reason = outcome
        applied = await self.store.set_state(self.job_id, state, reason)
        log.info("%s: %s %s%s", self.job_id, state, reason, "" if applied else " (it had already finished)")

    async def _await_outcome(self, tasks: list[asyncio.Task[None]]) -> Outcome:
        """The job's outcome; re-raises the error of a helper task that crashed first."""
        waiting: set[asyncio.Future[Any]] = {self._outcome, *tasks}
        while not self._outcome.done():
            done, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not self._outcome and not task.cancelled() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
        return self._outcome.result()

    async def _wind_down(self, metrics_task: asyncio.Task[None], tasks: list[asyncio.Task[None]]) -> None:
        """Stop the helpers; let the metrics follower record what is already published."""
        self._stopping.set()
        self._draining = True
        for task in [*tasks, *self._evaluator_tasks]:
            task.cancel()
        _, late = await asyncio.wait([metrics_task, *tasks, *self._evaluator_tasks], timeout=DRAIN_TIMEOUT_S)
        if late:
            log.warning(
                "%s: %d helper tasks still running after %.0fs", self.job_id, len(late), DRAIN_TIMEOUT_S
            )

    def _consumer(self, stream: str, message_type: type[Any], block_ms: int) -> StreamConsumer[Any]:
        return StreamConsumer(
            self.bus,
            stream,
            GROUP,
            self.ctl.consumer,
            message_type,
            block_ms=block_ms,
            reclaim_idle_ms=self.settings.reclaim_idle_ms,
        )

    # -- followers of the job's streams ----------------------------------------------------------

    async def _follow_checkpoints(self) -> None:
        consumer = self._consumer(self.streams.checkpoints, common_pb2.CheckpointHandle, 500)
        while not self._stopping.is_set():
            deliveries = await consumer.poll()
            for delivery in deliveries:
                await self._on_checkpoint(delivery.message)
            await consumer.ack(deliveries)

    async def _on_checkpoint(self, handle: common_pb2.CheckpointHandle) -> None:
        if not self._first_handle.done():
            self._first_handle.set_result(handle)
        if handle.version > self.latest_version:
            self.latest_version = handle.version
            self._last_progress = time.monotonic()
            self._wake.set()
            every = self.spec.eval.every_steps
            if every and handle.version % every == 0 and handle.version < self.spec.trainer.steps:
                self._eval_queue.put_nowait(handle.version)
        await self.store.update_progress(self.job_id, handle.version, handle.step)

    async def _follow_metrics(self) -> None:
        consumer = self._consumer(self.streams.metrics, common_pb2.Metric, 200)
        while True:
            deliveries = await consumer.poll()
            for delivery in deliveries:
                metric = delivery.message
                if metric.source == "trainer" and _drops(dict(metric.values)):
                    self._dropped += _drops(dict(metric.values))
                    self._wake.set()
                await self.store.merge_metrics(
                    self.job_id,
                    dict(metric.values),
                    step=metric.step,
                    source=metric.source or "unknown",
                    policy_version=metric.policy_version,
                )
            await consumer.ack(deliveries)
            if self._draining and not deliveries:
                return

    async def _follow_status(self) -> None:
        consumer = self._consumer(self.streams.status, common_pb2.JobStatus, 500)
        while not self._stopping.is_set():
            deliveries = await consumer.poll()
            for delivery in deliveries:
                status = delivery.message
                if status.state == common_pb2.JOB_STATE_FAILED:
                    self._fail(f"trainer failed: {status.reason or 'no reason given'}")
                elif status.state == common_pb2.JOB_STATE_CANCELLED:
                    self._conclude(
                        (CANCELLED, f"trainer stopped the job: {status.reason or 'no reason given'}")
                    )
                elif status.state == common_pb2.JOB_STATE_SUCCEEDED:
                    await self._succeed(status)
                else:
                    state = common_pb2.JobState.Name(status.state)
                    log.warning("%s: ignoring trainer status %s", self.job_id, state)
            await consumer.ack(deliveries)

    async def _follow_dead_letters(self) -> None:
        """A prompt task the rollout side rejected (say, prompt + max_new_tokens beyond the
        model's positions) will be rejected again: fail the job now with that reason rather
        than stall. Other dead letters (a malformed trajectory) are logged; the trainer
        reports those groups dropped and they are replaced."""
        consumer = self._consumer(self.streams.dead, common_pb2.DeadLetter, 500)
        while not self._stopping.is_set():
            deliveries = await consumer.poll()
            for delivery in deliveries:
                letter = delivery.message
                if letter.source_stream == self.streams.prompts:
                    self._fail(f"a prompt task was rejected: {letter.reason}")
                else:
                    log.warning(
                        "%s: dead letter from %s: %s", self.job_id, letter.source_stream, letter.reason
                    )
            await consumer.ack(deliveries)

    async def _succeed(self, status: common_pb2.JobStatus) -> None:
        """Evaluate the final version once the engines serve it, then finish as SUCCEEDED."""
        self._finishing = True
        for task in self._evaluator_tasks:
            task.cancel()
        final = max(status.policy_version, self.latest_version)
        reason = ""
        if self.eval_examples and final not in self._evaluated:
            error = await self._evaluate(final)
            if error:
                reason = f"training finished at version {final}; the final evaluation failed: {error}"
        self._conclude((SUCCEEDED, reason))

    async def _watchdog(self) -> None:
        """Fail a job that waits too long for v0, or whose trainer stops making versions."""
        while not self._stopping.is_set():
            await asyncio.sleep(self.settings.poll_interval_s)
            if not self._first_handle.done():
                waited = time.time() - self.record.submitted_at
                if waited > self.settings.queue_timeout_s:
                    self._fail(f"no checkpoint v0 within {waited:.0f}s (queue_timeout_s): is a trainer up?")
            elif self._issuing and not self._finishing:
                idle = time.monotonic() - self._last_progress
                if idle > self.settings.stall_timeout_s:
                    served = (
                        "no engine serves the job"
                        if self._served is None
                        else f"engines serve v{self._served}"
                    )
                    self._fail(
                        f"stalled: no new policy version for {idle:.0f}s after version {self.latest_version}"
                        f" ({served}; {self._batches} batches issued)"
                    )

    # -- rollouts and evaluation -----------------------------------------------------------------

    async def _feed(self) -> None:
        """Mark the job RUNNING on v0, evaluate v0, then issue paced prompt batches."""
        handle = await self._first_handle
        record = await self.store.get(self.job_id)
        consumed = record.issued_batches * self.spec.rollout.prompts_per_step + record.issued_extra
        try:
            self.tokenizer = await asyncio.to_thread(load_job_tokenizer, self.spec, handle)
            self.eval_examples = await asyncio.to_thread(
                eval_prompts, self.spec.data, self.spec.eval.num_prompts
            )
            feed = PromptFeed(self.spec, self.job_id, self.tokenizer, consumed=consumed)
        except (OSError, ValueError) as err:  # DataError is a ValueError; so are tokenizer load errors
            kind = "data" if isinstance(err, DataError) else f"tokenizer of checkpoint v{handle.version}"
            self._fail(f"cannot prepare the job's prompts: {kind}: {err}")
            return
        if not self.resumed:
            await self.store.set_state(self.job_id, RUNNING)
            await self.store.update_progress(self.job_id, handle.version, handle.step)
            if self.spec.eval.at_start and self.eval_examples:
                await self._evaluate(handle.version)
        self._evaluator_tasks.append(asyncio.create_task(self._run_evals()))
        self._last_progress = time.monotonic()
        self._issuing = True
        await self._issue(feed, record)

    async def _issue(self, feed: PromptFeed, record: JobRecord) -> None:
        """Publish paced batches (up to trainer.steps of them) and replacements for dropped groups."""
        self._batches, self._extra = record.issued_batches, record.issued_extra
        staleness = self.spec.algorithm.max_staleness
        while not self._stopping.is_set():
            self._wake.clear()
            if self._dropped > self._extra:
                await self._publish(feed.extra(self._extra, self._dropped - self._extra), extra=True)
            waiting_for_engines = False
            if self._batches < self.spec.trainer.steps and self._batches <= self.latest_version + staleness:
                served = await self._served_version()
                bound = min(self.latest_version, served if served is not None else -staleness - 1)
                while self._batches < self.spec.trainer.steps and self._batches <= bound + staleness:
                    await self._publish(feed.batch(self._batches), extra=False)
                waiting_for_engines = self._batches <= self.latest_version + staleness
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), ENGINE_POLL_S if waiting_for_engines else None)

    async def _served_version(self) -> int | None:
        """The oldest version that an engine of this job serves; None when none serves it (yet)."""
        try:
            reply = await self.ctl.router().ListEngines(router_pb2.ListEnginesRequest(), timeout=5.0)
        except grpc.aio.AioRpcError as err:
            log.warning("%s: router ListEngines failed: %s: %s", self.job_id, err.code().name, err.details())
            return None
        versions = [engine.policy_version for engine in reply.engines if engine.job_id == self.job_id]
        self._served = min(versions) if versions else None
        return self._served

    async def _publish(self, tasks: list[common_pb2.PromptTask], *, extra: bool) -> None:
        """Prompts and the new issued counts, in one MULTI."""
        batches, extras = (
            (self._batches, self._extra + len(tasks)) if extra else (self._batches + 1, self._extra)
        )
        pipe = self.bus.redis.pipeline(transaction=True)
        for task in tasks:
            task.policy_version = self.latest_version
            pipe.xadd(self.streams.prompts, encode(task), maxlen=self.bus.maxlen)
        self.store.queue_issued(pipe, self.job_id, batches=batches, extra=extras)
        await pipe.execute()
        what = (
            f"{len(tasks)} replacement prompts" if extra else f"batch {self._batches} ({len(tasks)} prompts)"
        )
        self._batches, self._extra = batches, extras
        self.ctl.metrics.prompts_issued.inc(len(tasks))
        log.info("%s: issued %s at version %d", self.job_id, what, self.latest_version)

    async def _run_evals(self) -> None:
        while not self._stopping.is_set():
            version = await self._eval_queue.get()
            if version not in self._evaluated:
                await self._evaluate(version)

    async def _evaluate(self, version: int) -> str:
        """Evaluate the policy once an engine serves ``version``; returns an error text or ""."""
        evaluator = Evaluator(
            self.ctl.router(),
            self.ctl.reward(self.spec),
            self.spec,
            self.job_id,
            concurrency=self.settings.eval_concurrency,
        )
        try:
            served = await evaluator.wait_for_version(version, self.settings.eval_engine_timeout_s)
            if served in self._evaluated:
                return ""
            result = await evaluator.evaluate(f"v{version}", self.eval_examples, self.tokenizer)
        except EvalError as err:
            self.ctl.metrics.evaluations.labels(outcome="failed").inc()
            log.warning("%s: evaluation of version %d failed: %s", self.job_id, version, err)
            return str(err)
        self._evaluated.add(result.version)
        self.ctl.metrics.evaluations.labels(outcome="ok").inc()
        await self.bus.publish_metric(
            self.job_id, "eval", result.metric_values(), step=result.version, policy_version=result.version
        )
        log.info("%s: eval of version %d: accuracy %.3f", self.job_id, result.version, result.accuracy)
        return ""
