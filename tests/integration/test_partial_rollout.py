"""Partial rollout end to end: a real engine, router, reward service and runner in this process.

A group is aborted in the middle of its generation (a weight load in abort mode, an Abort
RPC); the runner resumes every sample from its partial tokens, and the published
trajectories carry the whole response, each token with the version that produced it and a
logprob equal to a full forward pass of those weights.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from transformers import LlamaForCausalLM

from services.common.bus import Bus
from services.common.config import JobSpec
from services.common.jobs import RUNNING, JobStore
from services.common.pb import common_pb2, reward_pb2_grpc, rollout_pb2
from services.common.streams import JobStreams
from services.data import encode_prompt
from services.reward.config import RewardSettings
from services.reward.server import RewardServicer
from services.runner.config import RunnerSettings
from services.runner.server import Runner
from services.tasks.addition_model import build_char_tokenizer
from tests.helpers import eventually, serve, stream_messages
from tests.integration.rollout_helpers import (
    RunningEngine,
    handle_for,
    publish_checkpoint,
    reference_logprobs,
    save_checkpoint,
    serve_router,
    start_engine,
    tiny_llama,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GROUP = 4
MAX_POSITIONS = 1024
MAX_NEW = 1000
"""Long enough (about 2 s for the group on one CPU thread) to act while it runs."""
TOKENS_FIRST = 20
"""Tokens per sample the engine has made before the test interrupts it."""
LENGTH = common_pb2.FINISH_REASON_LENGTH
ABORT = common_pb2.FINISH_REASON_ABORT


@dataclass
class Stack:
    """A running job (checkpoint v0) served by one engine, a router and a reward service."""

    bus: Bus
    job_id: str
    engine: RunningEngine
    model_v0: LlamaForCausalLM
    tokenizer: Any
    router_address: str
    reward_address: str
    tmp_path: Path
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    runners: list[asyncio.Task[None]] = field(default_factory=list)

    def start_runner(self, **settings: Any) -> None:
        values = {
            "router_address": self.router_address,
            "reward_address": self.reward_address,
            "jobs_refresh_s": 0.05,
            **settings,
        }
        runner = Runner(self.bus, JobStore(self.bus.redis), RunnerSettings(**values))
        self.runners.append(asyncio.create_task(runner.run(self.stop)))

    def task(self, seed: int) -> common_pb2.PromptTask:
        prompt_id = f"{self.job_id}:0:0"
        return common_pb2.PromptTask(
            prompt_id=prompt_id,
            job_id=self.job_id,
            group_id=prompt_id,
            prompt_token_ids=encode_prompt(self.tokenizer, "47+85="),
            prompt_text="47+85=",
            n_samples=GROUP,
            sampling=common_pb2.SamplingParams(
                temperature=1.0, max_new_tokens=MAX_NEW, n=GROUP, seed=seed, ignore_eos=True
            ),
            answer="231",
            verifier="addition",
            split=common_pb2.SPLIT_TRAIN,
        )

    async def roll_out(self, task: common_pb2.PromptTask, interrupt: Callable[[], Awaitable[int]]) -> None:
        """Publish ``task``; once each sample has tokens, ``interrupt`` it (it returns how many
        requests it aborted: the group's one)."""
        await self.bus.publish(JobStreams(self.job_id).prompts, task)
        await eventually(self._generating, what="the group to be generating")
        assert await interrupt() == 1, "the group was still generating when it was interrupted"

    async def _generating(self) -> bool:
        info = await self.engine.stub.GetStatus(rollout_pb2.GetEngineStatusRequest(), timeout=5)
        return info.running_requests == 1 and info.outstanding_tokens <= GROUP * (MAX_NEW - TOKENS_FIRST)

    async def trajectories(self) -> list[common_pb2.Trajectory]:
        stream = JobStreams(self.job_id).trajectories

        async def published() -> bool:
            return await self.bus.redis.xlen(stream) >= GROUP

        await eventually(published, timeout_s=20, what="the group's trajectories")
        return await stream_messages(self.bus, stream, common_pb2.Trajectory)


@pytest.fixture
async def stack(bus: Bus, redis_url: str, tmp_path: Path) -> AsyncIterator[Stack]:
    tokenizer = build_char_tokenizer()
    model = tiny_llama(0, vocab=len(tokenizer), max_positions=MAX_POSITIONS)
    path = save_checkpoint(model, tmp_path / "v000000")
    tokenizer.save_pretrained(path)  # the runner decodes with the checkpoint's tokenizer
    store = JobStore(bus.redis)
    job_id = (await store.create(JobSpec.model_validate({"algorithm": {"group_size": GROUP}}))).job_id
    await store.set_state(job_id, RUNNING)
    await publish_checkpoint(bus, job_id, path, 0)
    engine = await start_engine(redis_url, engine_id="engine-partial", heartbeat_s=0.1)
    router = await serve_router(redis_url)
    reward = RewardServicer(RewardSettings(port=0))
    reward_server, reward_address = await serve(
        lambda s: reward_pb2_grpc.add_RewardServicer_to_server(reward, s)
    )
    running = Stack(bus, job_id, engine, model, tokenizer, router.address, reward_address, tmp_path)
    try:
        await engine.wait_for_version(0)
        yield running
    finally:
        running.stop.set()
        await asyncio.wait_for(asyncio.gather(*running.runners), 10)
        await router.stop()
        await reward_server.stop(None)
        await engine.stop()


def _check_logprobs(
    trajectory: common_pb2.Trajectory, models: dict[int, LlamaForCausalLM], prompt: list[int]
) -> None:
    """Every token's logprob is what a full forward pass of its version's weights gives."""
    response = list(trajectory.response_token_ids)
    versions = list(trajectory.policy_versions)
    logprobs = list(trajectory.behaviour_logprobs)
    assert len(logprobs) == len(versions) == len(response) == len(trajectory.loss_mask)
    for version, model in models.items():
        expected = reference_logprobs(model, prompt, response)
        at = [i for i, v in enumerate(versions) if v == version]
        assert [logprobs[i] for i in at] == pytest.approx([expected[i] for i in at], abs=1e-4), (
            f"the v{version} tokens"
        )


async def test_a_group_aborted_by_a_weight_update_is_resumed_under_the_new_weights(stack: Stack) -> None:
    stack.start_runner()
    model_v1 = tiny_llama(1, vocab=len(stack.tokenizer), max_positions=MAX_POSITIONS)
    handle = handle_for(stack.job_id, save_checkpoint(model_v1, stack.tmp_path / "v000001"), 1)

    async def load_in_abort_mode() -> int:
        request = rollout_pb2.LoadWeightsRequest(handle=handle, mode=rollout_pb2.WEIGHT_UPDATE_MODE_ABORT)
        return (await stack.engine.stub.LoadWeights(request, timeout=30)).aborted_requests

    task = stack.task(seed=5)
    await stack.roll_out(task, load_in_abort_mode)
    got = await stack.trajectories()
    prompt = list(task.prompt_token_ids)
    assert [t.sample_index for t in got] == list(range(GROUP))
    for t in got:
        versions = list(t.policy_versions)
        assert list(t.prompt_token_ids) == prompt, "the task prompt, whatever the resumes sent"
        assert len(t.response_token_ids) == MAX_NEW and t.finish_reason == LENGTH
        assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)
        assert t.metadata["resumes"] == "1" and t.reward_error == ""
        _check_logprobs(t, {0: stack.model_v0, 1: model_v1}, prompt)
    assert len({tuple(t.response_token_ids) for t in got}) == GROUP, "four different samples"


