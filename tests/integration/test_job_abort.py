"""A job that ended has its requests dropped on every engine at once: the router's AbortJob (what
the controller calls when a job is cancelled, services/controller/driver.py) calls each engine's
Rollout.AbortJob concurrently. Two real torch engines with long generations of the job in flight,
a real router and a real Redis; the next job's weights load and its request is served without
waiting for the cancelled generations, which would take minutes."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest

from services.common.bus import Bus
from services.common.pb import common_pb2, rollout_pb2, router_pb2_grpc
from tests.helpers import eventually
from tests.integration.rollout_helpers import (
    RunningEngine,
    generate_request,
    publish_checkpoint,
    save_checkpoint,
    serve_router,
    start_engine,
    start_job,
    tiny_llama,
)

CANCELLED_JOB, NEXT_JOB = "job-cancelled", "job-next"
LONG = 30_000
"""Tokens each cancelled generation asks for: minutes of decoding here; the bounds are seconds."""
BOUND_S = 10.0
"""How soon after the abort both engines must be idle."""

pytestmark = pytest.mark.usefixtures("one_torch_thread")


async def _statuses(engines: list[RunningEngine]) -> list[common_pb2.EngineInfo]:
    request = rollout_pb2.GetEngineStatusRequest()
    return [await engine.stub.GetStatus(request, timeout=5) for engine in engines]


def _request(job_id: str, name: str, max_new_tokens: int) -> rollout_pb2.GenerateRequest:
    request = generate_request(
        [1, 5, 6], request_id=name, session_id=name, max_new_tokens=max_new_tokens, ignore_eos=True
    )
    request.job_id = job_id
    return request


async def test_a_cancelled_jobs_requests_end_on_every_engine_and_the_next_job_is_served(
    bus: Bus, redis_url: str, tmp_path: Path
) -> None:
    await start_job(bus.redis, CANCELLED_JOB)
    model = tiny_llama(0, max_positions=LONG + 16)
    await publish_checkpoint(bus, CANCELLED_JOB, save_checkpoint(model, tmp_path / "cancelled"), 0)
    engines = [await start_engine(redis_url, engine_id=f"engine-{i}") for i in range(2)]
    router = await serve_router(redis_url)
    channel = grpc.aio.insecure_channel(router.address)
    stub = router_pb2_grpc.RouterStub(channel)
    try:
        for engine in engines:
            await engine.wait_for_version(0)

        async def both_seen() -> bool:  # serving the job: the router spreads its requests over both
            view = router.router.pool.view().values()
            return len(view) == 2 and all(info.job_id == CANCELLED_JOB for info in view)

        await eventually(both_seen, what="the router to see both engines serve the job")
        calls = [
            asyncio.ensure_future(stub.Generate(_request(CANCELLED_JOB, f"long-{i}", LONG), timeout=300))
            for i in range(2)
        ]

        async def both_running() -> bool:
            return all(status.running_requests == 1 for status in await _statuses(engines))

        await eventually(both_running, what="a long generation running on each engine")

        aborted_at = time.monotonic()
        reply = await stub.AbortJob(rollout_pb2.AbortJobRequest(job_id=CANCELLED_JOB), timeout=5)
        assert reply.aborted == 2 and not reply.failed_engine_ids
        assert sorted(reply.engine_ids) == [engine.engine_id for engine in engines]

        async def both_idle() -> bool:
            states = await _statuses(engines)
            return all(s.running_requests == 0 and s.queued_requests == 0 for s in states)

        await eventually(both_idle, what="both engines idle", timeout_s=BOUND_S)
        for call in calls:
            completion = (await asyncio.wait_for(call, BOUND_S)).completions[0]
            assert completion.finish_reason == common_pb2.FINISH_REASON_ABORT
            assert 0 < len(completion.token_ids) < LONG
        with pytest.raises(grpc.aio.AioRpcError) as refused:  # its runners' late requests
            await stub.Generate(_request(CANCELLED_JOB, "late", 4), timeout=10)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION

        await start_job(bus.redis, NEXT_JOB)  # the newest running job: the engines move to it
        await publish_checkpoint(bus, NEXT_JOB, save_checkpoint(tiny_llama(1), tmp_path / "next"), 0)

        async def both_moved() -> bool:
            return all(s.job_id == NEXT_JOB for s in await _statuses(engines))

        await eventually(both_moved, what="both engines to load the next job", timeout_s=BOUND_S)
        served = await stub.Generate(_request(NEXT_JOB, "next", 8), timeout=30)
        assert len(served.completions[0].token_ids) == 8
        assert time.monotonic() - aborted_at < 3 * BOUND_S, "the next job waited"
    finally:
        await channel.close()
        await router.stop()
        for engine in engines:
            await engine.stop()
