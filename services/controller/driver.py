"""The RL loop of one job, as the controller drives it: read this file top-down.

One trajectory's life, stage by stage (the services it crosses do the work in between)::

    1. feed      this driver issues a paced batch of PromptTasks      -> verst:job:{id}:prompts
    2. generate  a runner takes a task; engines sample its group       (runner -> router -> engines)
    3. score     the reward service scores the group                   (runner -> reward)
                 the runner publishes the scored trajectories          -> verst:job:{id}:trajectories
    4. train     the trainer optimises on whole groups                 (trainer)
    5. publish   the trainer publishes the new version's handle        -> verst:job:{id}:checkpoints
                 engines load it; this driver lets out the next batch
    6. evaluate  every eval.every_steps versions, held-out accuracy    (this driver -> router, reward)

The class follows that order: the phases (``run``), then one section per stage with what this
driver does there. Work lost on the way comes back to the feed: a task or trajectory that was
dead-lettered (stages 2-3) and a group the trainer dropped (stage 4) each get one replacement.

``JobDriver.run`` advances the job through its phases, one at a time:

- WAITING_FOR_V0: until the trainer publishes checkpoint v0 on the job's
  checkpoints stream (or no v0 within the queue timeout: FAILED).
- STARTING: read the job's prompts and tokenizer, mark the job RUNNING, and
  evaluate version 0 once an engine serves it (``eval.at_start``).
- RUNNING: feed paced prompt batches and replacements (the rule is pacing.py); on every new
  version update the job record, and evaluate every ``eval.every_steps`` versions; no new
  version within the job's stall bound (stall.py: a floor, a multiple of its slowest recent
  step, a start-up allowance): FAILED.
- FINISHING: the trainer reported SUCCEEDED: evaluate the final version, then
  the job is SUCCEEDED.
- DONE: the job has its outcome.

In any phase the trainer's FAILED (CANCELLED) status, or one failure repeated
in the job's dead letters without a new version between them (dead_letters.py),
ends the job FAILED (CANCELLED) with the reason, and ``stop`` ends the driver
without touching the job's state. A job that ended (here, or elsewhere: a cancel) has its
requests dropped on every engine (the router's AbortJob) as the driver winds down. Every loop
checks a stop flag, because a cancellation can be lost inside redis-py on Python 3.11 (asyncio.wait_for).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from services.common.bus import Bus, Delivery, metric_message
from services.common.consumer import SharedReads, StreamConsumer
from services.common.events import dead_letter_event, warning_event
from services.common.housekeeping import tend_job, tidy_ended_job
from services.common.job_tokenizer import load_job_tokenizer
from services.common.jobs import (
    CANCELLED,
    FAILED,
    RUNNING,
    SUCCEEDED,
    JobRecord,
    JobStore,
    MetricRow,
)
from services.common.outage import RedisOutageError, calm_since, wait_until_up
from services.common.pb import common_pb2
from services.common.streams import CONTROLLER_GROUP, JobStreams
from services.controller.config import ControllerSettings
from services.controller.dead_letters import RepeatedFailures, failure_limit, replaces_work
from services.controller.evaluation import JobEvals, prepare_eval_sets
from services.controller.feed import PromptFeed
from services.controller.pacing import Issue, plan_issue
from services.controller.stall import StallWatch, stall_limits
from services.controller.stubs import ServiceStubs
from services.controller.telemetry import ControllerMetrics
from services.controller.tracking import JobTracking
from services.data import DataError

log = logging.getLogger(__name__)

GROUP = CONTROLLER_GROUP
DRAIN_TIMEOUT_S = 5.0
"""How long a finishing driver keeps reading metrics that are already published."""
Outcome = tuple[str, str] | None
"""(final state, reason), or None when the driver was stopped from outside."""


def metric_row(metric: common_pb2.Metric, merged_at: float) -> MetricRow:
    """A Metric as a row of the job's metrics history."""
    values = {name: float(value) for name, value in metric.values.items()}
    return MetricRow(metric.step, metric.policy_version, metric.source or "unknown", values, merged_at)


def queue_timeout_reason(waited_s: float) -> str:
    """Why a job that waited ``waited_s`` for checkpoint v0 failed."""
    return f"no checkpoint v0 within {waited_s:.0f}s (queue_timeout_s): is a trainer up?"


