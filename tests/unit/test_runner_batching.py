"""The runner's coalescing clients (services/runner/batching.py): concurrent calls go out as one
batch, each caller gets its own answer or its own failure, and keeps its own deadline."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.pb import reward_pb2, rollout_pb2
from services.runner.batching import (
    HEAP_SWEEP_AT,
    CoalescingReward,
    CoalescingRouter,
    joined_requests,
    rpc_error,
)
from services.runner.group import InvalidTaskError, call

WINDOW_S = 0.005


def request(request_id: str) -> rollout_pb2.GenerateRequest:
    return rollout_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=[1])


def response(request_id: str) -> rollout_pb2.GenerateResponse:
    return rollout_pb2.GenerateResponse(request_id=request_id, engine_id="e")


class FakeRouterStub:
    """A RouterStub: ``refuse`` maps request ids to the code their result carries; ``hold``
    request ids are answered only when ``release`` is set; ``batches`` False: UNIMPLEMENTED."""

    def __init__(self, *, batches: bool = True) -> None:
        self.batches = batches
        self.refuse: dict[str, grpc.StatusCode] = {}
        self.hold: set[str] = set()
        self.release = asyncio.Event()
        self.batch_calls: list[tuple[list[str], float | None]] = []
        self.single_calls: list[str] = []
        self.failure: grpc.StatusCode | None = None
        """When set, every GenerateBatch fails as a whole with it."""

    async def GenerateBatch(
        self, batch: rollout_pb2.GenerateBatchRequest, timeout: float | None = None
    ) -> rollout_pb2.GenerateBatchResponse:
        if not self.batches:
            raise rpc_error(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")
        ids = [r.request_id for r in batch.requests]
        self.batch_calls.append((ids, timeout))
        if self.failure is not None:
            raise rpc_error(self.failure, "the whole batch failed")
        if self.hold & set(ids):
            await self.release.wait()
        results = []
        for request_id in ids:
            code = self.refuse.get(request_id)
            if code is None:
                results.append(rollout_pb2.GenerateResult(response=response(request_id)))
            else:
                results.append(
                    rollout_pb2.GenerateResult(code=code.value[0], details=f"{request_id} refused")
                )
        return rollout_pb2.GenerateBatchResponse(results=results)

    async def Generate(
        self, request: rollout_pb2.GenerateRequest, timeout: float | None = None
    ) -> rollout_pb2.GenerateResponse:
        self.single_calls.append(request.request_id)
        code = self.refuse.get(request.request_id)
        if code is not None:
            raise rpc_error(code, f"{request.request_id} refused")
        return response(request.request_id)

    async def ListEngines(self, request: object, timeout: float | None = None) -> str:
        return "engines"


def router_over(stub: FakeRouterStub, max_calls: int = 64) -> CoalescingRouter:
    return CoalescingRouter(stub, window_s=WINDOW_S, max_calls=max_calls)  # type: ignore[arg-type]


async def test_concurrent_calls_go_out_as_one_batch_and_each_caller_gets_its_own_answer() -> None:
    stub = FakeRouterStub()
    router = router_over(stub)
    replies = await asyncio.gather(*(router.Generate(request(f"r{i}"), timeout=10) for i in range(5)))
    assert [reply.request_id for reply in replies] == [f"r{i}" for i in range(5)]
    assert [ids for ids, _ in stub.batch_calls] == [[f"r{i}" for i in range(5)]]
    assert stub.single_calls == []
    later = await router.Generate(request("later"), timeout=10)  # after the batch: a batch of its own
    assert later.request_id == "later" and stub.single_calls == ["later"], "a batch of one is a Generate"
    assert await router.ListEngines(object(), timeout=1) == "engines", "other methods are the stub's"


async def test_a_full_batch_goes_out_at_once() -> None:
    stub = FakeRouterStub()
    router = router_over(stub, max_calls=2)
    await asyncio.gather(*(router.Generate(request(f"r{i}"), timeout=10) for i in range(5)))
    assert [ids for ids, _ in stub.batch_calls] == [["r0", "r1"], ["r2", "r3"]]
    assert stub.single_calls == ["r4"]


async def test_a_failed_request_raises_for_its_caller_only_with_its_code() -> None:
    stub = FakeRouterStub()
    stub.refuse = {"r1": grpc.StatusCode.INVALID_ARGUMENT, "r2": grpc.StatusCode.RESOURCE_EXHAUSTED}
    router = router_over(stub)
    outcomes = await asyncio.gather(
        *(router.Generate(request(f"r{i}"), timeout=10) for i in range(4)), return_exceptions=True
    )
    assert [o.request_id for o in outcomes if isinstance(o, rollout_pb2.GenerateResponse)] == ["r0", "r3"]
    for index, code in ((1, grpc.StatusCode.INVALID_ARGUMENT), (2, grpc.StatusCode.RESOURCE_EXHAUSTED)):
        failure = outcomes[index]
        assert isinstance(failure, grpc.aio.AioRpcError)
        assert (failure.code(), failure.details()) == (code, f"r{index} refused")
    # group.call maps it as it maps a direct call's failure
    with pytest.raises(InvalidTaskError, match="INVALID_ARGUMENT: r1 refused"):
        await call("router Generate", 0.0, lambda: router.Generate(request("r1"), timeout=10))


async def test_each_caller_keeps_its_own_deadline_and_the_batch_carries_the_latest() -> None:
    stub = FakeRouterStub()
    stub.hold = {"slow"}
    router = router_over(stub)
    short = asyncio.create_task(router.Generate(request("short"), timeout=0.2))
    slow = asyncio.create_task(router.Generate(request("slow"), timeout=30))
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await short
    assert failed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert not slow.done(), "the other caller still waits"
    [(ids, timeout)] = stub.batch_calls
    assert ids == ["short", "slow"] and timeout is not None and 29 < timeout <= 30
    stub.release.set()
    assert (await slow).request_id == "slow"


async def test_a_caller_that_leaves_before_the_batch_goes_is_not_sent() -> None:
    stub = FakeRouterStub()
    router = router_over(stub)
    leaving = asyncio.create_task(router.Generate(request("gone"), timeout=10))
    staying = asyncio.create_task(router.Generate(request("kept"), timeout=10))
    await asyncio.sleep(0)
    leaving.cancel()
    assert (await staying).request_id == "kept"
    assert stub.single_calls == ["kept"] and stub.batch_calls == []


async def test_a_router_without_generate_batch_gets_one_generate_per_request() -> None:
    stub = FakeRouterStub(batches=False)
    stub.refuse = {"r1": grpc.StatusCode.FAILED_PRECONDITION}
    router = router_over(stub)
    outcomes = await asyncio.gather(
        *(router.Generate(request(f"r{i}"), timeout=10) for i in range(3)), return_exceptions=True
    )
    assert isinstance(outcomes[1], grpc.aio.AioRpcError)
    assert outcomes[1].code() == grpc.StatusCode.FAILED_PRECONDITION
    assert [o.request_id for o in (outcomes[0], outcomes[2])] == ["r0", "r2"]  # type: ignore[union-attr]
    assert sorted(stub.single_calls) == ["r0", "r1", "r2"] and not router.batches
    await asyncio.gather(*(router.Generate(request(f"s{i}"), timeout=10) for i in range(2)))
    assert stub.single_calls[-2:] == ["s0", "s1"], "straight to Generate from then on"


@pytest.mark.parametrize(
    ("failure", "split"),
    [(grpc.StatusCode.UNAVAILABLE, False), (grpc.StatusCode.RESOURCE_EXHAUSTED, True)],
)
async def test_a_batch_that_fails_as_a_whole(failure: grpc.StatusCode, split: bool) -> None:
    """The service's fault is every caller's; another may be one member's: each goes alone."""
    stub = FakeRouterStub()
    stub.failure = failure
    router = router_over(stub)
    outcomes = await asyncio.gather(
        *(router.Generate(request(f"r{i}"), timeout=10) for i in range(2)), return_exceptions=True
    )
    if split:
        assert [o.request_id for o in outcomes] == ["r0", "r1"]  # type: ignore[union-attr]
        assert sorted(stub.single_calls) == ["r0", "r1"]
    else:
        assert all(isinstance(o, grpc.aio.AioRpcError) and o.code() == failure for o in outcomes)
        assert stub.single_calls == []