async def test_a_group_aborted_by_an_abort_rpc_is_resumed(stack: Stack) -> None:
    stack.start_runner()
    task = stack.task(seed=7)

    async def abort() -> int:
        request = rollout_pb2.AbortRequest(request_ids=[task.prompt_id])
        return (await stack.engine.stub.Abort(request, timeout=5)).aborted

    await stack.roll_out(task, abort)
    for t in await stack.trajectories():
        assert len(t.response_token_ids) == MAX_NEW and t.finish_reason == LENGTH
        assert set(t.policy_versions) == {0} and t.metadata["resumes"] == "1"
        _check_logprobs(t, {0: stack.model_v0}, list(task.prompt_token_ids))


async def test_with_max_resumes_0_an_aborted_sample_is_published_with_its_partial_tokens(
    stack: Stack,
) -> None:
    stack.start_runner(max_resumes=0)
    task = stack.task(seed=9)

    async def abort() -> int:
        request = rollout_pb2.AbortRequest(request_ids=[task.prompt_id])
        return (await stack.engine.stub.Abort(request, timeout=5)).aborted

    await stack.roll_out(task, abort)
    for t in await stack.trajectories():
        assert t.finish_reason == ABORT and t.metadata["resumes"] == "0"
        assert 0 < len(t.response_token_ids) < MAX_NEW, "the tokens made before the abort"
        assert set(t.policy_versions) == {0}
        _check_logprobs(t, {0: stack.model_v0}, list(task.prompt_token_ids))