class Phase(enum.Enum):
    """Where a job driver is; ``JobDriver.run`` moves it forward, never back."""

    WAITING_FOR_V0 = "waiting for v0"
    STARTING = "starting"
    RUNNING = "running"
    FINISHING = "finishing"
    DONE = "done"


@dataclass(frozen=True, slots=True)
class DriverDeps:
    """What a job driver uses of the process that runs it."""

    bus: Bus
    store: JobStore
    stubs: ServiceStubs
    settings: ControllerSettings
    metrics: ControllerMetrics
    consumer: str
    """Consumer name on the job streams (unique per process)."""
    reads: SharedReads | None = None
    """The blocking reads of every job's followers, in one (None: one per follower): a pooled
    connection each would run the pool dry at a few dozen jobs."""


class JobDriver:
    """Drives one job from its first checkpoint to a terminal state."""

    def __init__(self, deps: DriverDeps, record: JobRecord) -> None:
        loop = asyncio.get_running_loop()
        self.deps = deps
        self.settings = deps.settings
        self.store = deps.store
        self.job_id = record.job_id
        self.spec = record.spec
        self.record = record
        self.streams = JobStreams(record.job_id)
        self.phase = Phase.WAITING_FOR_V0
        self.latest_version = record.policy_version
        self.resumed = record.state == RUNNING
        self.tokenizer: Any = None
        self.evals = JobEvals(deps.bus, deps.stubs, deps.settings, deps.metrics, record.job_id, record.spec)
        self.evals.events = deps.store.events
        self.tracking = JobTracking(record.job_id, record.spec, deps.settings.tracking_dir)
        self._first_handle: asyncio.Future[common_pb2.CheckpointHandle] = loop.create_future()
        self._trainer_done: asyncio.Future[common_pb2.JobStatus] = loop.create_future()
        """The trainer's SUCCEEDED status."""
        self._outcome: asyncio.Future[Outcome] = loop.create_future()
        self._stopping = asyncio.Event()
        self._halted = asyncio.Event()  # set by stop: nothing more is written, not the outcome either
        self._ended_elsewhere = False
        self._draining = False
        self._wake = asyncio.Event()
        """Set when the feed may have more to do: a new version, or lost groups."""
        self._dropped = record.dropped_groups
        """Work lost over the whole job (the record's dropped_groups): each gets a replacement."""
        self._failures = RepeatedFailures(failure_limit(self.settings.repeated_failures, self.spec))
        self._batches = record.issued_batches
        self._extra = record.issued_extra
        self._last_progress = time.monotonic()
        self._stall = StallWatch(stall_limits(self.settings))
        """The job's recent pace, and so how long it may go without a new version (stall.py)."""
        self._epoch = (0, 0)
        """(epoch, version) of the newest handle: a trainer's lineage, and how far it came."""
        self._version_at = 0.0
        """Unix seconds when the newest version's handle was published (its created_at)."""
        self._helpers: list[asyncio.Future[None]] = []
        """Followers, the watchdog, the feed and the evaluator: a crash of one ends run."""
        self._issuing: list[asyncio.Future[None]] = []
        """The feed and the periodic evaluator, which run while the job is RUNNING."""
        self._metrics_task: asyncio.Future[None] = loop.create_future()
        """The metrics follower, which drains what is published when the driver winds down."""

    def stop(self, *, ended: bool = False) -> None:
        """Wind down without touching the job's state (it was cancelled, or the api stops);
        ``ended``: the job ended elsewhere (a cancel), so its requests are dropped on the engines."""
        self._ended_elsewhere = ended
        self._halted.set()
        self._conclude(None)

    # -- the phases: WAITING_FOR_V0 -> STARTING -> RUNNING -> FINISHING -> DONE ------------------

    async def run(self) -> None:
        """Follow the job's streams, move through the phases to an outcome, then record it."""
        if self.resumed:
            handle = await self.deps.bus.latest(self.streams.checkpoints, common_pb2.CheckpointHandle)
            if handle is not None:
                self._first_handle.set_result(handle)
                self._epoch = (handle.epoch, handle.version)
        log.info("driving %s (%s)", self.job_id, "resumed" if self.resumed else "new")
        self._metrics_task = asyncio.create_task(self._follow_metrics())
        followers = [self._follow_checkpoints, self._follow_status, self._follow_control]
        for follower in [*followers, self._follow_dead_letters, self._watchdog]:
            self._spawn(follower())
        try:
            while self.phase is not Phase.DONE:
                self.phase = await self._advance()
                log.info("%s: %s", self.job_id, self.phase.value)
        except RedisOutageError as err:  # beyond VERST_REDIS_OUTAGE_S: the job fails
            self._fail(str(err))
        finally:
            await asyncio.gather(self._wind_down(), self._drop_requests())
        outcome = self._outcome.result() if self._outcome.done() else None
        if outcome is None or not await wait_until_up(self.deps.bus.redis, self._halted):
            log.info("%s: stopped driving", self.job_id)
        else:
            state, reason = outcome
            applied = await self.store.set_state(self.job_id, state, reason)
            log.info(
                "%s: %s %s%s", self.job_id, state, reason, "" if applied else " (it had already finished)"
            )
        if self.settings.housekeeping_s:
            await tidy_ended_job(self.deps.bus, self.store, self.job_id, self.settings.dead_consumer_s)

    async def _advance(self) -> Phase:
        """Do the current phase's work; the next phase (DONE as soon as the job has an outcome)."""
        steps: dict[Phase, Callable[[], Coroutine[Any, Any, Phase]]] = {
            Phase.WAITING_FOR_V0: self._wait_for_v0,
            Phase.STARTING: self._start,
            Phase.RUNNING: self._run,
            Phase.FINISHING: self._finish,
        }
        work = asyncio.create_task(steps[self.phase]())
        try:
            await self._until(work)
        finally:
            if not work.done():  # its cancellation may be lost in redis-py: wait with a deadline
                work.cancel()
                await asyncio.wait([work], timeout=DRAIN_TIMEOUT_S)
        if self._outcome.done():
            return Phase.DONE
        return work.result()

    async def _wait_for_v0(self) -> Phase:
        await asyncio.wait([self._first_handle, self._trainer_done], return_when=asyncio.FIRST_COMPLETED)
        return Phase.STARTING if self._first_handle.done() else Phase.FINISHING

    async def _start(self) -> Phase:
        """Read the prompts and tokenizer, mark the job RUNNING, evaluate v0, start issuing."""
        handle = self._first_handle.result()
        record = await self.store.get(self.job_id)
        self._batches, self._extra = record.issued_batches, record.issued_extra
        self._dropped = max(self._dropped, record.dropped_groups)
        consumed = record.issued_batches * self.spec.rollout.prompts_per_step + record.issued_extra
        try:
            self.tokenizer = await asyncio.to_thread(load_job_tokenizer, self.spec, handle)
            self.evals.sets = await asyncio.to_thread(prepare_eval_sets, self.spec, self.tokenizer)
            self.evals.tokenizer = self.tokenizer
            feed = PromptFeed(self.spec, self.job_id, self.tokenizer, consumed=consumed)
        except (OSError, ValueError) as err:  # DataError is a ValueError; so are tokenizer load errors
            kind = "data" if isinstance(err, DataError) else f"tokenizer of checkpoint v{handle.version}"
            self._fail(f"cannot prepare the job's prompts: {kind}: {err}")
            return Phase.DONE
        if not self.resumed:
            await self.store.set_state(self.job_id, RUNNING)
            await self.store.update_progress(self.job_id, handle.version, handle.step)
            if self.spec.eval.at_start and self.evals.sets:
                await self.evals.evaluate(handle.version)
        else:  # this driver's predecessor died: an evaluation it had due (or running) is not lost
            await self.evals.catch_up(self.store, self.latest_version)
        self._issuing = [self._spawn(self._feed(feed)), self._spawn(self.evals.run(self._stopping))]
        every_s, dead_s = self.settings.housekeeping_s, self.settings.dead_consumer_s
        self._spawn(tend_job(self.deps.bus, self.job_id, every_s, dead_s, self._stopping))
        self._last_progress = time.monotonic()
        self._stall.start()
        return Phase.RUNNING

    async def _run(self) -> Phase:
        await self._trainer_done
        return Phase.FINISHING

    async def _finish(self) -> Phase:
        """Stop issuing; let a periodic evaluation in flight finish; evaluate the final version
        once the engines serve it."""
        for task in self._issuing[:1]:  # the feed; the evaluator ends itself in evals.close
            task.cancel()
        await self.evals.close()
        for task in self._issuing:
            task.cancel()
        status = self._trainer_done.result()
        final = max(status.policy_version, self.latest_version)
        reason = ""
        if self.evals.sets and final not in self.evals.done:
            error = await self.evals.evaluate(final)
            if error:
                reason = f"training finished at version {final}; the final evaluation failed: {error}"
        self._conclude((SUCCEEDED, reason))
        return Phase.DONE

    # -- 1. feed: paced prompt batches, and one replacement for each group lost ------------------

    async def _feed(self, feed: PromptFeed) -> None:
        """Publish paced batches (up to trainer.steps of them) and replacements for dropped groups."""
        while not self._stopping.is_set():
            self._wake.clear()
            issue = self._plan()
            try:
                if issue.replacements:
                    await self._publish(feed.extra(self._extra, issue.replacements), extra=True)
                for index in issue.batches:
                    await self._publish(feed.batch(index), extra=False)
            except DataError as err:  # e.g. no prompt fits max_prompt_tokens (feed.py's bound)
                self._fail(f"cannot issue prompts: {err}")
                return
            with contextlib.suppress(TimeoutError):  # a look at the stop flag now and then
                await asyncio.wait_for(self._wake.wait(), self.settings.poll_interval_s)

    def _plan(self) -> Issue:
        """The pacing rule (pacing.py) applied now."""
        return plan_issue(
            issued_batches=self._batches,
            issued_extra=self._extra,
            dropped=self._dropped,
            trainer_version=self.latest_version,
            max_staleness=self.spec.algorithm.max_staleness,
            steps=self.spec.trainer.steps,
            prompts_per_step=self.spec.rollout.prompts_per_step,
            oversample=self.spec.algorithm.oversample,
        )

    async def _publish(self, tasks: list[common_pb2.PromptTask], *, extra: bool) -> None:
        """Prompts, the new issued counts and the batch's issue lag, in one MULTI."""
        batches, extras = (
            (self._batches, self._extra + len(tasks)) if extra else (self._batches + 1, self._extra)
        )
        for task in tasks:
            # the current lineage's newest version: after a resume it may be below latest_version
            task.policy_epoch, task.policy_version = self._epoch
        lag = None
        if not extra and self._version_at > 0:  # a batch that the newest version let out
            values = {"issue_lag_s": max(0.0, time.time() - self._version_at)}
            version = self.latest_version
            lag = metric_message(self.job_id, "controller", values, step=version, policy_version=version)
        await self.store.publish_prompts(self.job_id, tasks, batches=batches, extra=extras, metric=lag)
        what = (
            f"{len(tasks)} replacement prompts" if extra else f"batch {self._batches} ({len(tasks)} prompts)"
        )
        self._batches, self._extra = batches, extras
        self.deps.metrics.prompts_issued.inc(len(tasks))
        log.info("%s: issued %s at version %d", self.job_id, what, self.latest_version)

    # -- 2-3. generate and score happen in a runner: what it could not do comes back as a dead letter ---

    async def _follow_dead_letters(self) -> None:
        await self._follow(self.streams.dead, common_pb2.DeadLetter, self._on_dead_letter)

    async def _on_dead_letter(self, delivery: Delivery[common_pb2.DeadLetter]) -> bool:
        """Count a dead-lettered prompt task or trajectory (the store acks that entry with the
        count) so that it is replaced; fail the job when the same failure keeps coming."""
        letter = delivery.message
        log.warning("%s: dead letter from %s: %s", self.job_id, letter.source_stream, letter.reason)
        await self.store.events.append(dead_letter_event(self.job_id, letter))
        repeated = self._failures.add(letter)
        if repeated:
            self._fail(repeated)
            return True
        if not replaces_work(letter, self.streams):
            return True
        dead = self.streams.dead
        self._count_lost(await self.store.count_dropped(self.job_id, delivery.entry_id, 1, stream=dead))
        return False

    # -- 4. train happens in the trainer: it reports the groups it dropped -----------------------

    async def _follow_control(self) -> None:
        await self._follow(self.streams.control, common_pb2.TrainerSignal, self._on_signal)

    async def _on_signal(self, delivery: Delivery[common_pb2.TrainerSignal]) -> bool:
        """Count dropped groups in the job record; the store acks that entry with the count."""
        signal = delivery.message
        if signal.WhichOneof("signal") != "groups_dropped":
            log.warning("%s: ignoring trainer signal %s", self.job_id, signal.WhichOneof("signal"))
            return True
        dropped = signal.groups_dropped
        groups = dropped.stale + dropped.invalid + dropped.zero_variance + dropped.filtered
        self._count_lost(await self.store.count_dropped(self.job_id, delivery.entry_id, groups))
        return False

    def _count_lost(self, total: int) -> None:
        """The job record's new count of lost work (dropped groups, dead letters): replace it."""
        if total > self._dropped:
            self._dropped = total
            self._wake.set()

    # -- 5. publish: the trainer's new version lets the feed out and makes evaluations due -------

    async def _follow_checkpoints(self) -> None:
        await self._follow(self.streams.checkpoints, common_pb2.CheckpointHandle, self._on_checkpoint)

    async def _on_checkpoint(self, delivery: Delivery[common_pb2.CheckpointHandle]) -> bool:
        handle = delivery.message
        if not self._first_handle.done():
            self._first_handle.set_result(handle)
        progressed = handle.version > self.latest_version
        if handle.epoch != self._epoch[0]:
            self._epoch = (handle.epoch, handle.version)  # a resumed trainer: its versions start again
            self._stall.start()  # which loaded the model: its first new version may take longer
        elif handle.version > self._epoch[1]:
            self._epoch = (handle.epoch, handle.version)
            progressed = True  # a new version, also one reissued after a resume
        if progressed:
            self._progressed()
        if handle.version > self.latest_version:
            self.latest_version = handle.version
            self._version_at = handle.created_at.ToNanoseconds() / 1e9
            self._wake.set()
            self._schedule_evaluation(handle.version)
        await self.store.update_progress(self.job_id, handle.version, handle.step)
        return True

    def _progressed(self) -> None:
        now = time.monotonic()
        self._stall.progressed(now - calm_since(self.deps.bus.redis, self._last_progress))
        self._last_progress = now
        self._failures.progress()

    # -- 6. evaluate -----------------------------------------------------------------------------

    def _schedule_evaluation(self, version: int) -> None:
        """Every ``eval.every_steps`` versions an evaluation is due; the evaluator (``evals.run``,
        started with the feed) makes it once an engine serves that version, or a newer one. The
        first and the final versions are evaluated by the phases (``_start``, ``_finish``)."""
        every = self.spec.eval.every_steps
        if every and version % every == 0 and version < self.spec.trainer.steps:
            self.evals.due(version)

    # -- the trainer's outcome, and the metrics of every stage -----------------------------------

    async def _follow_status(self) -> None:
        await self._follow(self.streams.status, common_pb2.JobStatus, self._on_status)

    async def _on_status(self, delivery: Delivery[common_pb2.JobStatus]) -> bool:
        status = delivery.message
        if status.state == common_pb2.JOB_STATE_FAILED:
            self._fail(f"trainer failed: {status.reason or 'no reason given'}")
        elif status.state == common_pb2.JOB_STATE_CANCELLED:
            self._conclude((CANCELLED, f"trainer stopped the job: {status.reason or 'no reason given'}"))
        elif status.state == common_pb2.JOB_STATE_SUCCEEDED:
            if not self._trainer_done.done():
                self._trainer_done.set_result(status)
        else:
            log.warning("%s: ignoring trainer status %s", self.job_id, common_pb2.JobState.Name(status.state))
        return True

    async def _follow_metrics(self) -> None:
        """Merge every Metric into the job record; once draining, until none is left. What
        arrives within ``metrics_merge_s`` of a merge waits for the next one: a step's metrics
        (trainer, engines, this controller) go in one transaction, not one each. Each merged batch
        then goes to the job's trackers; a resumed driver first gives them the job's history (they
        skip what they hold already), which the previous one may have merged but not tracked."""
        consumer = self._consumer(self.streams.metrics, common_pb2.Metric, 200)
        drain_until = float("inf")
        try:
            if self.resumed:
                await self._track(await self.store.history(self.job_id))
            while time.monotonic() < drain_until:
                deliveries = await consumer.poll()
                now = time.time()
                rows = [metric_row(delivery.message, now) for delivery in deliveries]
                acked = [delivery.entry_id for delivery in deliveries]
                await self.store.merge_metric_rows(self.job_id, rows, acked=acked)  # acked with the merge
                await self._track(rows)
                if self._draining:  # what is published already, for DRAIN_TIMEOUT_S at most
                    drain_until = min(drain_until, time.monotonic() + DRAIN_TIMEOUT_S)
                    if not deliveries:
                        return
                elif deliveries and self.settings.metrics_merge_s:
                    with contextlib.suppress(TimeoutError):  # winding down ends the wait
                        await asyncio.wait_for(self._stopping.wait(), self.settings.metrics_merge_s)
        finally:
            await asyncio.to_thread(self.tracking.close)

    async def _track(self, rows: list[MetricRow]) -> None:
        """Merged rows to the job's trackers (tracking.py), in a thread; their warnings told on
        the job's event log."""
        if rows:
            await asyncio.to_thread(self.tracking.write, rows)
        for text in self.tracking.take_problems():
            await self.store.events.append(warning_event(self.job_id, text))

    # -- machinery: helpers, their supervision, the stall watchdog -------------------------------

    def _conclude(self, outcome: Outcome) -> None:
        if not self._outcome.done():
            self._outcome.set_result(outcome)

    def _fail(self, reason: str) -> None:
        self._conclude((FAILED, reason))

    def _spawn(self, work: Awaitable[None]) -> asyncio.Future[None]:
        task = asyncio.ensure_future(work)
        self._helpers.append(task)
        return task

    async def _until(self, work: asyncio.Future[Any]) -> None:
        """Wait for ``work`` or the job's outcome; re-raise the error of a helper that crashed."""
        helpers = [self._metrics_task, *self._helpers]
        waiting: set[asyncio.Future[Any]] = {self._outcome, work, *helpers}
        while not (self._outcome.done() or work.done()):
            done, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task in helpers and not task.cancelled() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]

    async def _wind_down(self) -> None:
        """Stop the helpers; let the metrics follower record what is already published."""
        self._stopping.set()
        self._draining = True
        for task in self._helpers:
            task.cancel()
        done, late = await asyncio.wait([self._metrics_task, *self._helpers], timeout=DRAIN_TIMEOUT_S)
        for task in done:  # retrieved: a crash is reported once (by _until), not again by the GC
            _ = task.cancelled() or task.exception()
        if late:
            log.warning(
                "%s: %d helper tasks still running after %.0fs", self.job_id, len(late), DRAIN_TIMEOUT_S
            )

    async def _drop_requests(self) -> None:
        """A job that ended (here or elsewhere: a cancel) has its requests dropped on every engine
        at once, so that the next job's weights do not wait for them to finish."""
        outcome = self._outcome.result() if self._outcome.done() else None
        if outcome is not None or self._ended_elsewhere:
            await self.deps.stubs.abort_job(self.job_id, self.settings.abort_timeout_s)

    async def _watchdog(self) -> None:
        """Fail a job that waits too long for v0, or whose trainer stops making versions."""
        while not self._stopping.is_set():
            await asyncio.sleep(self.settings.poll_interval_s)
            if self.phase is Phase.WAITING_FOR_V0:
                waited = time.time() - self.record.submitted_at
                if waited > self.settings.queue_timeout_s:
                    self._fail(queue_timeout_reason(waited))
            elif self.phase is Phase.RUNNING:
                idle = time.monotonic() - calm_since(self.deps.bus.redis, self._last_progress)
                if idle > self._stall.allowed_s():
                    oldest = await self.deps.stubs.oldest_served_version(self.job_id)
                    served = "no engine serves the job" if oldest is None else f"engines serve v{oldest}"
                    self._fail(
                        f"stalled: no new policy version for {idle:.0f}s after version {self.latest_version}"
                        f" ({self._stall.explain()}; {served}; {self._batches} batches issued)"
                    )

    def _consumer(self, stream: str, message_type: type[Any], block_ms: int) -> StreamConsumer[Any]:
        return StreamConsumer(
            self.deps.bus,
            stream,
            GROUP,
            self.deps.consumer,
            message_type,
            block_ms=block_ms,
            reclaim_idle_ms=self.settings.reclaim_idle_ms,
            shared=self.deps.reads,
        )

    async def _follow(
        self, stream: str, message_type: type[Any], handle: Callable[[Delivery[Any]], Awaitable[bool]]
    ) -> None:
        """Hand each entry of ``stream`` to ``handle``, then ack those it returned True for."""
        consumer = self._consumer(stream, message_type, 500)
        while not self._stopping.is_set():
            deliveries = await consumer.poll()
            await consumer.ack([delivery for delivery in deliveries if await handle(delivery)])
