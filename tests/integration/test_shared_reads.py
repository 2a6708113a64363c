"""Many jobs' followers on one small Redis pool: SharedReads serves every stream's blocking read
in one XREADGROUP, and a pool that runs dry says so at once (services/common/consumer.py, bus.py)."""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.exceptions import MaxConnectionsError, ResponseError

from services.common.bus import DATA_FIELD, Bus, connect
from services.common.consumer import SharedReads, StreamConsumer
from services.common.pb import common_pb2
from services.common.streams import JobStreams, dead_letter_stream

GROUP = "controller"
POOL = 8
JOBS = 40
"""Five times the pool: one blocking read each would need 40 connections."""


def status(job_id: str) -> common_pb2.JobStatus:
    return common_pb2.JobStatus(job_id=job_id, state=common_pb2.JOB_STATE_SUCCEEDED)


async def follow_until_one(consumer: StreamConsumer[common_pb2.JobStatus]) -> common_pb2.JobStatus:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        deliveries = await consumer.poll()
        if deliveries:
            await consumer.ack(deliveries)
            return deliveries[0].message
    raise TimeoutError(f"nothing on {consumer.stream}")


async def test_forty_jobs_followers_share_a_pool_of_eight(redis_url: str) -> None:
    bus = Bus(connect(redis_url, max_connections=POOL, pool_wait_s=0.3))  # a blocking read each: too few
    reads = SharedReads(bus, GROUP, "controller-1", block_ms=200)
    streams = [JobStreams(f"job-{i}").status for i in range(JOBS)]
    consumers = [
        StreamConsumer(bus, s, GROUP, "controller-1", common_pb2.JobStatus, shared=reads) for s in streams
    ]
    try:
        followers = [asyncio.create_task(follow_until_one(consumer)) for consumer in consumers]
        await asyncio.sleep(0.5)  # every follower is waiting in a round before anything is published
        for i in reversed(range(JOBS)):
            await bus.publish(streams[i], status(f"job-{i}"))
        got = await asyncio.wait_for(asyncio.gather(*followers), timeout=30)
        assert [message.job_id for message in got] == [f"job-{i}" for i in range(JOBS)]
        assert len(bus.redis.connection_pool._in_use_connections) <= POOL
    finally:
        await bus.close()


async def test_a_stream_without_its_group_fails_its_own_reader_alone(bus: Bus) -> None:
    reads = SharedReads(bus, GROUP, "controller-1", block_ms=200)
    good, lost = JobStreams("job-1").status, JobStreams("job-2").status
    await bus.ensure_group(good, GROUP)
    await bus.publish(good, status("job-1"))
    await bus.publish(lost, status("job-2"))  # a stream whose group is gone (deleted with its job)
    outcomes = await asyncio.gather(
        reads.read(good, common_pb2.JobStatus), reads.read(lost, common_pb2.JobStatus), return_exceptions=True
    )
    assert [d.message.job_id for d in outcomes[0]] == ["job-1"]  # type: ignore[union-attr]
    assert isinstance(outcomes[1], ResponseError) and "NOGROUP" in str(outcomes[1])


async def test_a_non_finite_metric_is_dead_lettered_naming_it(bus: Bus) -> None:
    reads = SharedReads(bus, GROUP, "controller-1", block_ms=200)
    metrics = JobStreams("job-1").metrics
    await bus.ensure_group(metrics, GROUP)
    bad = common_pb2.Metric(job_id="job-1", source="trainer", step=2, values={"loss": float("nan")})
    await bus.publish(metrics, bad)
    assert await reads.read(metrics, common_pb2.Metric) == []
    entries = await bus.redis.xrange(dead_letter_stream(metrics))
    [letter] = [common_pb2.DeadLetter.FromString(fields[DATA_FIELD]) for _, fields in entries]
    assert "metric values must be finite numbers, not trainer/loss=nan" in letter.reason
    assert await bus.pending_count(metrics, GROUP) == 0


async def test_an_exhausted_pool_says_so_after_a_short_wait(redis_url: str) -> None:
    bus = Bus(connect(redis_url, max_connections=POOL, pool_wait_s=0.5))
    blocked = [asyncio.create_task(bus.wait_newer(f"quiet-{i}", "$", block_ms=5000)) for i in range(POOL)]
    try:
        await asyncio.sleep(0.3)  # each holds a connection, blocked in XREAD
        started = time.monotonic()
        with pytest.raises(
            MaxConnectionsError, match=rf"exhausted: all {POOL} connections in use.*VERST_REDIS_MAX"
        ):
            await bus.redis.ping()
        assert time.monotonic() - started < 2.0, "the pool's wait ends in an error, not a hang"
    finally:
        for task in blocked:
            task.cancel()
        await asyncio.gather(*blocked, return_exceptions=True)
        await bus.close()


async def test_a_second_reader_of_one_stream_reads_on_its_own(bus: Bus) -> None:
    reads = SharedReads(bus, GROUP, "controller-1", block_ms=200)
    stream = JobStreams("job-1").status
    await bus.ensure_group(stream, GROUP)
    await bus.publish(stream, status("job-1"))
    first, second = await asyncio.gather(
        reads.read(stream, common_pb2.JobStatus), reads.read(stream, common_pb2.JobStatus)
    )
    assert sorted([len(first), len(second)]) == [0, 1], "the entry went to exactly one of them"


async def test_a_reader_back_from_handling_its_entry_is_in_the_next_round(bus: Bus) -> None:
    """A job's checkpoint follower handles its entry (a few ms) while the other followers are back
    at once: the next round waits for it, so its next entry is read as it comes, not after a
    round of the others' blocks out (which held the controller's pacing ~0.1 s a step)."""
    reads = SharedReads(bus, GROUP, "controller-1", block_ms=2000)
    slow, quick = JobStreams("job-1").checkpoints, JobStreams("job-1").control
    for stream in (slow, quick):
        await bus.ensure_group(stream, GROUP)
    stop = asyncio.Event()

    async def quick_follower() -> None:
        while not stop.is_set():
            await reads.read(quick, common_pb2.JobStatus)

    follower = asyncio.create_task(quick_follower())
    try:
        await asyncio.sleep(0.05)
        reader = asyncio.create_task(reads.read(slow, common_pb2.JobStatus))
        await asyncio.sleep(0.05)
        first = await bus.publish(slow, status("job-1"))
        assert [d.entry_id for d in await asyncio.wait_for(reader, 5)] == [first]
        await asyncio.sleep(0.02)  # handling it: the quick follower is back first
        reader = asyncio.create_task(reads.read(slow, common_pb2.JobStatus))
        await asyncio.sleep(0.1)
        published = time.monotonic()
        second = await bus.publish(slow, status("job-1"))
        assert [d.entry_id for d in await asyncio.wait_for(reader, 5)] == [second]
        assert time.monotonic() - published < 0.5, "the entry waited out a round it was not in"
    finally:
        stop.set()
        await bus.publish(quick, status("job-1"))
        await asyncio.wait_for(follower, 5)
