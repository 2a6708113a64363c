"""The router over real engines, a real registry in Redis and real gRPC: balancing,
session affinity, retries when an engine dies, drains, deadlines and "no live engines"."""

from __future__ import annotations

import asyncio
import signal
import subprocess
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from services.common.bus import Bus, connect
from services.common.engine_registry import EngineRegistry
from services.common.pb import common_pb2, rollout_pb2, router_pb2, router_pb2_grpc
from services.common.redis_server import free_port
from services.router.config import RouterSettings
from services.router.server import Router
from tests.helpers import eventually, serve
from tests.integration.rollout_helpers import (
    RunningEngine,
    generate_request,
    handle_for,
    publish_checkpoint,
    save_checkpoint,
    start_engine,
    start_job,
    tiny_llama,
)

JOB = "job-router"
PROMPT = [1, 5, 6, 7]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@dataclass
class RunningRouter:
    router: Router
    server: grpc.aio.Server
    channel: grpc.aio.Channel
    stub: router_pb2_grpc.RouterStub
    stop_event: asyncio.Event
    background: asyncio.Task[None]

    async def generate(
        self, session_id: str = "", timeout: float = 30, job_id: str = "", **sampling: object
    ) -> str:
        """Generate through the router; returns the engine that served it."""
        request = generate_request(PROMPT, session_id=session_id, **sampling)
        request.job_id = job_id
        response = await self.stub.Generate(request, timeout=timeout)
        return response.engine_id

    async def engines(self, include_draining: bool = False) -> list[common_pb2.EngineInfo]:
        request = router_pb2.ListEnginesRequest(include_draining=include_draining)
        return list((await self.stub.ListEngines(request, timeout=5)).engines)

    async def stop(self) -> None:
        self.stop_event.set()
        await self.background
        await self.server.stop(None)
        await self.channel.close()
        await self.router.close()
        await self.router.registry.redis.aclose()


async def start_router(redis_url: str) -> RunningRouter:
    port = free_port()
    settings = RouterSettings(
        port=port, redis_url=redis_url, engine_ttl_s=1.0, refresh_s=0.1, max_attempts=3, default_timeout_s=20
    )
    redis = connect(redis_url)  # its own client, as in its own process
    router = Router(settings, EngineRegistry(redis))
    server, address = await serve(router.register, port)
    stop = asyncio.Event()
    channel = grpc.aio.insecure_channel(address)
    return RunningRouter(
        router,
        server,
        channel,
        router_pb2_grpc.RouterStub(channel),
        stop,
        asyncio.create_task(router.run(stop)),
    )


@pytest.fixture
async def checkpoint(bus: Bus, tmp_path: Path) -> Path:
    await start_job(bus.redis, JOB)
    path = save_checkpoint(tiny_llama(0), tmp_path / "v000000")
    await publish_checkpoint(bus, JOB, path, 0)
    return path


@pytest.fixture
async def engines(bus: Bus, redis_url: str, checkpoint: Path) -> AsyncIterator[list[RunningEngine]]:
    running = [
        await start_engine(redis_url, engine_id=name, heartbeat_s=0.1) for name in ("engine-a", "engine-b")
    ]
    try:
        for engine in running:
            await engine.wait_for_version(0)
        yield running
    finally:
        for engine in running:
            await engine.stop()


@pytest.fixture
async def router(redis_url: str) -> AsyncIterator[RunningRouter]:
    running = await start_router(redis_url)
    try:
        yield running
    finally:
        await running.stop()


async def wait_for_engines(router: RunningRouter, expected: set[str]) -> None:
    async def listed() -> bool:
        infos = await router.engines()
        ready = {i.engine_id for i in infos if i.state == common_pb2.ENGINE_STATE_SERVING}
        # The pool's own view too: it refreshes on its own clock, and picks by what it last read.
        pooled = router.router.pool.view()
        serving = {e for e, info in pooled.items() if info.state == common_pb2.ENGINE_STATE_SERVING}
        return ready == expected and set(pooled) == expected and serving == expected

    await eventually(listed, what=f"the router to see {sorted(expected)}")


async def test_no_live_engines(router: RunningRouter) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await router.generate()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no live engines" in (err.value.details() or "")


