"""The rollout runner against real Redis and real gRPC servers standing in for the router and
reward (tests/integration/fake_services.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from services.common.bus import DATA_FIELD, Bus
from services.common.config import JobSpec
from services.common.jobs import JobStore
from services.common.pb import (
    common_pb2,
    reward_pb2_grpc,
    rollout_pb2,
    router_pb2_grpc,
)
from services.common.redis_server import free_port
from services.common.streams import JobStreams
from services.runner.server import Runner
from tests.helpers import eventually, serve
from tests.integration.fake_services import (
    ENGINE_ID,
    EOS,
    FakeReward,
    FakeRouter,
    logprob,
    running_job,
    trajectories,
)


async def test_one_trajectory_per_sample_with_engine_data_and_reward(
    bus: Bus,
    tokenizer: Any,
    tokenizer_dir: Path,
    router: tuple[FakeRouter, str],
    reward: tuple[FakeReward, str],
    runner_for: Callable[..., Awaitable[Runner]],
) -> None:
    fake_router, router_address = router
    fake_router.version = 3
    job = await running_job(bus, JobStore(bus.redis), tokenizer, tokenizer_dir)
    task = job.task(0, "47+85=", "231")
    task.policy_version = 2
    task.created_at.GetCurrentTime()
    await bus.publish(job.streams.prompts, task)
    await runner_for(router_address=router_address, reward_address=reward[1])

    await eventually(lambda: _count(bus, job.job_id, 4), what="4 trajectories")
    await eventually(lambda: _is_zero(job.pending()), what="the ack")
    got = await trajectories(bus, job.job_id)
    assert [t.id for t in got] == [f"{task.prompt_id}:{i}" for i in range(4)], (
        "sample order, ids prompt:index"
    )
    for i, t in enumerate(got):
        answer_ids = [*tokenizer("231" if i % 2 == 0 else "0")["input_ids"], EOS]
        assert (t.job_id, t.prompt_id, t.group_id) == (job.job_id, task.prompt_id, task.prompt_id)
        assert (t.sample_index, t.group_size, t.num_turns, t.split) == (i, 4, 1, common_pb2.SPLIT_TRAIN)
        assert list(t.prompt_token_ids) == list(task.prompt_token_ids)
        assert list(t.response_token_ids) == answer_ids
        assert list(t.behaviour_logprobs) == pytest.approx([logprob(i, p) for p in range(len(answer_ids))])
        assert list(t.policy_versions) == [3] * len(answer_ids)
        assert list(t.loss_mask) == [True] * len(answer_ids)
        assert t.reward == (1.0 if i % 2 == 0 else 0.0) and t.reward_error == ""
        assert dict(t.reward_components) == {"correct": t.reward}
        assert t.finish_reason == common_pb2.FINISH_REASON_STOP and t.engine_id == ENGINE_ID
        stages = t.stages  # the controller's stamp, then the runner's, in the loop's order
        issued = task.created_at.ToNanoseconds() / 1e9
        assert stages.issued == pytest.approx(issued)
        assert issued <= stages.picked <= stages.generated <= stages.scored <= stages.published
    [request] = fake_router.requests
    assert request.min_policy_version == 2, "no weights older than the task's version sample it"
    assert (request.request_id, request.session_id, request.job_id) == (
        task.prompt_id,
        task.group_id,
        job.job_id,
    )
    assert request.sampling.n == 4 and request.sampling.temperature == 1.0
    [batch] = reward[0].batches
    assert [item.response_text for item in batch.items] == ["231", "0", "231", "0"], "decoded without EOS"
    assert {item.answer for item in batch.items} == {"231"} and {item.verifier for item in batch.items} == {
        "addition"
    }


async def test_acks_only_after_the_group_is_scored_and_published(
    bus: Bus,
    tokenizer: Any,
    tokenizer_dir: Path,
    router: tuple[FakeRouter, str],
    reward: tuple[FakeReward, str],
    runner_for: Callable[..., Awaitable[Runner]],
) -> None:
    fake_reward, reward_address = reward
    fake_reward.gate.clear()
    job = await running_job(bus, JobStore(bus.redis), tokenizer, tokenizer_dir)
    await bus.publish(job.streams.prompts, job.task(0, "12+34=", "64"))
    await runner_for(router_address=router[1], reward_address=reward_address)

    await eventually(lambda: _is_true(len(router[0].requests) == 1), what="the Generate call")
    await asyncio.sleep(0.3)
    assert await job.pending() == 1 and await trajectories(bus, job.job_id) == []
    fake_reward.gate.set()
    await eventually(lambda: _is_zero(job.pending()), what="the ack")
    assert len(await trajectories(bus, job.job_id)) == 4


async def test_a_task_stays_pending_while_the_reward_service_is_down_and_is_retried(
    bus: Bus,
    tokenizer: Any,
    tokenizer_dir: Path,
    router: tuple[FakeRouter, str],
    runner_for: Callable[..., Awaitable[Runner]],
) -> None:
    reward_port = free_port()
    job = await running_job(
        bus, JobStore(bus.redis), tokenizer, tokenizer_dir,
        rollout={"request_timeout_s": 1.0}, reward={"timeout_s": 0.5},
    )  # fmt: skip
    await bus.publish(job.streams.prompts, job.task(0, "12+34=", "64"))
    await runner_for(
        router_address=router[1], reward_address=f"127.0.0.1:{reward_port}", retry_s=0.2, reclaim_idle_ms=1000
    )

    await eventually(lambda: _is_true(len(router[0].requests) >= 1), what="the Generate call")
    await asyncio.sleep(0.5)
    assert await job.pending() == 1, "a failed task is left pending, never acked"
    assert await trajectories(bus, job.job_id) == []
    assert await bus.redis.xlen(job.streams.dead) == 0

    fake = FakeReward()
    server, _ = await serve(lambda s: reward_pb2_grpc.add_RewardServicer_to_server(fake, s), reward_port)
    try:
        # Reclaimed once it has been idle for reclaim_idle_ms (a failed task is not kept alive).
        await eventually(lambda: _count(bus, job.job_id, 4), timeout_s=15, what="the retried group")
        await eventually(lambda: _is_zero(job.pending()), what="the ack")
    finally:
        await server.stop(None)
    assert len(router[0].requests) >= 2, "generated again on the retry"


async def test_a_task_the_engine_refuses_is_dead_lettered(
    bus: Bus,
    tokenizer: Any,
    tokenizer_dir: Path,
    router: tuple[FakeRouter, str],
    reward: tuple[FakeReward, str],
    runner_for: Callable[..., Awaitable[Runner]],
) -> None:
    job = await running_job(bus, JobStore(bus.redis), tokenizer, tokenizer_dir)
    await bus.publish_many(job.streams.prompts, [job.task(0, "bad+1=", "1"), job.task(1, "10+10=", "02")])
    await runner_for(router_address=router[1], reward_address=reward[1])

    await eventually(lambda: _count(bus, job.job_id, 4), what="the good task's trajectories")
    await eventually(lambda: _is_zero(job.pending()), what="both tasks to leave the pending list")
    [entry] = await bus.redis.xrange(job.streams.dead)
    letter = common_pb2.DeadLetter.FromString(entry[1][DATA_FIELD])
    assert "INVALID_ARGUMENT" in letter.reason and "out of vocabulary" in letter.reason
    assert common_pb2.PromptTask.FromString(letter.payload).prompt_id == f"{job.job_id}:0:0"
    assert {t.prompt_id for t in await trajectories(bus, job.job_id)} == {f"{job.job_id}:0:1"}


async def test_groups_run_concurrently_up_to_the_bound_and_only_for_running_jobs(
    bus: Bus,
    tokenizer: Any,
    tokenizer_dir: Path,
    router: tuple[FakeRouter, str],
    reward: tuple[FakeReward, str],
    runner_for: Callable[..., Awaitable[Runner]],
) -> None:
    fake_router, router_address = router
    fake_router.delay_s = 0.2
    store = JobStore(bus.redis)
    job = await running_job(bus, store, tokenizer, tokenizer_dir)
    queued_id = (await store.create(JobSpec())).job_id
    await bus.publish(JobStreams(queued_id).prompts, job.task(9, "11+11=", "22"))
    await bus.publish_many(job.streams.prompts, [job.task(i, f"{10 + i}+20=", "0") for i in range(6)])
    await runner_for(router_address=router_address, reward_address=reward[1], max_concurrent_groups=2)

    await eventually(lambda: _count(bus, job.job_id, 24), what="24 trajectories")
    assert fake_router.max_in_flight == 2
    assert await bus.redis.xlen(JobStreams(queued_id).trajectories) == 0, "a queued job's prompts wait"
    assert await bus.redis.xinfo_groups(JobStreams(queued_id).prompts) == [], "nobody read them"


async def _count(bus: Bus, job_id: str, expected: int) -> bool:
    return await bus.redis.xlen(JobStreams(job_id).trajectories) >= expected


async def _is_zero(value: Awaitable[int]) -> bool:
    return await value == 0


async def _is_true(value: bool) -> bool:
    return value


async def test_a_long_rollout_is_kept_alive_and_not_handed_out_twice(
    bus: Bus,
    tokenizer: Any,
    tokenizer_dir: Path,
    router: tuple[FakeRouter, str],
    reward: tuple[FakeReward, str],
    runner_for: Callable[..., Awaitable[Runner]],
) -> None:
    fake_router, router_address = router
    fake_router.delay_s = 1.2
    job = await running_job(bus, JobStore(bus.redis), tokenizer, tokenizer_dir)
    await bus.publish(job.streams.prompts, job.task(0, "12+34=", "64"))
    # Two runners; a task idle for 0.3 s counts as abandoned, yet this one takes 1.2 s.
    await runner_for(router_address=router_address, reward_address=reward[1], reclaim_idle_ms=300)
    await runner_for(router_address=router_address, reward_address=reward[1], reclaim_idle_ms=300)

    await eventually(lambda: _count(bus, job.job_id, 4), what="the group")
    await eventually(lambda: _is_zero(job.pending()), what="the ack")
    await asyncio.sleep(0.5)
    assert len(fake_router.requests) == 1, "renewed while in flight, so never reclaimed"
    assert await bus.redis.xlen(job.streams.trajectories) == 4


class PartialRouter(FakeRouter):
    """Every sample's response is the right answer and EOS. A fresh request is aborted after one
    token; a resume (resume_offset > 0) continues from the partial tokens in its prompt, under
    the next version, to the end, or for one more token and aborted again (``abort_resumes``)."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self.abort_resumes = False

    async def Generate(
        self, request: rollout_pb2.GenerateRequest, context: Any
    ) -> rollout_pb2.GenerateResponse:
        self.requests.append(request)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.in_flight -= 1
        prompt = list(request.prompt_token_ids)
        offset = request.resume_offset or len(prompt)
        text = self.tokenizer.decode(prompt[:offset], skip_special_tokens=True)
        full = [*self.tokenizer(self.answer(text, 0, greedy=False))["input_ids"], EOS]
        done = len(prompt) - offset
        resumed = request.resume_offset > 0
        end = done + 1 if not resumed or self.abort_resumes else len(full)
        finish = common_pb2.FINISH_REASON_STOP if end == len(full) else common_pb2.FINISH_REASON_ABORT
        completions = [
            rollout_pb2.Completion(
                index=index,
                token_ids=full[done:end],
                logprobs=[logprob(0, p) for p in range(done, end)],
                policy_versions=[self.version + resumed] * (end - done),
                finish_reason=finish,
            )
            for index in range(request.sampling.n or 1)
        ]
        return rollout_pb2.GenerateResponse(
            request_id=request.request_id, completions=completions, engine_id=ENGINE_ID
        )


