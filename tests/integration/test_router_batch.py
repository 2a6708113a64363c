"""The router's GenerateBatch over fake engines on real gRPC: one GenerateBatch per engine's
share, engines picked as Generate picks them, shares to a dead engine and requests an engine
cannot serve yet retried elsewhere, other failures passed through in their own result."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from services.common.pb import common_pb2, rollout_pb2, rollout_pb2_grpc, router_pb2_grpc
from services.router.config import RouterSettings
from services.router.server import Router
from tests.helpers import eventually, serve

OK = grpc.StatusCode.OK.value[0]


class FakeEngine(rollout_pb2_grpc.RolloutServicer):
    """Answers each request with one token per sample; ``refuse`` maps request ids to the
    status it fails them with. ``batches`` is False for an engine without GenerateBatch."""

    def __init__(self, engine_id: str, *, batches: bool = True) -> None:
        self.engine_id = engine_id
        self.batches = batches
        self.refuse: dict[str, grpc.StatusCode] = {}
        self.gate = asyncio.Event()
        self.gate.set()
        """Held (cleared): every GenerateBatch waits for it."""
        self.calls: list[list[str]] = []
        """The request ids of each GenerateBatch (or Generate) call it got."""

    def answer(self, request: rollout_pb2.GenerateRequest) -> rollout_pb2.GenerateResult:
        code = self.refuse.get(request.request_id)
        if code is not None:
            return rollout_pb2.GenerateResult(code=code.value[0], details=f"{self.engine_id} refuses")
        completions = [
            rollout_pb2.Completion(index=i, token_ids=[i], logprobs=[-1.0], policy_versions=[0])
            for i in range(request.sampling.n or 1)
        ]
        return rollout_pb2.GenerateResult(
            response=rollout_pb2.GenerateResponse(
                request_id=request.request_id, completions=completions, engine_id=self.engine_id
            )
        )

    async def Generate(
        self, request: rollout_pb2.GenerateRequest, context: Any
    ) -> rollout_pb2.GenerateResponse:
        self.calls.append([request.request_id])
        result = self.answer(request)
        if result.code:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, result.details)
        return result.response

    async def GenerateBatch(
        self, request: rollout_pb2.GenerateBatchRequest, context: Any
    ) -> rollout_pb2.GenerateBatchResponse:
        if not self.batches:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")
        self.calls.append([r.request_id for r in request.requests])
        await self.gate.wait()
        return rollout_pb2.GenerateBatchResponse(results=[self.answer(r) for r in request.requests])


class FakeRegistry:
    """The engine registry's ``alive``: every engine listed, with a fresh heartbeat."""

    def __init__(self) -> None:
        self.engines: dict[str, str] = {}

    async def alive(self, ttl_s: float) -> list[common_pb2.EngineInfo]:
        infos = []
        for engine_id, address in self.engines.items():
            info = common_pb2.EngineInfo(
                engine_id=engine_id, address=address, job_id="job", state=common_pb2.ENGINE_STATE_SERVING
            )
            info.last_heartbeat.FromNanoseconds(time.time_ns())
            infos.append(info)
        return infos


@dataclass
class Setup:
    router: Router
    stub: router_pb2_grpc.RouterStub
    registry: FakeRegistry
    engines: dict[str, FakeEngine] = field(default_factory=dict)
    servers: dict[str, grpc.aio.Server] = field(default_factory=dict)

    async def add_engine(self, engine: FakeEngine) -> None:
        server, address = await serve(lambda s: rollout_pb2_grpc.add_RolloutServicer_to_server(engine, s))
        self.engines[engine.engine_id], self.servers[engine.engine_id] = engine, server
        self.registry.engines[engine.engine_id] = address
        await self.router.pool.refresh()

    async def batch(self, *requests: rollout_pb2.GenerateRequest) -> list[rollout_pb2.GenerateResult]:
        reply = await self.stub.GenerateBatch(rollout_pb2.GenerateBatchRequest(requests=requests), timeout=10)
        return list(reply.results)


@pytest.fixture
async def setup() -> AsyncIterator[Setup]:
    registry = FakeRegistry()
    settings = RouterSettings(port=0, redis_url="redis://unused:6379", max_attempts=3, default_timeout_s=10)
    router = Router(settings, registry)  # type: ignore[arg-type]
    server, address = await serve(router.register)
    channel = grpc.aio.insecure_channel(address)
    ready = Setup(router, router_pb2_grpc.RouterStub(channel), registry)
    yield ready
    await channel.close()
    await server.stop(None)
    for engine_server in ready.servers.values():
        await engine_server.stop(None)
    await router.close()


def request(request_id: str, session_id: str = "", n: int = 2) -> rollout_pb2.GenerateRequest:
    return rollout_pb2.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=[1, 2],
        session_id=session_id,
        job_id="job",
        sampling=common_pb2.SamplingParams(max_new_tokens=1, n=n),
    )


def served_by(results: list[rollout_pb2.GenerateResult]) -> list[str]:
    return [result.response.engine_id if result.code == OK else "" for result in results]


async def test_each_engine_gets_its_share_as_one_call_and_results_keep_their_order(setup: Setup) -> None:
    await setup.add_engine(FakeEngine("engine-a"))
    await setup.add_engine(FakeEngine("engine-b"))
    results = await setup.batch(*(request(f"r{i}") for i in range(6)))
    assert [r.response.request_id for r in results] == [f"r{i}" for i in range(6)]
    assert sorted(served_by(results)) == ["engine-a"] * 3 + ["engine-b"] * 3, "the fewest samples in flight"
    assert [len(call) for engine in setup.engines.values() for call in engine.calls] == [3, 3]
    assert all(len(r.response.completions) == 2 for r in results)

    # a session stays where it was served; drained engines get nothing
    first = served_by(await setup.batch(request("s0", session_id="group-1")))[0]
    again = await setup.batch(*(request(f"s{i}", session_id="group-1") for i in range(1, 4)))
    assert set(served_by(again)) == {first}
    setup.router.pool.set_drained(first, True)
    other = ({"engine-a", "engine-b"} - {first}).pop()
    assert set(served_by(await setup.batch(*(request(f"d{i}", session_id="group-1") for i in range(4))))) == {
        other
    }
    assert all(link.outstanding == 0 for link in setup.router.pool._links.values()), "every load released"