async def test_engine_without_weights_is_reported(bus: Bus, redis_url: str, router: RunningRouter) -> None:
    empty = await start_engine(redis_url, engine_id="engine-empty", heartbeat_s=0.1)
    try:
        await eventually(router.engines, what="the empty engine to register")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await router.generate()
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "engine-empty" in (err.value.details() or "") and "no weights loaded" in (
            err.value.details() or ""
        )
    finally:
        await empty.stop()


async def test_balances_and_keeps_sessions_together(
    engines: list[RunningEngine], router: RunningRouter
) -> None:
    await wait_for_engines(router, {"engine-a", "engine-b"})
    sequential = Counter([await router.generate() for _ in range(8)])
    assert sequential == {"engine-a": 4, "engine-b": 4}
    concurrent = Counter(await asyncio.gather(*(router.generate(max_new_tokens=20) for _ in range(16))))
    assert set(concurrent) == {"engine-a", "engine-b"} and min(concurrent.values()) >= 4

    for session in ("group-1", "group-2", "group-3"):
        served = [await router.generate(session_id=session)]
        served += await asyncio.gather(*(router.generate(session_id=session) for _ in range(4)))
        served += await asyncio.gather(*(router.generate() for _ in range(2)))  # other load in between
        served.append(await router.generate(session_id=session))
        assert len(set(served[:5]) | {served[-1]}) == 1, served


async def test_retries_on_another_engine_when_one_dies(
    engines: list[RunningEngine], router: RunningRouter
) -> None:
    await wait_for_engines(router, {"engine-a", "engine-b"})
    sessions = [f"group-{i}" for i in range(6)]
    home = {s: await router.generate(session_id=s) for s in sessions}
    assert set(home.values()) == {"engine-a", "engine-b"}
    victim, survivor = engines
    await victim.crash()  # its registry entry lingers until the ttl passes
    served = {s: await router.generate(session_id=s) for s in sessions}
    assert set(served.values()) == {"engine-b"}
    assert router.router.pool.engine_ids() == ["engine-b"]

    async def expired() -> bool:
        return [i.engine_id for i in await router.engines()] == ["engine-b"]

    await eventually(expired, timeout_s=5, what="engine-a's heartbeat to expire")
    await survivor.stop()  # leaves the registry: nothing is left
    await eventually(lambda: _no_engines(router), timeout_s=5, what="engine-b to leave")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await router.generate()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "no live engines" in (
        err.value.details() or ""
    )


async def _no_engines(router: RunningRouter) -> bool:
    return not await router.engines() and not router.router.pool.engine_ids()


async def test_drain_stops_routing(engines: list[RunningEngine], router: RunningRouter) -> None:
    await wait_for_engines(router, {"engine-a", "engine-b"})
    drained = await router.stub.DrainEngine(
        router_pb2.DrainEngineRequest(engine_id="engine-a", drain=True), timeout=5
    )
    assert drained.engine.state == common_pb2.ENGINE_STATE_DRAINING
    assert {await router.generate() for _ in range(6)} == {"engine-b"}
    assert [i.engine_id for i in await router.engines()] == ["engine-b"]
    listed = {i.engine_id: i.state for i in await router.engines(include_draining=True)}
    assert listed == {
        "engine-a": common_pb2.ENGINE_STATE_DRAINING,
        "engine-b": common_pb2.ENGINE_STATE_SERVING,
    }
    await router.stub.DrainEngine(router_pb2.DrainEngineRequest(engine_id="engine-a", drain=False), timeout=5)
    assert {await router.generate() for _ in range(6)} == {"engine-a", "engine-b"}
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await router.stub.DrainEngine(router_pb2.DrainEngineRequest(engine_id="nope", drain=True), timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_deadline_and_errors_pass_through(engines: list[RunningEngine], router: RunningRouter) -> None:
    await wait_for_engines(router, {"engine-a", "engine-b"})
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await router.generate(max_new_tokens=0)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_new_tokens" in (
        err.value.details() or ""
    )

    for engine in engines:
        await engine.stub.Pause(rollout_pb2.PauseRequest(), timeout=5)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await router.generate(timeout=0.5)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    async def engines_idle() -> bool:  # the engine saw the deadline too and dropped the request
        statuses = [await e.stub.GetStatus(rollout_pb2.GetEngineStatusRequest(), timeout=5) for e in engines]
        return all(s.queued_requests == 0 for s in statuses)

    await eventually(engines_idle, timeout_s=5, what="the expired request to leave the engine")
    for engine in engines:
        await engine.stub.Resume(rollout_pb2.ResumeRequest(), timeout=5)

    chunks = [
        chunk
        async for chunk in router.stub.GenerateStream(
            generate_request(PROMPT, n=3, temperature=1.0, ignore_eos=True), timeout=30
        )
    ]
    finished = [c for c in chunks if c.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED]
    assert sorted(c.index for c in finished) == [0, 1, 2]
    assert all(c.finish_reason == common_pb2.FINISH_REASON_LENGTH for c in finished)
    for index in range(3):  # the increments of each sample add up to all its tokens
        assert sum(len(c.token_ids) for c in chunks if c.index == index) == 8


