"""The Rollout servicer's GenerateBatch: the batch reaches the engine together, and each request
gets its own result, or the status Generate would have aborted with, never failing the others."""

from __future__ import annotations

import asyncio

import grpc

from services.common.pb import common_pb2, rollout_pb2
from services.rollout.engine_protocol import (
    Completion,
    EngineUnavailableError,
    GenerationRequest,
    WrongJobError,
    check_job,
)
from services.rollout.metrics import EngineMetrics
from services.rollout.servicer import EngineInfoSource, RolloutServicer
from services.rollout.watcher import WeightLoader
from tests.helpers import FakeContext
from tests.unit.test_engine_protocol import VersionedEngine

FAILS_LATER = 99
"""A prompt starting with this token fails in the backend (on_error: unreachable)."""
HANGS = 98
"""A prompt starting with this token never finishes."""


class SteppingEngine(VersionedEngine):
    """Serves "job" at version 1. A submit queues the request; one step, scheduled by the first
    submit after the last step, finishes every queued request (n samples echoing the prompt),
    as a batching engine's step would."""

    def __init__(self) -> None:
        super().__init__()
        self.queued: list[GenerationRequest] = []
        self.steps: list[list[str]] = []
        """The request ids each step saw."""

    def submit(self, request: GenerationRequest) -> None:
        check_job(request, "job")
        if not self.queued:
            asyncio.get_running_loop().call_soon(self._step)
        self.queued.append(request)

    def _step(self) -> None:
        batch, self.queued = self.queued, []
        self.steps.append([request.request_id for request in batch])
        for request in batch:
            first = request.prompt[0]
            if first == HANGS:
                continue
            if first == FAILS_LATER:
                assert request.on_error is not None
                request.on_error(EngineUnavailableError("backend unreachable"))
                continue
            for index in range(request.config.n):
                tokens = [*request.prompt, index]
                request.on_completion(
                    Completion(
                        index, tokens, [-0.5] * len(tokens), [1] * len(tokens), common_pb2.FINISH_REASON_STOP
                    )
                )


def servicer_over(engine: SteppingEngine, *, version_wait_s: float = 5.0) -> RolloutServicer:
    info = EngineInfoSource(engine, "engine-1", "node:1")
    return RolloutServicer(
        engine, WeightLoader(engine, 5.0), info, EngineMetrics(engine.status), version_wait_s=version_wait_s
    )


def request(request_id: str, prompt: list[int], **fields: object) -> rollout_pb2.GenerateRequest:
    return rollout_pb2.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(max_new_tokens=4, n=2),
        **fields,  # type: ignore[arg-type]
    )


async def test_the_requests_reach_the_engine_together_and_each_gets_its_own_result() -> None:
    engine = SteppingEngine()
    servicer = servicer_over(engine)
    bad = request("bad", [1])
    bad.sampling.max_new_tokens = 0
    batch = rollout_pb2.GenerateBatchRequest(
        requests=[
            request("a", [1, 2]),
            bad,
            request("other-job", [3], job_id="other"),
            request("b", [4, 5, 6], job_id="job"),
            request("unreachable", [FAILS_LATER]),
        ]
    )
    reply = await servicer.GenerateBatch(batch, FakeContext())

    assert engine.steps == [["a", "b", "unreachable"]], "one step saw every request submitted"
    ok, invalid, precondition, unavailable = (
        code.value[0]
        for code in (
            grpc.StatusCode.OK,
            grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.FAILED_PRECONDITION,
            grpc.StatusCode.UNAVAILABLE,
        )
    )
    assert [result.code for result in reply.results] == [ok, invalid, precondition, ok, unavailable]
    assert "max_new_tokens" in reply.results[1].details
    assert reply.results[2].details == str(WrongJobError("engine serves job 'job', not 'other'"))
    assert reply.results[4].details == "backend unreachable"
    for result, prompt in ((reply.results[0], [1, 2]), (reply.results[3], [4, 5, 6])):
        response = result.response
        assert response.engine_id == "engine-1" and response.request_id in ("a", "b")
        assert [list(c.token_ids) for c in response.completions] == [[*prompt, 0], [*prompt, 1]]
        assert response.stats.prompt_tokens == len(prompt) and response.stats.completion_tokens == 2 * (
            len(prompt) + 1
        )
    assert not reply.results[1].HasField("response")


async def test_a_request_waiting_for_a_newer_version_fails_alone() -> None:
    engine = SteppingEngine()
    servicer = servicer_over(engine, version_wait_s=0.05)
    batch = rollout_pb2.GenerateBatchRequest(
        requests=[
            request("now", [1], job_id="job", min_policy_version=1),
            request("later", [2], job_id="job", min_policy_version=4),
        ]
    )
    reply = await servicer.GenerateBatch(batch, FakeContext())
    assert [r.code for r in reply.results] == [0, grpc.StatusCode.FAILED_PRECONDITION.value[0]]
    assert "needs job v4" in reply.results[1].details
    assert engine.steps == [["now"]]


async def test_a_batch_whose_caller_leaves_cancels_its_requests_in_the_engine() -> None:
    engine = SteppingEngine()
    servicer = servicer_over(engine)
    batch = rollout_pb2.GenerateBatchRequest(requests=[request("a", [HANGS]), request("b", [HANGS, 1])])
    call = asyncio.create_task(servicer.GenerateBatch(batch, FakeContext()))
    while not engine.steps:
        await asyncio.sleep(0.01)
    call.cancel()
    await asyncio.gather(call, return_exceptions=True)
    assert sorted(request.request_id for request in engine.cancelled) == ["a", "b"]
