"""The engine's background work: follow the newest running job's checkpoints, and heartbeat.

A checkpoint handle names its weights by (job, epoch, version, sha256): a trainer that resumes
a job begins a new epoch and may reissue version numbers with other weights, so the watcher
loads the newest handle whenever it names other weights than the ones served, whatever its
version number, and the engine serves a version only with the weights of its handle.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from services.common.bus import Bus
from services.common.config import JobSpecError
from services.common.engine_registry import EngineRegistry
from services.common.jobs import JobNotFoundError, JobStore
from services.common.pb import common_pb2, rollout_pb2
from services.common.streams import JobStreams
from services.rollout.engine_protocol import Engine, ServedWeights, StaleWeightsError
from services.rollout.transport import FILESYSTEM, BroadcastReceiver, serve_handle
from services.rollout.weights import CheckpointError

log = logging.getLogger(__name__)

_UPDATE_MODES = {
    "continue": rollout_pb2.WEIGHT_UPDATE_MODE_CONTINUE,
    "abort": rollout_pb2.WEIGHT_UPDATE_MODE_ABORT,
}
"""JobSpec rollout.weight_update -> the mode of the watcher's loads for that job."""


async def newest_running_job(store: JobStore) -> str | None:
    """The most recently submitted job whose state is RUNNING."""
    running = await store.running_job_ids()
    return running[-1] if running else None


async def sleep_or_stop(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=seconds)


@dataclass(frozen=True, slots=True)
class LoadReport:
    """How a checkpoint load went."""

    update: ServedWeights
    load_s: float
    """From the start of verification until the worker served the weights."""
    latency_s: float | None
    """From the handle's created_at until served (None when the handle has no time)."""
    transport: str = FILESYSTEM
    """How the weights came: ``filesystem`` (the handle's files) or ``distributed`` (a group)."""
    fallback: str = ""
    """Why the handle's broadcast was not used, when it offered one this engine could not take."""


def weights_key(handle: common_pb2.CheckpointHandle) -> tuple[str, int, int, str]:
    """What names a handle's weights: the same key, the same weights (its sha256 verified)."""
    return (handle.job_id, handle.epoch, handle.version, handle.sha256.lower())


