"""The job controller: drives every unfinished job, inside the api's process or as its own.

``Controller.run`` polls the job store every ``poll_interval_s``, in two round trips
whatever the number of jobs (``JobStore.active_overview``: states, submit times, and
whether each job's trainer has published a checkpoint or status yet). A QUEUED job
costs nothing else: it gets a ``JobDriver`` (services/controller/driver.py), with its
blocking stream reads, only once its trainer has spoken, and one that waits past
``queue_timeout_s`` fails here without ever getting one. Each RUNNING job that this
process does not drive yet gets a driver, so jobs are picked up again after an api
restart; the driver of a job that finished elsewhere (a cancel through the api) is
stopped. A driver that crashed is started again after a pause.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from services.common.bus import Bus
from services.common.consumer import SharedReads, consumer_name
from services.common.jobs import FAILED, QUEUED, ActiveJob, JobNotFoundError, JobStore
from services.common.outage import RedisOutageError, wait_until_up
from services.controller.config import ControllerSettings
from services.controller.driver import GROUP, DriverDeps, JobDriver, queue_timeout_reason
from services.controller.stubs import ServiceStubs
from services.controller.telemetry import ControllerMetrics

log = logging.getLogger(__name__)

RESTART_DELAY_S = 5.0
"""Pause before a crashed driver of a still-active job is started again."""
STOP_TIMEOUT_S = 10.0
"""How long a stopping driver may take to wind down before it is cancelled."""
SHARED_BLOCK_MS = 200
"""Longest block of the one read that serves every job's followers (the metrics follower, the
quickest, used to block this long on its own)."""


class Controller:
    """Starts, supervises and stops one JobDriver per unfinished job."""

    def __init__(
        self,
        bus: Bus,
        store: JobStore,
        settings: ControllerSettings,
        metrics: ControllerMetrics,
        *,
        consumer: str = "",
    ) -> None:
        self.bus = bus
        self.store = store
        self.settings = settings
        self.metrics = metrics
        self.consumer = consumer or consumer_name("controller")
        """Consumer name on the job streams: unique per process, so a restart reclaims its
        predecessor's pending entries."""
        self._drivers: dict[str, tuple[JobDriver, asyncio.Task[None]]] = {}
        self._stopping: set[asyncio.Task[None]] = set()
        self._restart_at: dict[str, float] = {}
        self.last_poll = time.monotonic()
        """time.monotonic() when the last poll finished, well or not (/healthz watches it)."""
        self.stubs = ServiceStubs(settings.router_address, settings.reward_address)
        reads = SharedReads(bus, GROUP, self.consumer, block_ms=SHARED_BLOCK_MS)
        self._deps = DriverDeps(bus, store, self.stubs, settings, metrics, self.consumer, reads)

    @property
    def driven_jobs(self) -> list[str]:
        """Ids of the jobs this controller drives now."""
        return sorted(self._drivers)

    async def run(self, stop: asyncio.Event) -> None:
        """Poll the job store until ``stop`` is set; then stop every driver."""
        try:
            while not stop.is_set():
                try:
                    await self.sync()
                except RedisOutageError:  # the client logs the outage; the drivers fail their jobs
                    await wait_until_up(self.bus.redis, stop)
                except Exception:  # a Redis outage must not end the controller: try again next poll
                    log.exception("controller: polling the job store failed")
                self.last_poll = time.monotonic()
                self.metrics.drivers.set(len(self._drivers))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.settings.poll_interval_s)
        finally:
            await self.close()

    async def sync(self) -> None:
        """Start drivers for active jobs that need one; stop those of jobs no longer active; fail
        queued jobs past their queue timeout."""
        active = {job.job_id: job for job in await self.store.active_overview()}
        self._reap(active)
        now = time.monotonic()
        to_start = []
        for job in active.values():
            if job.job_id in self._drivers:
                continue
            if job.state == QUEUED and not job.trainer_reported:
                await self._expire(job)
            elif now >= self._restart_at.get(job.job_id, 0.0):
                to_start.append(job.job_id)
        for job_id in to_start:
            with contextlib.suppress(JobNotFoundError):
                record = await self.store.get(job_id)
                if not record.terminal:
                    driver = JobDriver(self._deps, record)
                    self._drivers[job_id] = (
                        driver,
                        asyncio.create_task(driver.run(), name=f"driver {job_id}"),
                    )

    def _reap(self, active: dict[str, ActiveJob]) -> None:
        """Stop the drivers of jobs no longer active; note those that crashed, for a restart."""
        for job_id, (driver, task) in list(self._drivers.items()):
            if job_id not in active:
                del self._drivers[job_id]
                if not task.done():
                    driver.stop(ended=True)  # cancelled (or ended) elsewhere
                    self._stopping.add(task)
                    task.add_done_callback(self._stopping.discard)
            elif task.done():
                del self._drivers[job_id]
                self._restart_at[job_id] = time.monotonic() + RESTART_DELAY_S
                error = None if task.cancelled() else task.exception()
                log.error("driver of %s stopped: %r; restarting it in %.0fs", job_id, error, RESTART_DELAY_S)
        for job_id in [job_id for job_id in self._restart_at if job_id not in active]:
            del self._restart_at[job_id]

    async def _expire(self, job: ActiveJob) -> None:
        """Fail a queued job whose trainer has not spoken within the queue timeout."""
        waited = time.time() - job.submitted_at
        if waited <= self.settings.queue_timeout_s:
            return
        reason = queue_timeout_reason(waited)
        if await self.store.set_state(job.job_id, FAILED, reason):
            log.info("%s: %s %s", job.job_id, FAILED, reason)

    async def close(self) -> None:
        """Stop every driver (without changing job states) and close the channels."""
        for driver, task in self._drivers.values():
            driver.stop()
            self._stopping.add(task)
        self._drivers.clear()
        if self._stopping:
            _, late = await asyncio.wait(self._stopping, timeout=STOP_TIMEOUT_S)
            for task in late:
                log.warning("%s did not stop within %.0fs; cancelled", task.get_name(), STOP_TIMEOUT_S)
                task.cancel()
        await self.stubs.close()