async def test_requests_go_to_engines_serving_their_job(
    bus: Bus, redis_url: str, checkpoint: Path, router: RunningRouter
) -> None:
    steady = await start_engine(redis_url, engine_id="engine-a", heartbeat_s=0.1)
    # engine-b looks for the running job only once a minute, so it keeps what it is told to load
    other = await start_engine(redis_url, engine_id="engine-b", heartbeat_s=0.1, weight_poll_s=60)
    try:
        await steady.wait_for_version(0)
        await other.wait_for_version(0)
        handle = handle_for("job-other", checkpoint, 0)
        await other.stub.LoadWeights(rollout_pb2.LoadWeightsRequest(handle=handle), timeout=30)

        async def jobs_seen() -> bool:
            jobs = {info.engine_id: info.job_id for info in await router.engines()}
            links = {engine_id: info.job_id for engine_id, info in router.router.pool.view().items()}
            expected = {"engine-a": JOB, "engine-b": "job-other"}
            return jobs == expected and links == expected

        await eventually(jobs_seen, what="the router to see both jobs")
        assert {await router.generate(job_id=JOB) for _ in range(4)} == {"engine-a"}
        assert {await router.generate(job_id="job-other") for _ in range(4)} == {"engine-b"}
        assert {await router.generate() for _ in range(4)} == {"engine-a", "engine-b"}
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await router.generate(job_id="job-nobody-serves")
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "not 'job-nobody-serves'" in (err.value.details() or "")
    finally:
        await steady.stop()
        await other.stop()


async def test_a_killed_engine_process_is_routed_around(
    bus: Bus,
    redis_url: str,
    checkpoint: Path,
    router: RunningRouter,
    python: str,
    python_env: dict[str, str],
) -> None:
    """`python -m services.rollout` for real: it loads v0 from Redis, serves through the
    router, and after SIGKILL its sessions move to the other engine."""
    port = free_port()
    env = {
        **python_env,
        "REDIS_URL": redis_url,
        "VERST_ENGINE_PORT": str(port),
        "VERST_ENGINE_ENGINE_ID": "engine-proc",
        "VERST_ENGINE_DEVICE": "cpu",
        "VERST_ENGINE_TORCH_THREADS": "1",
        "VERST_ENGINE_HEARTBEAT_S": "0.1",
    }
    proc = subprocess.Popen(
        [python, "-m", "services.rollout"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    local = await start_engine(redis_url, engine_id="engine-local", heartbeat_s=0.1)
    try:
        await local.wait_for_version(0)
        await wait_for_engines(router, {"engine-proc", "engine-local"})
        await router.stub.DrainEngine(
            router_pb2.DrainEngineRequest(engine_id="engine-local", drain=True), timeout=5
        )
        assert await router.generate(session_id="group-p") == "engine-proc"
        await router.stub.DrainEngine(
            router_pb2.DrainEngineRequest(engine_id="engine-local", drain=False), timeout=5
        )
        assert await router.generate(session_id="group-p") == "engine-proc"  # affinity
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        assert await router.generate(session_id="group-p") == "engine-local"
        assert router.router.pool.engine_ids() == ["engine-local"]
    finally:
        if proc.poll() is None:
            proc.kill()
        output, _ = proc.communicate(timeout=10)
        await local.stop()
    assert "serving job-router v0" in output, output