async def test_a_share_sent_to_a_dead_engine_is_retried_on_another(setup: Setup) -> None:
    await setup.add_engine(FakeEngine("engine-a"))
    await setup.add_engine(FakeEngine("engine-b"))
    await setup.servers["engine-a"].stop(None)  # still in the registry: the router learns it by calling
    results = await setup.batch(*(request(f"r{i}") for i in range(4)))
    assert served_by(results) == ["engine-b"] * 4
    assert setup.router.pool.engine_ids() == ["engine-b"], "the dead engine left the view"


async def test_a_failed_share_is_retried_without_waiting_for_the_other_shares(setup: Setup) -> None:
    for name in ("engine-a", "engine-b", "engine-c"):
        await setup.add_engine(FakeEngine(name))
    await setup.servers["engine-a"].stop(None)
    setup.engines["engine-b"].gate.clear()
    # r1 (8 samples) keeps engine-b the busiest, so r0's retry goes to engine-c
    call = asyncio.create_task(setup.batch(request("r0"), request("r1", n=8), request("r2", n=1)))

    async def retried_on_c() -> bool:
        return len(setup.engines["engine-c"].calls) == 2

    await eventually(retried_on_c, timeout_s=5, what="r0 retried on engine-c while engine-b still works")
    assert sorted(setup.engines["engine-c"].calls) == [["r0"], ["r2"]] and not call.done()
    setup.engines["engine-b"].gate.set()
    assert served_by(await call) == ["engine-c", "engine-b", "engine-c"]


async def test_a_request_an_engine_cannot_serve_yet_is_retried_and_bad_input_is_passed_through(
    setup: Setup,
) -> None:
    await setup.add_engine(FakeEngine("engine-a"))
    await setup.add_engine(FakeEngine("engine-b"))
    for engine in setup.engines.values():
        engine.refuse["bad"] = grpc.StatusCode.INVALID_ARGUMENT
    setup.engines["engine-a"].refuse["r0"] = grpc.StatusCode.FAILED_PRECONDITION
    setup.engines["engine-b"].refuse["r1"] = grpc.StatusCode.FAILED_PRECONDITION
    setup.engines["engine-b"].refuse["nowhere"] = grpc.StatusCode.FAILED_PRECONDITION
    setup.engines["engine-a"].refuse["nowhere"] = grpc.StatusCode.FAILED_PRECONDITION
    results = await setup.batch(request("r0"), request("r1"), request("bad"), request("nowhere"))

    assert served_by(results)[:2] == ["engine-b", "engine-a"], "each retried on the other engine"
    assert results[2].code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "refuses" in results[2].details
    assert sum(call.count("bad") for e in setup.engines.values() for call in e.calls) == 1, "not retried"
    assert results[3].code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert "after 2 attempt(s)" in results[3].details, "both engines named"


async def test_an_engine_without_generate_batch_is_called_per_request(setup: Setup) -> None:
    await setup.add_engine(FakeEngine("engine-old", batches=False))
    results = await setup.batch(*(request(f"r{i}") for i in range(3)))
    assert served_by(results) == ["engine-old"] * 3
    assert sorted(setup.engines["engine-old"].calls) == [["r0"], ["r1"], ["r2"]]


async def test_without_engines_every_request_is_unavailable(setup: Setup) -> None:
    results = await setup.batch(request("r0"), request("r1"))
    assert [r.code for r in results] == [grpc.StatusCode.UNAVAILABLE.value[0]] * 2
    assert all("no live engines" in r.details for r in results)


def answered_as(setup: Setup, results: list[rollout_pb2.GenerateResult]) -> bool:
    """Each OK result is exactly what its engine answered (the router passes the bytes on)."""
    return all(
        r
        == setup.engines[r.response.engine_id].answer(
            rollout_pb2.GenerateRequest(
                request_id=r.response.request_id,
                sampling=common_pb2.SamplingParams(n=len(r.response.completions)),
            )
        )
        for r in results
        if r.code == OK
    )


@pytest.mark.parametrize("engines", [1, 3])
async def test_answers_pass_on_as_the_engines_sent_them_in_request_order(setup: Setup, engines: int) -> None:
    """One engine: its reply is the batch's; one request per engine: each reply is that request's
    result; some engines with several requests each, one refused: each result is copied."""
    for i in range(engines):
        await setup.add_engine(FakeEngine(f"engine-{i}"))
    for count in (1, engines, 2 * engines + 1):
        ids = [f"c{count}-r{i}" for i in range(count)]
        results = await setup.batch(*(request(r, n=1 + i % 3) for i, r in enumerate(ids)))
        assert [r.response.request_id for r in results] == ids
        assert [len(r.response.completions) for r in results] == [1 + i % 3 for i in range(count)]
        assert answered_as(setup, results)
    for engine in setup.engines.values():
        engine.refuse["bad"] = grpc.StatusCode.INVALID_ARGUMENT
    results = await setup.batch(request("a"), request("bad"), request("b"))
    assert [r.code for r in results] == [OK, grpc.StatusCode.INVALID_ARGUMENT.value[0], OK]
    assert [r.response.request_id for r in results] == ["a", "", "b"]
    assert answered_as(setup, results)