class FakeRewardStub:
    """Reward = the item's response length; a batch holding a "poison" item fails as a whole."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []

    async def ScoreBatch(
        self, batch: reward_pb2.ScoreBatchRequest, timeout: float | None = None
    ) -> reward_pb2.ScoreBatchResponse:
        texts = [item.response_text for item in batch.items]
        self.batches.append(texts)
        if "poison" in texts:
            raise rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "a poisoned item")
        return reward_pb2.ScoreBatchResponse(
            results=[reward_pb2.ScoreResponse(reward=float(len(text))) for text in texts]
        )


def score_batch(*texts: str) -> reward_pb2.ScoreBatchRequest:
    return reward_pb2.ScoreBatchRequest(items=[reward_pb2.ScoreRequest(response_text=text) for text in texts])


def coalescing_reward(stub: FakeRewardStub, joined: bool) -> CoalescingReward:
    """The runner's client of ``stub``: sending the groups' requests joined as bytes (as on a
    channel, ``joined_score_call``), or a merged request through the stub."""

    async def joined_call(
        requests: list[reward_pb2.ScoreBatchRequest], timeout: float | None = None
    ) -> reward_pb2.ScoreBatchResponse:
        return await stub.ScoreBatch(
            reward_pb2.ScoreBatchRequest.FromString(joined_requests(requests)), timeout
        )

    return CoalescingReward(
        stub,  # type: ignore[arg-type]
        window_s=WINDOW_S,
        max_calls=64,
        joined_call=joined_call if joined else None,
    )


def test_a_score_batch_request_is_its_items_alone() -> None:
    """What lets ``joined_requests`` join requests' bytes: a field besides ``items`` would be
    repeated, or overwritten, in the joined message."""
    assert [f.name for f in reward_pb2.ScoreBatchRequest.DESCRIPTOR.fields] == ["items"]
    requests = [score_batch("a", "bb"), score_batch(), score_batch("ccc")]
    merged = reward_pb2.ScoreBatchRequest.FromString(joined_requests(requests))
    assert [item.response_text for item in merged.items] == ["a", "bb", "ccc"]


@pytest.mark.parametrize("joined", [True, False], ids=["joined", "merged"])
async def test_score_batches_are_merged_and_split_back_in_order(joined: bool) -> None:
    stub = FakeRewardStub()
    reward = coalescing_reward(stub, joined)
    replies = await asyncio.gather(
        reward.ScoreBatch(score_batch("a", "bb"), timeout=5),
        reward.ScoreBatch(score_batch("ccc"), timeout=5),
        reward.ScoreBatch(score_batch("dddd", "e", "ff"), timeout=5),
    )
    assert [[r.reward for r in reply.results] for reply in replies] == [[1, 2], [3], [4, 1, 2]]
    assert stub.batches == [["a", "bb", "ccc", "dddd", "e", "ff"]]


@pytest.mark.parametrize("joined", [True, False], ids=["joined", "merged"])
async def test_a_merged_score_batch_refused_as_a_whole_is_sent_again_per_group(joined: bool) -> None:
    stub = FakeRewardStub()
    reward = coalescing_reward(stub, joined)
    outcomes = await asyncio.gather(
        reward.ScoreBatch(score_batch("a", "bb"), timeout=5),
        reward.ScoreBatch(score_batch("poison"), timeout=5),
        return_exceptions=True,
    )
    assert [r.reward for r in outcomes[0].results] == [1, 2]  # type: ignore[union-attr]
    assert isinstance(outcomes[1], grpc.aio.AioRpcError)
    assert outcomes[1].code() == grpc.StatusCode.INVALID_ARGUMENT
    assert stub.batches[0] == ["a", "bb", "poison"] and sorted(stub.batches[1:]) == [["a", "bb"], ["poison"]]


async def test_a_caller_waiting_in_the_queue_hears_of_its_deadline_on_time() -> None:
    stub = FakeRouterStub()
    router = CoalescingRouter(stub, window_s=5.0, max_calls=64)  # type: ignore[arg-type]
    started = asyncio.get_running_loop().time()
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await router.Generate(request("queued"), timeout=0.1)
    waited = asyncio.get_running_loop().time() - started
    assert failed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and 0.09 <= waited < 1.0
    await router.close()
    assert stub.batch_calls == [] and stub.single_calls == [], "a call whose caller left is not sent"


async def test_answered_calls_do_not_pile_up_behind_their_deadlines() -> None:
    """One timer watches every deadline; the calls answered long before theirs are swept."""
    stub = FakeRouterStub()
    router = router_over(stub, max_calls=16)  # full batches go at once: no window to wait
    for _ in range(HEAP_SWEEP_AT // 16 + 40):  # past a sweep, and far from the next
        await asyncio.gather(*(router.Generate(request(f"r{i}"), timeout=3600) for i in range(16)))
    watched = router._calls._deadlines._heap
    assert len(watched) <= 16, "answered calls (and their replies) are dropped by the next call"
    # a call left waiting keeps those behind it until a sweep
    slow = [asyncio.create_task(router.Generate(request(f"slow{i}"), timeout=3600)) for i in "ab"]
    stub.hold = {"slowa"}
    await asyncio.sleep(2 * WINDOW_S)
    for _ in range(2 * HEAP_SWEEP_AT // 16 + 1):
        await asyncio.gather(*(router.Generate(request(f"r{i}"), timeout=3600) for i in range(16)))
    watched = router._calls._deadlines._heap
    assert len(watched) <= HEAP_SWEEP_AT and watched[0][2].item.request_id == "slowa"
    stub.release.set()
    assert [(await call).request_id for call in slow] == ["slowa", "slowb"]
    stub.release.clear()
    stub.hold = {"late"}  # and a deadline still fires after sweeps
    late = asyncio.create_task(router.Generate(request("late"), timeout=0.05))
    kept = asyncio.create_task(router.Generate(request("kept"), timeout=30))
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await late
    assert failed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and not kept.done()
    stub.release.set()
    assert (await kept).request_id == "kept"
