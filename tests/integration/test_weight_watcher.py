"""The engine's weight watcher against a real Redis: each new version of the job it watches is
loaded at once in one read of the checkpoints stream; which job runs is read at most every
``poll_s``, and a newer job is still taken up within that time."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.common.bus import Bus
from services.common.config import JobSpec
from services.common.jobs import RUNNING, JobStore
from services.common.pb import common_pb2
from services.common.streams import JobStreams
from services.rollout.engine_protocol import EngineStatus, ServedWeights
from services.rollout.watcher import LoadReport, WeightWatcher

POLL_S = 1.5
"""Long against the test's versions, which all come within one poll."""


class RecordingEngine:
    def __init__(self) -> None:
        self.job_id, self.version = "", 0

    def status(self) -> EngineStatus:
        return EngineStatus(0, self.version, self.job_id, "", 0, 0, 0)


class RecordingLoader:
    """What the watcher asks of a WeightLoader, recording the handles it was given."""

    def __init__(self) -> None:
        self.engine = RecordingEngine()
        self.served: common_pb2.CheckpointHandle | None = None
        self.loaded: list[tuple[str, int]] = []

    async def load(self, handle: common_pb2.CheckpointHandle, mode: int) -> LoadReport:
        self.served = handle
        self.engine.job_id, self.engine.version = handle.job_id, handle.version
        self.loaded.append((handle.job_id, handle.version))
        return LoadReport(ServedWeights(handle.version, handle.job_id, Path(handle.uri), mode), 0.0, None)


@pytest.fixture
async def watching(bus: Bus) -> AsyncIterator[tuple[RecordingLoader, JobStore]]:
    loader = RecordingLoader()
    watcher = WeightWatcher(bus.redis, loader, POLL_S)  # type: ignore[arg-type]
    stop = asyncio.Event()
    task = asyncio.create_task(watcher.run(stop))
    yield loader, JobStore(bus.redis)
    stop.set()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.wait_for(task, POLL_S + 2)


async def running_job(store: JobStore) -> str:
    job_id = (await store.create(JobSpec())).job_id
    assert await store.set_state(job_id, RUNNING)
    return job_id


async def running_job_served(bus: Bus, loader: RecordingLoader, store: JobStore) -> str:
    """A new running job whose first version the watcher has loaded."""
    job_id = await running_job(store)
    await publish(bus, job_id, 1)
    await until_loaded(loader, job_id, 1, POLL_S + 2)
    return job_id


async def publish(bus: Bus, job_id: str, version: int) -> None:
    handle = common_pb2.CheckpointHandle(job_id=job_id, version=version, uri=f"/ckpt/{job_id}/v{version}")
    await bus.publish(JobStreams(job_id).checkpoints, handle)


async def until_loaded(loader: RecordingLoader, job_id: str, version: int, timeout_s: float) -> float:
    started = time.monotonic()
    while (job_id, version) not in loader.loaded:
        assert time.monotonic() - started < timeout_s, f"{job_id} v{version} not loaded: {loader.loaded}"
        await asyncio.sleep(0.005)
    return time.monotonic() - started


def calls(bus_info: dict[str, dict[str, int]], command: str) -> int:
    return int(bus_info.get(f"cmdstat_{command}", {}).get("calls", 0))


async def test_each_version_is_one_read_and_the_jobs_are_read_once_a_poll(
    bus: Bus, watching: tuple[RecordingLoader, JobStore]
) -> None:
    loader, store = watching
    job_id = await running_job_served(bus, loader, store)
    await bus.redis.config_resetstat()
    started = time.monotonic()
    for version in range(2, 12):
        await publish(bus, job_id, version)
        assert await until_loaded(loader, job_id, version, 1.0) < 1.0, "a version waits for no poll"
    elapsed = time.monotonic() - started
    stats = await bus.redis.info("commandstats")
    assert elapsed < POLL_S, "the versions must all come within one poll for the counts below"
    assert calls(stats, "smembers") <= 1, "the running jobs are read at most once a poll, not per version"
    # The blocking read that a version wakes returns it: no second read of the stream for it.
    assert calls(stats, "xrevrange") == 0, "the version is taken from the read it woke"
    assert calls(stats, "xread") <= 11, "one read of the stream per version (and the one waiting now)"
    assert [v for j, v in loader.loaded if j == job_id] == list(range(1, 12))


async def test_a_newer_job_is_taken_up_within_a_poll(
    bus: Bus, watching: tuple[RecordingLoader, JobStore]
) -> None:
    loader, store = watching
    first = await running_job_served(bus, loader, store)
    second = await running_job(store)
    await publish(bus, second, 1)
    for version in range(2, 5):  # the first job goes on publishing: its versions wake the watcher
        await publish(bus, first, version)
        await asyncio.sleep(0.2)
    await until_loaded(loader, second, 1, POLL_S + 1)
