"""Test doubles of the router and the reward service, and a running job to feed the runner.

FakeRouter and FakeReward implement the proto contracts deterministically: the "engine" answers
the addition prompt correctly for even sample indices (and, when greedy, for the problems
``correct_at_version`` says it knows), with logprobs and policy versions the tests can check.
CountingReward is verst's real reward servicer, recording the job of every item it scores (the
reward swap tests: a job that names another server must never reach it).
Their fixtures are imported by the test modules that use them (runner, controller, reward swap).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from services.common.bus import Bus
from services.common.config import JobSpec
from services.common.jobs import RUNNING, JobStore
from services.common.pb import (
    common_pb2,
    reward_pb2,
    reward_pb2_grpc,
    rollout_pb2,
    router_pb2,
    router_pb2_grpc,
)
from services.common.streams import JobStreams
from services.data import encode_prompt
from services.reward.config import RewardSettings
from services.reward.server import RewardServicer
from services.runner.config import RunnerSettings
from services.runner.server import GROUP, Runner
from tests.helpers import serve, stream_messages

ENGINE_ID = "fake-engine-1"
EOS = 2


def logprob(index: int, position: int) -> float:
    return -0.25 * (index + 1) - 0.01 * position


class FakeRouter(router_pb2_grpc.RouterServicer):
    """A router with one engine that serves ``version`` of ``job_id``."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.job_id = ""
        self.version = 0
        self.requests: list[rollout_pb2.GenerateRequest] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.delay_s = 0.0
        self.refusal = ""
        """When set, every Generate is refused with it (INVALID_ARGUMENT), as for a "bad" prompt."""
        self.correct_at_version: Callable[[int, int, int], bool] = lambda a, b, version: False
        self.aborted_jobs: list[str] = []
        """The job of every AbortJob, in order."""

    def answer(self, text: str, index: int, greedy: bool) -> str:
        a, b = (int(x) for x in text.rstrip("=").split("+"))
        right = self.correct_at_version(a, b, self.version) if greedy else index % 2 == 0
        return str(a + b)[::-1] if right else "0"

    async def Generate(
        self, request: rollout_pb2.GenerateRequest, context: Any
    ) -> rollout_pb2.GenerateResponse:
        self.requests.append(request)
        text = self.tokenizer.decode(list(request.prompt_token_ids), skip_special_tokens=True)
        if text.startswith("bad") or self.refusal:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, self.refusal or "prompt tokens out of vocabulary"
            )
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.in_flight -= 1
        completions = []
        for index in range(request.sampling.n or 1):
            ids = [
                *self.tokenizer(self.answer(text, index, request.sampling.temperature == 0))["input_ids"],
                EOS,
            ]
            completions.append(
                rollout_pb2.Completion(
                    index=index,
                    token_ids=ids,
                    logprobs=[logprob(index, p) for p in range(len(ids))],
                    policy_versions=[self.version] * len(ids),
                    finish_reason=common_pb2.FINISH_REASON_STOP,
                )
            )
        return rollout_pb2.GenerateResponse(
            request_id=request.request_id, completions=completions[::-1], engine_id=ENGINE_ID
        )

    async def AbortJob(
        self, request: rollout_pb2.AbortJobRequest, context: Any
    ) -> router_pb2.AbortJobEverywhereResponse:
        self.aborted_jobs.append(request.job_id)
        return router_pb2.AbortJobEverywhereResponse(engine_ids=[ENGINE_ID])

    async def ListEngines(
        self, request: router_pb2.ListEnginesRequest, context: Any
    ) -> router_pb2.ListEnginesResponse:
        engine = common_pb2.EngineInfo(
            engine_id=ENGINE_ID,
            job_id=self.job_id,
            policy_version=self.version,
            state=common_pb2.ENGINE_STATE_SERVING,
        )
        return router_pb2.ListEnginesResponse(engines=[engine])