@pytest.fixture
async def partial_router(tokenizer: Any) -> AsyncIterator[tuple[PartialRouter, str]]:
    fake = PartialRouter(tokenizer)
    server, address = await serve(lambda s: router_pb2_grpc.add_RouterServicer_to_server(fake, s))
    yield fake, address
    await server.stop(None)


async def test_aborted_samples_are_resumed_from_their_partial_tokens(
    bus: Bus,
    tokenizer: Any,
    tokenizer_dir: Path,
    partial_router: tuple[PartialRouter, str],
    reward: tuple[FakeReward, str],
    runner_for: Callable[..., Awaitable[Runner]],
) -> None:
    from services.runner.group import resume_seed

    fake_router, router_address = partial_router
    fake_router.version, fake_router.delay_s = 3, 0.2
    job = await running_job(bus, JobStore(bus.redis), tokenizer, tokenizer_dir)
    task = job.task(0, "47+85=", "231")
    task.sampling.seed = 11
    task.policy_version = 3
    await bus.publish(job.streams.prompts, task)
    await runner_for(router_address=router_address, reward_address=reward[1])

    await eventually(lambda: _count(bus, job.job_id, 4), what="4 trajectories")
    full = [*tokenizer("231")["input_ids"], EOS]
    for i, t in enumerate(await trajectories(bus, job.job_id)):
        assert (t.sample_index, t.finish_reason) == (i, common_pb2.FINISH_REASON_STOP)
        assert list(t.prompt_token_ids) == list(task.prompt_token_ids), "the task prompt, not the resume's"
        assert list(t.response_token_ids) == full and t.reward == 1.0
        assert list(t.behaviour_logprobs) == pytest.approx([logprob(0, p) for p in range(len(full))])
        assert list(t.policy_versions) == [3] + [4] * (len(full) - 1), "each token keeps its version"
        assert t.metadata["resumes"] == "1"
    first, *resumes = fake_router.requests
    assert first.resume_offset == 0 and first.sampling.n == 4
    assert {r.min_policy_version for r in fake_router.requests} == {3}, "resumes keep the task's bound"
    assert fake_router.max_in_flight == 4, "the four resumes ran concurrently"
    assert sorted(r.request_id for r in resumes) == [f"{task.prompt_id}:{i}:resume1" for i in range(4)]
    seeds = {r.request_id: r.sampling.seed for r in resumes}
    assert seeds == {f"{task.prompt_id}:{i}:resume1": resume_seed(11, i, 1) for i in range(4)}
    assert len(set(seeds.values()) | {11}) == 5, "a distinct seed per sample and resume"
    for r in resumes:
        assert list(r.prompt_token_ids) == [*task.prompt_token_ids, full[0]]
        assert r.resume_offset == len(task.prompt_token_ids)
        assert (r.sampling.n, r.sampling.max_new_tokens, r.sampling.temperature) == (1, 7, 1.0)
        assert (r.session_id, r.job_id) == (task.group_id, job.job_id), "same affinity and job"


