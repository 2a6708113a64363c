"""The runner's batches against real Redis and real gRPC: the groups in flight together share
one router GenerateBatch and one reward ScoreBatch, a bad task among them is dead-lettered
alone, and groups that finish together are published together and acked only once written."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from services.common.bus import DATA_FIELD, Bus
from services.common.consumer import StreamConsumer
from services.common.jobs import JobStore
from services.common.pb import common_pb2, rollout_pb2, router_pb2_grpc
from services.common.streams import JobStreams
from services.runner.publishing import GroupPublisher
from services.runner.server import GROUP, Runner
from tests.helpers import Aborted, FakeContext, eventually, serve
from tests.integration.fake_services import FakeReward, FakeRouter, running_job, trajectories


class BatchingRouter(FakeRouter):
    """FakeRouter with GenerateBatch: each request answered as its Generate, failures in its result."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self.batch_sizes: list[int] = []

    async def GenerateBatch(
        self, request: rollout_pb2.GenerateBatchRequest, context: Any
    ) -> rollout_pb2.GenerateBatchResponse:
        self.batch_sizes.append(len(request.requests))
        results = []
        for item in request.requests:
            try:
                results.append(rollout_pb2.GenerateResult(response=await self.Generate(item, FakeContext())))
            except Aborted as err:
                results.append(rollout_pb2.GenerateResult(code=err.code.value[0], details=err.details))
        return rollout_pb2.GenerateBatchResponse(results=results)


@pytest.fixture
async def batching_router(tokenizer: Any) -> AsyncIterator[tuple[BatchingRouter, str]]:
    fake = BatchingRouter(tokenizer)
    server, address = await serve(lambda s: router_pb2_grpc.add_RouterServicer_to_server(fake, s))
    yield fake, address
    await server.stop(None)


async def test_groups_in_flight_together_share_calls_and_a_bad_one_fails_alone(
    bus: Bus,
    tokenizer: Any,
    tokenizer_dir: Any,
    batching_router: tuple[BatchingRouter, str],
    reward: tuple[FakeReward, str],
    runner_for: Callable[..., Awaitable[Runner]],
) -> None:
    fake_router, router_address = batching_router
    job = await running_job(bus, JobStore(bus.redis), tokenizer, tokenizer_dir)
    tasks = [job.task(i, f"{10 + i}+20=", str(30 + i)[::-1]) for i in range(6)]
    tasks.insert(3, job.task(6, "bad+1=", "1"))
    await bus.publish_many(job.streams.prompts, tasks)
    await runner_for(router_address=router_address, reward_address=reward[1], batch_window_s=0.01)

    async def done() -> bool:
        return await bus.redis.xlen(job.streams.trajectories) >= 24 and await job.pending() == 0

    await eventually(done, what="6 groups published and all 7 tasks acked or dead-lettered")
    assert sum(fake_router.batch_sizes) == 7 and max(fake_router.batch_sizes) > 1, fake_router.batch_sizes
    assert len(reward[0].batches) < 6, "the groups' ScoreBatches were merged"
    assert sum(len(batch.items) for batch in reward[0].batches) == 24
    [entry] = await bus.redis.xrange(job.streams.dead)
    letter = common_pb2.DeadLetter.FromString(entry[1][DATA_FIELD])
    assert "INVALID_ARGUMENT" in letter.reason and common_pb2.PromptTask.FromString(
        letter.payload
    ).prompt_id == (f"{job.job_id}:0:6")
    published = await trajectories(bus, job.job_id)
    assert sorted({t.prompt_id for t in published}) == sorted(
        t.prompt_id for t in tasks if "bad" not in t.prompt_text
    )
    for trajectory in published:  # each group's own samples and rewards came back to it
        task = next(t for t in tasks if t.prompt_id == trajectory.prompt_id)
        expected = 1.0 if trajectory.sample_index % 2 == 0 else 0.0
        assert trajectory.reward == expected, (task.prompt_text, trajectory.sample_index)


async def test_a_group_whose_publish_failed_stays_pending_while_the_others_are_acked(bus: Bus) -> None:
    jobs = ["job-ok", "job-broken"]
    consumers = {}
    for job_id in jobs:
        streams = JobStreams(job_id)
        await bus.publish(streams.prompts, common_pb2.PromptTask(prompt_id=f"{job_id}:0", job_id=job_id))
        consumers[job_id] = StreamConsumer(bus, streams.prompts, GROUP, "runner-test", common_pb2.PromptTask)
    await bus.redis.set(JobStreams("job-broken").trajectories, b"not a stream")  # every XADD fails
    publisher = GroupPublisher(bus, GROUP, window_s=0.01, max_calls=64)
    publishes: list[int] = []
    publish_groups = bus.publish_groups

    async def counted(groups: Any, **options: Any) -> Any:
        publishes.append(len(groups))
        return await publish_groups(groups, **options)

    bus.publish_groups = counted  # type: ignore[method-assign]
    outcomes = []
    for job_id in jobs:
        [delivery] = await consumers[job_id].poll()
        trajectory = common_pb2.Trajectory(id=f"{job_id}:0:0", job_id=job_id)
        outcomes.append(publisher.publish_and_ack(JobStreams(job_id).trajectories, [trajectory], delivery))
    ok, broken = await asyncio.gather(*outcomes, return_exceptions=True)
    assert ok is None and "WRONGTYPE" in str(broken)
    assert await bus.pending_count(JobStreams("job-ok").prompts, GROUP) == 0
    assert await bus.pending_count(JobStreams("job-broken").prompts, GROUP) == 1, "left for a retry"
    assert await bus.redis.xlen(JobStreams("job-ok").trajectories) == 1
    assert publishes == [2], "both groups in one round trip"
    await publisher.close()
