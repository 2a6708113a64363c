"""The trainer's consumer loop: claims one job at a time from ``verst:jobs`` and reports how it ended.

A submission is acked only when its job ends (succeeded, failed or cancelled),
so the job of a trainer that dies is reclaimed by another after
``job_reclaim_idle_ms``; a live trainer renews its claim every ``keepalive_s``.
"""

from __future__ import annotations

import asyncio
import logging

import torch
from redis.exceptions import RedisError

from services.common.bus import Bus, Delivery
from services.common.consumer import StreamConsumer, consumer_name
from services.common.engine_registry import EngineRegistry
from services.common.jobs import JobStore, decode_submission
from services.common.outage import RedisOutageError, wait_until_up
from services.common.pb import common_pb2, trainer_pb2
from services.common.streams import JOBS, JobStreams
from services.trainer.config import TrainerSettings
from services.trainer.job import JOB_GROUP, JobRun
from services.trainer.job_control import JobControl, JobStopped, StopKind
from services.trainer.report import Progress
from services.trainer.telemetry import TrainerMetrics
from services.trainer.transport import open_transport

log = logging.getLogger(__name__)

JobSubmission = common_pb2.JobSubmission


class NoJobError(Exception):
    """The request needs a running job, and there is none (or another one)."""


class TrainerWorker:
    """Trains the jobs it claims, one at a time, until the service shuts down."""

    def __init__(
        self, bus: Bus, settings: TrainerSettings, device: torch.device, metrics: TrainerMetrics | None = None
    ) -> None:
        self.bus = bus
        self.metrics = metrics or TrainerMetrics()
        self.metrics.follow_version(lambda: self.progress.policy_version)
        self.jobs = JobStore(bus.redis)
        self.settings = settings
        self.device = device
        self.name = settings.trainer_id or consumer_name("trainer")
        self.progress = Progress(trainer_id=self.name)
        self.transport = open_transport(settings, EngineRegistry(bus.redis), device)
        """How engines get the weights of every job this trainer trains."""
        self.current: JobRun | None = None
        self.last_checkpoint: common_pb2.CheckpointHandle | None = None
        self._job_done = asyncio.Event()

    async def run(self, shutdown: asyncio.Event) -> None:
        """Claim and train jobs until ``shutdown`` is set."""
        consumer = StreamConsumer(
            self.bus,
            JOBS,
            JOB_GROUP,
            self.name,
            JobSubmission,
            count=1,
            block_ms=self.settings.poll_block_ms,
            reclaim_idle_ms=self.settings.job_reclaim_idle_ms,
        )
        if self.settings.torch_threads:
            torch.set_num_threads(self.settings.torch_threads)
        log.info(
            "trainer %s waiting for jobs on %s (device %s, weights by %s)",
            *(self.name, JOBS, self.device, self.transport.name),
        )
        try:
            while not shutdown.is_set():
                try:
                    deliveries = await consumer.poll()
                except RedisOutageError:  # logged by the client: wait for Redis, quietly
                    await wait_until_up(self.bus.redis, shutdown)
                    continue
                except RedisError as err:
                    log.warning("reading %s failed, retrying: %s", JOBS, err)
                    await asyncio.sleep(1.0)
                    continue
                for delivery in deliveries:
                    await self._run_job(consumer, delivery, shutdown)
        finally:
            await asyncio.to_thread(self.transport.close)

    async def _run_job(
        self,
        consumer: StreamConsumer[JobSubmission],
        delivery: Delivery[JobSubmission],
        shutdown: asyncio.Event,
    ) -> None:
        job_id = delivery.message.job_id
        if not job_id:
            await consumer.dead_letter(delivery, "JobSubmission has no job_id")
            return
        self.progress = Progress(trainer_id=self.name, job_id=job_id)
        self._job_done = asyncio.Event()
        try:
            if await self.jobs.is_terminal(job_id):
                log.info("job %s is already over; not training it", job_id)
                await consumer.ack([delivery])
                return
            log.info("claimed job %s (delivery %d)", job_id, delivery.delivery_count)
            _, spec = decode_submission(delivery.message)
            self.current = JobRun(
                bus=self.bus,
                jobs=self.jobs,
                settings=self.settings,
                consumer=self.name,
                job_id=job_id,
                spec=spec,
                submission_entry_id=delivery.entry_id,
                control=JobControl(shutdown),
                progress=self.progress,
                device=self.device,
                transport=self.transport,
                metrics=self.metrics,
            )
            await self.current.run()
            await self._finish(consumer, delivery, common_pb2.JOB_STATE_SUCCEEDED, "")
        except JobStopped as stop:
            await self._stopped(consumer, delivery, stop)
        except RedisOutageError as err:  # the job fails, as soon as that can be recorded
            log.error("job %s failed: %s", job_id, err)
            if await wait_until_up(self.bus.redis, shutdown):
                await self._finish(consumer, delivery, common_pb2.JOB_STATE_FAILED, str(err))
        except Exception as err:
            log.exception("job %s failed", job_id)
            await self._finish(
                consumer, delivery, common_pb2.JOB_STATE_FAILED, f"{type(err).__name__}: {err}"
            )
        finally:
            self.current = None
            self.last_checkpoint = self.progress.last_checkpoint
            self.progress = Progress(trainer_id=self.name)
            self._job_done.set()

    async def _stopped(
        self, consumer: StreamConsumer[JobSubmission], delivery: Delivery[JobSubmission], stop: JobStopped
    ) -> None:
        job_id = delivery.message.job_id
        if stop.kind is StopKind.REQUESTED:
            await self._finish(consumer, delivery, common_pb2.JOB_STATE_CANCELLED, stop.reason)
        elif stop.kind is StopKind.ENDED_ELSEWHERE:
            log.info("job %s stopped: %s", job_id, stop.reason)
            await consumer.ack([delivery])
        else:  # shutdown, or another trainer holds the job: it stays pending for whoever has it
            log.info("job %s left to another trainer: %s", job_id, stop.reason)

    async def _finish(
        self,
        consumer: StreamConsumer[JobSubmission],
        delivery: Delivery[JobSubmission],
        state: common_pb2.JobState.ValueType,
        reason: str,
    ) -> None:
        """Report the job's end on its status stream, then ack its submission."""
        job_id = delivery.message.job_id
        status = common_pb2.JobStatus(
            job_id=job_id,
            state=state,
            policy_version=self.progress.policy_version,
            step=self.progress.step,
            reason=reason,
        )
        status.updated_at.GetCurrentTime()
        try:
            await self.bus.publish(JobStreams(job_id).status, status)
            await consumer.ack([delivery])
        except RedisError as err:
            log.error("could not report job %s as %s (%s); it stays pending", job_id, state, err)
            return
        log.info("job %s %s %s", job_id, common_pb2.JobState.Name(state), reason)

    # -- the Trainer service's requests ---------------------------------------------------

    def _running(self, job_id: str = "") -> JobRun:
        run = self.current
        if run is None:
            raise NoJobError("the trainer is not running a job")
        if job_id and job_id != run.job_id:
            raise NoJobError(f"the trainer runs job {run.job_id!r}, not {job_id!r}")
        return run

    async def checkpoint(self, job_id: str) -> common_pb2.CheckpointHandle:
        """The checkpoint of the running job's current weights."""
        return await self._running(job_id).latest_checkpoint()

    async def stop_job(self, reason: str) -> common_pb2.CheckpointHandle | None:
        """Stop the running job after its step in progress; it ends CANCELLED. Returns its
        last durable checkpoint, which holds its final weights (a stop writes one)."""
        run = self._running()
        done = self._job_done
        self.progress.state = trainer_pb2.TRAINER_STATE_STOPPING
        run.control.stop(JobStopped(StopKind.REQUESTED, reason or "stopped through the Trainer service"))
        try:
            await asyncio.wait_for(done.wait(), self.settings.stop_wait_s)
        except TimeoutError:
            raise TimeoutError(
                f"the job did not end within {self.settings.stop_wait_s:.0f}s; it stops after its step"
            ) from None
        return self.last_checkpoint