class WeightLoader:
    """Loads checkpoints into the engine one at a time (watcher and LoadWeights share it)."""

    def __init__(self, engine: Engine, timeout_s: float, receiver: BroadcastReceiver | None = None) -> None:
        self.engine = engine
        self.timeout_s = timeout_s
        self.receiver = receiver
        """Takes weights over the trainer's group when a handle offers them (None: files only)."""
        self._lock = asyncio.Lock()
        self.served: common_pb2.CheckpointHandle | None = None
        """The handle of the weights last loaded (None: the engine's own)."""
        self._loaded = asyncio.Event()
        """Set (and replaced by a fresh one) after every load: the requests waiting for a version
        look again. An event, not a condition: a waiter cancelled mid-wait holds no lock."""

    def serves(self, job_id: str, version: tuple[int, int]) -> bool:
        """Whether the engine serves ``job_id``'s weights at ``version`` (epoch, version) or newer:
        a later epoch (a resumed trainer's lineage) is newer than every version of an earlier one,
        an earlier epoch older than every version of a later one; epoch 0 compares versions alone."""
        status = self.engine.status()
        if status.job_id != job_id:
            return False
        epoch = self.served.epoch if self.served is not None and self.served.job_id == job_id else 0
        if version[0] and epoch:
            return (epoch, status.policy_version) >= version
        return status.policy_version >= version[1]

    async def wait_for_version(self, job_id: str, version: tuple[int, int], timeout_s: float) -> None:
        """Return once the engine serves ``job_id`` at ``version`` (epoch, version) or newer (the
        watcher loads a new handle as soon as it is published); StaleWeightsError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not self.serves(job_id, version):
            left = deadline - time.monotonic()
            if left <= 0:
                status = self.engine.status()
                raise StaleWeightsError(
                    f"the request needs {job_id} v{version[1]} (epoch {version[0]}) or newer; the engine"
                    f" serves {status.job_id or 'no job'} v{status.policy_version} after waiting"
                    f" {timeout_s:.1f}s"
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._loaded.wait(), left)

    async def load(
        self, handle: common_pb2.CheckpointHandle, mode: int, timeout_s: float | None = None
    ) -> LoadReport:
        """Verify and serve ``handle``. Raises CheckpointError (bad uri, files, sha256, or refused
        by the backend), TimeoutError, EngineStoppedError, or ConnectionError (backend unreachable)."""
        async with self._lock:
            started = time.monotonic()
            timeout_s = timeout_s or self.timeout_s
            delivered = await serve_handle(self.engine, self.receiver, handle, mode, timeout_s)
            update = delivered.update
            self.served = handle
            seconds = time.monotonic() - started
        self._loaded.set()
        self._loaded = asyncio.Event()
        latency = None
        if handle.HasField("created_at") and handle.created_at.seconds:
            latency = time.time() - handle.created_at.ToNanoseconds() / 1e9
        log.info(
            "serving %s v%d from %s over %s%s: loaded in %.3fs, %s after its handle was published "
            "(%d aborted)",
            handle.job_id,
            handle.version,
            update.path,
            delivered.transport,
            f" (fallback: {delivered.fallback})" if delivered.fallback else "",
            seconds,
            "?" if latency is None else f"{latency:.3f}s",
            update.aborted_requests,
        )
        return LoadReport(update, seconds, latency, delivered.transport, delivered.fallback)


class WeightWatcher:
    """Loads the newest running job's newest checkpoint if it names other weights, as soon as it
    is published (a blocking read of the job's checkpoints stream); every ``poll_s`` at least it
    looks again which job is the newest running one."""

    def __init__(self, redis: aioredis.Redis, loader: WeightLoader, poll_s: float) -> None:
        self.redis = redis
        self.bus = Bus(redis)
        self.jobs = JobStore(redis)
        self.loader = loader
        self.poll_s = poll_s
        self._refused: set[tuple[str, int, int, str]] = set()
        self._modes: dict[str, int] = {}
        """Each job's WeightUpdateMode, from its JobSpec (rollout.weight_update)."""
        self._last_error = ""
        self._watched: tuple[str, str] | None = None
        """(job, checkpoints-stream entry id) last looked at."""
        self._woken: tuple[str, str, common_pb2.CheckpointHandle | None] | None = None
        """(job, entry id, handle): the newest handle that the blocking read woke with, not looked at yet."""
        self._job: str | None = None
        self._job_read_at = 0.0
        """When the newest running job (``_job``) was last read (monotonic seconds)."""

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.check()
                self._last_error = ""
                await self._wait_for_handle(stop)
                continue
            except (RedisError, OSError, TypeError, TimeoutError) as err:
                if str(err) != self._last_error:  # log a persisting problem once
                    log.warning("weight watch failed: %s", err)
                    self._last_error = str(err)
            except Exception:  # a bug must not end weight watching for the life of the process
                log.exception("weight watch failed unexpectedly")
            await sleep_or_stop(stop, self.poll_s)

    async def _wait_for_handle(self, stop: asyncio.Event) -> None:
        """Until the watched job publishes a handle after the one looked at (a blocking stream
        read, so a new version is loaded as soon as it is published), or ``poll_s`` passes."""
        if self._watched is None:
            await sleep_or_stop(stop, self.poll_s)
            return
        job_id, seen = self._watched
        if not stop.is_set():
            block_ms = min(int(self.poll_s * 1000), self.bus.block_limit_ms)
            stream = JobStreams(job_id).checkpoints
            newest = await self.bus.wait_newest(stream, seen, common_pb2.CheckpointHandle, block_ms=block_ms)
            if newest is not None:
                self._woken = (job_id, *newest)

    async def check(self) -> bool:
        """Load the newest running job's newest checkpoint if the engine lacks it; True if loaded."""
        job_id = await self._job_to_watch()
        if job_id is None:
            self._watched = None
            return False
        # The newest id with the handle: one published after it wakes the next wait at once. The
        # wait that woke the watcher read them already, unless the job to watch changed since.
        woken, self._woken = self._woken, None
        if woken is not None and woken[0] == job_id:
            seen, handle = woken[1], woken[2]
        else:
            seen, handle = await self.bus.newest(JobStreams(job_id).checkpoints, common_pb2.CheckpointHandle)
        self._watched = (job_id, seen)
        if handle is None:
            return False
        if not handle.job_id:
            handle.job_id = job_id
        if not self._names_other_weights(handle):
            return False
        key = weights_key(handle)
        if key in self._refused:
            return False
        try:
            report = await self.loader.load(handle, await self._update_mode(handle.job_id))
        except CheckpointError as err:
            self._refused.add(key)  # the same handle will not get better by retrying
            log.error("refused checkpoint %s v%d: %s", handle.job_id, handle.version, err)
            return False
        await self._report(handle, report)
        return True

    async def _job_to_watch(self) -> str | None:
        """The newest running job, looked up at most every ``poll_s``: a new version of the job
        watched wakes the watcher, which then reads that job's stream alone (the jobs' states
        cost two round trips and most of the watcher's CPU, for every engine at every version)."""
        now = time.monotonic()
        if self._watched is None or now - self._job_read_at >= self.poll_s:
            self._job = await newest_running_job(self.jobs)
            self._job_read_at = now
        return self._job

    def _names_other_weights(self, handle: common_pb2.CheckpointHandle) -> bool:
        """Whether ``handle`` names weights other than those served."""
        served = self.loader.served
        if served is not None and (served.job_id, served.epoch) == (handle.job_id, handle.epoch):
            # One lineage: a newer version, or (never from an honest trainer) other bytes.
            if handle.version != served.version:
                return handle.version > served.version
            return weights_key(served) != weights_key(handle)
        if served is not None:
            return True  # another job, or another lineage of it: its version numbers say nothing
        status = self.loader.engine.status()  # the engine's own weights, loaded at its start
        return handle.job_id != status.job_id or handle.version > status.policy_version

    async def _update_mode(self, job_id: str) -> int:
        """The job's rollout.weight_update as a WeightUpdateMode (UNSPECIFIED: the engine's own)."""
        mode = self._modes.get(job_id)
        if mode is None:
            try:
                spec = await self.jobs.spec(job_id)
            except (JobNotFoundError, JobSpecError, RedisError) as err:
                log.warning("job %s: unreadable spec (%s); loads use the engine's mode", job_id, err)
                return rollout_pb2.WEIGHT_UPDATE_MODE_UNSPECIFIED
            chosen = spec.rollout.weight_update
            mode = rollout_pb2.WEIGHT_UPDATE_MODE_UNSPECIFIED if chosen is None else _UPDATE_MODES[chosen]
            self._modes[job_id] = mode
        return mode

    async def _report(self, handle: common_pb2.CheckpointHandle, report: LoadReport) -> None:
        """Publish the weight-sync timings on the job's metrics stream (source "rollout")."""
        values = {"weight_load_s": report.load_s}
        if report.latency_s is not None:
            values["weight_sync_latency_s"] = report.latency_s
        await self.bus.publish_metric(
            handle.job_id, "rollout", values, step=handle.step, policy_version=handle.version
        )


class Heartbeat:
    """Writes the engine's EngineInfo into the registry every ``interval_s`` until stopped."""

    def __init__(
        self, registry: EngineRegistry, info: Callable[[], common_pb2.EngineInfo], interval_s: float
    ) -> None:
        self.registry = registry
        self.info = info
        self.interval_s = interval_s

    async def run(self, stop: asyncio.Event) -> None:
        engine_id = self.info().engine_id
        failing = False
        while not stop.is_set():
            try:
                await self.registry.heartbeat(self.info())
                failing = False
            except (RedisError, OSError) as err:
                if not failing:
                    log.warning("heartbeat failed: %s", err)
                failing = True
            await sleep_or_stop(stop, self.interval_s)
        try:
            await self.registry.remove(engine_id)
        except (RedisError, OSError) as err:
            log.warning("could not remove %s from the registry: %s", engine_id, err)