async def test_a_sample_still_aborted_after_max_resumes_is_published_aborted(
    bus: Bus,
    tokenizer: Any,
    tokenizer_dir: Path,
    partial_router: tuple[PartialRouter, str],
    reward: tuple[FakeReward, str],
    runner_for: Callable[..., Awaitable[Runner]],
) -> None:
    fake_router, router_address = partial_router
    fake_router.abort_resumes = True
    job = await running_job(bus, JobStore(bus.redis), tokenizer, tokenizer_dir)
    task = job.task(0, "47+85=", "231")
    await bus.publish(job.streams.prompts, task)
    await runner_for(router_address=router_address, reward_address=reward[1], max_resumes=2)

    await eventually(lambda: _count(bus, job.job_id, 4), what="4 trajectories")
    await eventually(lambda: _is_zero(job.pending()), what="the ack")
    full = [*tokenizer("231")["input_ids"], EOS]
    for t in await trajectories(bus, job.job_id):
        assert t.finish_reason == common_pb2.FINISH_REASON_ABORT and t.metadata["resumes"] == "2"
        assert list(t.response_token_ids) == full[:3] and list(t.policy_versions) == [0, 1, 1]
        assert len(t.behaviour_logprobs) == 3 and t.reward_error == ""
    resumes = fake_router.requests[1:]
    assert len(resumes) == 8, "two resumes per sample, then it is published as it is"
    assert sorted(r.sampling.max_new_tokens for r in resumes) == [6] * 4 + [7] * 4
    assert all(not r.sampling.HasField("seed") for r in resumes), "no seed when the task had none"
