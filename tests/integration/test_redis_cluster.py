"""The bus and the job store on a 3-shard Redis Cluster (from the embedded binary), through the
client factory: several jobs whose hash tags land on different shards, each job's streams,
transactions and scripts within its own slot, the global keys within theirs."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
from redis.crc import key_slot
from redis.exceptions import RedisClusterException

from services.common.bus import Bus
from services.common.config import JobSpec
from services.common.engine_registry import EngineRegistry
from services.common.housekeeping import tidy_job
from services.common.jobs import RUNNING, SUCCEEDED, JobStore, MetricRow
from services.common.pb import common_pb2
from services.common.redis_client import RedisMode, is_cluster, parse_redis_url
from services.common.streams import (
    CONTROLLER_GROUP,
    DEAD,
    JOBS,
    RUNNERS_GROUP,
    TRAINER_GROUP,
    TRAINERS_GROUP,
    JobStreams,
    job_key,
)
from tests.integration.redis_topologies import Node, redis_cluster, shard_ranges

SHARDS = 3


@pytest.fixture(scope="module")
def cluster() -> Iterator[list[Node]]:
    with redis_cluster(SHARDS) as nodes:
        yield nodes


@pytest.fixture
async def bus(cluster: list[Node]) -> AsyncIterator[Bus]:
    url = "redis+cluster://" + ",".join(f"127.0.0.1:{node.port}" for node in cluster)
    target = parse_redis_url(url)
    assert target.mode is RedisMode.CLUSTER
    bus = Bus.from_url(target, outage_s=5, max_deliveries=3)
    await bus.redis.flushall(target_nodes="all")
    yield bus
    await bus.close()


def shard_of(key: str) -> int:
    slot = key_slot(key.encode())
    return next(n for n, slots in enumerate(shard_ranges(SHARDS)) if slot in slots)


def job_per_shard() -> list[str]:
    """One job id whose hash tag lands on each shard."""
    found: dict[int, str] = {}
    for n in range(1000):
        job_id = f"job-{n}"
        found.setdefault(shard_of(job_key(job_id)), job_id)
        if len(found) == SHARDS:
            return [found[shard] for shard in range(SHARDS)]
    raise AssertionError("no job id for some shard in 1000 tries")


def task(job_id: str, n: int) -> common_pb2.PromptTask:
    return common_pb2.PromptTask(job_id=job_id, prompt_id=f"p{n}", group_id=f"g{n}")


def handle(job_id: str, version: int) -> common_pb2.CheckpointHandle:
    return common_pb2.CheckpointHandle(job_id=job_id, version=version, uri=f"file:///ckpt/v{version}")


async def test_a_jobs_keys_share_its_slot_and_jobs_spread_over_the_shards(bus: Bus) -> None:
    assert is_cluster(bus.redis)
    jobs = job_per_shard()
    assert sorted(shard_of(job_key(job_id)) for job_id in jobs) == list(range(SHARDS))
    for job_id in jobs:
        streams = JobStreams(job_id)
        slots = {key_slot(key.encode()) for key in (job_key(job_id), *streams.every(), streams.events)}
        assert slots == {key_slot(job_key(job_id).encode())}, job_id
    assert key_slot(JOBS.encode()) == key_slot(DEAD.encode())


async def test_the_cluster_refuses_what_spans_slots(bus: Bus) -> None:
    """What the bus and the job store avoid: without it the tests below would fail."""
    job_id = job_per_shard()[0]
    pipe = bus.redis.pipeline(transaction=True)
    pipe.hset(job_key(job_id), "state", "x")
    pipe.xadd(JOBS, {"t": "x"})
    with pytest.raises(RedisClusterException, match=r"same (key )?slot"):
        await pipe.execute()
    streams = {JobStreams(other).status: ">" for other in job_per_shard()}
    with pytest.raises(RedisClusterException, match=r"same (key )?slot"):
        await bus.redis.xreadgroup(CONTROLLER_GROUP, "c", streams, block=10)


async def test_publish_consume_ack_and_reclaim_on_every_shard(bus: Bus) -> None:
    for job_id in job_per_shard():
        prompts = JobStreams(job_id).prompts
        await bus.ensure_group(prompts, RUNNERS_GROUP)
        await bus.publish_many(prompts, [task(job_id, n) for n in range(4)])
        first = await bus.read(prompts, RUNNERS_GROUP, "runner-a", common_pb2.PromptTask, count=4)
        assert [d.message.group_id for d in first] == ["g0", "g1", "g2", "g3"]
        assert await bus.ack(prompts, RUNNERS_GROUP, [first[0].entry_id]) == 1
        # runner-a dies holding three: runner-b takes them over, each delivered a second time
        taken = await bus.reclaim(prompts, RUNNERS_GROUP, "runner-b", common_pb2.PromptTask, min_idle_ms=0)
        assert [(d.message.group_id, d.delivery_count) for d in taken] == [("g1", 2), ("g2", 2), ("g3", 2)]
        assert await bus.owner(prompts, RUNNERS_GROUP, taken[0].entry_id) == "runner-b"
        assert await bus.ack(prompts, RUNNERS_GROUP, [d.entry_id for d in taken]) == 3
        assert await bus.pending_count(prompts, RUNNERS_GROUP) == 0
        assert await bus.trim_consumed(prompts) == 4


async def test_publish_groups_of_jobs_on_every_shard_in_one_call(bus: Bus) -> None:
    jobs = job_per_shard()
    groups = [(JobStreams(job_id).prompts, [task(job_id, n) for n in range(3)]) for job_id in jobs]
    outcomes = await bus.publish_groups(groups)  # one script call per stream, each on its shard
    assert all(isinstance(ids, list) and len(ids) == 3 for ids in outcomes), outcomes
    for job_id, ids in zip(jobs, outcomes, strict=True):
        entries = await bus.redis.xrange(JobStreams(job_id).prompts)
        assert [entry_id.decode() for entry_id, _ in entries] == ids


async def test_bad_entries_are_dead_lettered_in_their_own_slot(bus: Bus) -> None:
    for job_id in job_per_shard():
        streams = JobStreams(job_id)
        await bus.ensure_group(streams.trajectories, TRAINER_GROUP)
        await bus.publish(streams.trajectories, task(job_id, 0))  # a PromptTask where a Trajectory goes
        got = await bus.read(streams.trajectories, TRAINER_GROUP, "trainer", common_pb2.Trajectory)
        assert got == []
        [(_, fields)] = await bus.redis.xrange(streams.dead)
        letter = common_pb2.DeadLetter.FromString(fields[b"d"])
        assert letter.source_stream == streams.trajectories
        assert await bus.pending_count(streams.trajectories, TRAINER_GROUP) == 0, "acked with the letter"
    # a stream of no job: its dead letters go to the global stream, in the same slot as JOBS
    await bus.ensure_group(JOBS, TRAINERS_GROUP)
    await bus.publish(JOBS, task("x", 0))
    assert await bus.read(JOBS, TRAINERS_GROUP, "trainer", common_pb2.JobSubmission) == []
    assert await bus.redis.xlen(DEAD) == 1


async def test_one_read_many_over_jobs_on_every_shard(bus: Bus) -> None:
    """The controller's shared reads: several jobs' streams in one call (one XREADGROUP per slot)."""
    jobs = job_per_shard()
    wanted = {}
    for job_id in jobs:
        streams = JobStreams(job_id)
        for stream in (streams.status, streams.checkpoints):
            await bus.ensure_group(stream, CONTROLLER_GROUP)
            wanted[stream] = common_pb2.JobStatus if stream == streams.status else common_pb2.CheckpointHandle
        await bus.publish(
            streams.status, common_pb2.JobStatus(job_id=job_id, state=common_pb2.JOB_STATE_SUCCEEDED)
        )
        await bus.publish(streams.checkpoints, handle(job_id, 1))
    got = await bus.read_many(wanted, CONTROLLER_GROUP, "controller", block_ms=500)
    assert {stream: len(deliveries) for stream, deliveries in got.items()} == dict.fromkeys(wanted, 1)
    acked = [(stream, deliveries[0].entry_id) for stream, deliveries in got.items()]
    assert await bus.ack_many(CONTROLLER_GROUP, acked) == len(wanted)
    newest = await bus.latest(JobStreams(jobs[0]).checkpoints, common_pb2.CheckpointHandle)
    assert newest is not None and newest.version == 1


async def test_the_job_store_across_shards(bus: Bus) -> None:
    store = JobStore(bus.redis)
    records = [await store.create(JobSpec(name=f"shard{n}")) for n in range(6)]
    ids = [record.job_id for record in records]
    assert len({shard_of(job_key(job_id)) for job_id in ids}) > 1, "the jobs spread over shards"
    assert await bus.redis.xlen(JOBS) == 6
    digest = await store.list_digest(limit=10)
    done, running = ids[0], ids[1]
    assert await store.set_state(running, RUNNING)
    assert await store.set_state(done, SUCCEEDED, "ok")
    assert not await store.set_state(done, RUNNING), "a terminal state is final"
    assert await store.list_digest(limit=10) != digest
    assert [job.job_id for job in await store.active_overview()] == ids[1:]
    assert await store.running_job_ids() == [running]
    assert [brief.job_id for brief in await store.list_briefs(10)] == ids[::-1]
    counts = await store.count_by_state()
    assert (counts[SUCCEEDED], counts[RUNNING]) == (1, 1)

    streams = JobStreams(running)
    await bus.ensure_group(streams.metrics, CONTROLLER_GROUP)
    entry = await bus.publish_metric(running, "trainer", {"loss": 0.5}, step=1, policy_version=1)
    row = MetricRow(1, 1, "trainer", {"loss": 0.5}, 1.0)
    await store.merge_metric_rows(running, [row], acked=[entry])  # WATCH + MULTI in the job's slot
    assert (await store.get(running)).metrics == {"trainer/loss": 0.5}
    assert await bus.pending_count(streams.metrics, CONTROLLER_GROUP) == 0
    await store.publish_prompts(running, [task(running, 0)], batches=1, extra=0)
    assert await bus.redis.xlen(streams.prompts) == 1
    await bus.ensure_group(streams.control, CONTROLLER_GROUP)
    dropped = common_pb2.TrainerSignal(job_id=running, groups_dropped=common_pb2.GroupsDropped(stale=2))
    signal = await bus.publish(streams.control, dropped)
    await bus.read(streams.control, CONTROLLER_GROUP, "controller", common_pb2.TrainerSignal)
    assert await store.count_dropped(running, signal, 2) == 2
    assert await store.count_dropped(running, signal, 2) == 2, "an entry is counted once"
    assert [e.kind for e in await store.events.tail(done, 10)][-1:] == ["state"]
    assert await tidy_job(bus, running, dead_after_ms=0, ended=True) >= 0  # its scripts run per stream


async def test_the_engine_registry_on_a_cluster(bus: Bus) -> None:
    registry = EngineRegistry(bus.redis)
    await registry.heartbeat(common_pb2.EngineInfo(engine_id="e1", address="a:1"), now=100.0)
    await registry.heartbeat(common_pb2.EngineInfo(engine_id="e2", address="a:2"), now=50.0)
    assert [engine.engine_id for engine in await registry.alive(30.0, now=110.0)] == ["e1"]
    assert await registry.prune(30.0, now=110.0) == 1
    await registry.remove("e1")
    assert await registry.alive(1e9, now=110.0) == []