class FakeReward(reward_pb2_grpc.RewardServicer):
    """Reward 1 iff the stripped response equals the answer; ``gate`` can hold every call."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.gate.set()
        self.batches: list[reward_pb2.ScoreBatchRequest] = []

    async def ScoreBatch(
        self, request: reward_pb2.ScoreBatchRequest, context: Any
    ) -> reward_pb2.ScoreBatchResponse:
        await self.gate.wait()
        self.batches.append(request)
        results = []
        for item in request.items:
            correct = float(item.response_text.strip() == item.answer)
            results.append(reward_pb2.ScoreResponse(reward=correct, components={"correct": correct}))
        return reward_pb2.ScoreBatchResponse(results=results)


class CountingReward(RewardServicer):
    """verst's reward servicer, recording the job of every item it scores."""

    def __init__(self) -> None:
        super().__init__(RewardSettings(port=0, tools_enabled=False))
        self.jobs: list[str] = []

    async def Score(self, request: reward_pb2.ScoreRequest, context: Any) -> Any:
        self.jobs.append(request.job_id)
        return await super().Score(request, context)

    async def ScoreBatch(self, request: reward_pb2.ScoreBatchRequest, context: Any) -> Any:
        self.jobs.extend(item.job_id for item in request.items)
        return await super().ScoreBatch(request, context)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint-like directory holding the builtin character tokenizer."""
    from services.tasks.addition_model import build_char_tokenizer

    directory = tmp_path_factory.mktemp("checkpoint-v0")
    build_char_tokenizer().save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture
async def router(tokenizer: Any) -> AsyncIterator[tuple[FakeRouter, str]]:
    fake = FakeRouter(tokenizer)
    server, address = await serve(lambda s: router_pb2_grpc.add_RouterServicer_to_server(fake, s))
    yield fake, address
    await server.stop(None)


@pytest.fixture
async def reward() -> AsyncIterator[tuple[FakeReward, str]]:
    fake = FakeReward()
    server, address = await serve(lambda s: reward_pb2_grpc.add_RewardServicer_to_server(fake, s))
    yield fake, address
    await server.stop(None)


@pytest.fixture
async def builtin_reward() -> AsyncIterator[tuple[CountingReward, str]]:
    """verst's reward servicer (a CountingReward) on a loopback port, and its address."""
    servicer = CountingReward()
    server, address = await serve(lambda s: reward_pb2_grpc.add_RewardServicer_to_server(servicer, s))
    yield servicer, address
    await server.stop(None)


def checkpoint(job_id: str, version: int, directory: Path) -> common_pb2.CheckpointHandle:
    return common_pb2.CheckpointHandle(
        job_id=job_id, version=version, uri=directory.as_uri(), format="safetensors", step=version
    )


async def trajectories(bus: Bus, job_id: str) -> list[common_pb2.Trajectory]:
    return await stream_messages(bus, JobStreams(job_id).trajectories, common_pb2.Trajectory)


class RunningJob:
    """A RUNNING job with checkpoint v0, and helpers to feed it tasks."""

    def __init__(self, bus: Bus, store: JobStore, job_id: str, spec: JobSpec, tokenizer: Any) -> None:
        self.bus, self.store, self.job_id, self.spec, self.tokenizer = bus, store, job_id, spec, tokenizer
        self.streams = JobStreams(job_id)

    def task(self, index: int, text: str, answer: str) -> common_pb2.PromptTask:
        prompt_id = f"{self.job_id}:0:{index}"
        return common_pb2.PromptTask(
            prompt_id=prompt_id,
            job_id=self.job_id,
            group_id=prompt_id,
            prompt_token_ids=encode_prompt(self.tokenizer, text),
            prompt_text=text,
            n_samples=self.spec.algorithm.group_size,
            sampling=common_pb2.SamplingParams(
                temperature=1.0, max_new_tokens=8, n=self.spec.algorithm.group_size
            ),
            answer=answer,
            verifier=self.spec.reward.scorer,  # as the controller's feed sets it
            split=common_pb2.SPLIT_TRAIN,
            policy_version=0,
        )

    async def pending(self) -> int:
        return await self.bus.pending_count(self.streams.prompts, GROUP)


async def running_job(bus: Bus, store: JobStore, tokenizer: Any, directory: Path, **spec: Any) -> RunningJob:
    job_spec = JobSpec.model_validate({"algorithm": {"group_size": 4}, **spec})
    job_id = (await store.create(job_spec)).job_id
    await store.set_state(job_id, RUNNING)
    await bus.publish(JobStreams(job_id).checkpoints, checkpoint(job_id, 0, directory))
    return RunningJob(bus, store, job_id, job_spec, tokenizer)


@pytest.fixture
async def runner_for(bus: Bus) -> AsyncIterator[Callable[..., Awaitable[Runner]]]:
    """Starts a Runner in the background with the given settings; stops it at the end."""
    stop = asyncio.Event()
    tasks: list[asyncio.Task[None]] = []

    async def start(**settings: Any) -> Runner:
        runner = Runner(bus, JobStore(bus.redis), RunnerSettings(**{"jobs_refresh_s": 0.05, **settings}))
        tasks.append(asyncio.create_task(runner.run(stop)))
        return runner

    yield start
    stop.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
