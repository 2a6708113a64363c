"""Coalescing clients: the calls that the runner's concurrent groups make to the router and the
reward service, sent as batches.

Every group keeps calling ``clients.router.Generate(request, timeout=...)`` and
``clients.reward.ScoreBatch(request, timeout=...)`` as if it were alone. A ``Coalescer`` queues
the calls made while a flush is pending and sends them as one call when none has been added for
``window_s`` (at most ``MAX_WAIT_WINDOWS`` windows after the first), or at once when
``max_calls`` are queued: one router GenerateBatch, one reward ScoreBatch of every group's items.
Each caller gets its own answer back, in order: a request that failed in a GenerateBatch raises
a ``grpc.aio.AioRpcError`` with its own code for its caller only, so that ``group.call`` retries
and maps it as before. Each caller stops waiting at its own timeout; the batch's call carries
the latest deadline of its members.

A router without GenerateBatch (UNIMPLEMENTED) is called once per request from then on. A batch
that fails as a whole with a code that may be one member's doing (INVALID_ARGUMENT from a reward
service that refuses a whole ScoreBatch for one bad item, say) is sent again one call per member,
so that no group is dead-lettered for another's fault.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import grpc

from services.common.pb import reward_pb2, reward_pb2_grpc, rollout_pb2, router_pb2_grpc
from services.runner.spliced import packed_batch, packed_response, unpacked_response

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

MAX_WAIT_WINDOWS = 5
"""A queued call waits at most this many windows, however steadily others keep coming."""
SHARED_FAILURES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
)
"""Failures of a whole batch that are every member's (the service, the link or the time): the
other codes send the members again one by one."""
HEAP_SWEEP_AT = 4096
"""Watched deadlines past which answered calls behind a waiting one are swept from the heap (then
every as many more)."""
STATUS_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}
CHECK_TIMEOUT_S = 10.0
"""Deadline of the CheckVerifier that tells whether a verifier needs token ids."""

Outcome = R | BaseException
Send = Callable[[list[T], list[float | None]], Awaitable[list[Any]]]
"""Sends queued items with their callers' timeouts; one result or exception per item, in order."""


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The error a direct call with this status would have raised."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


def latest(timeouts: Sequence[float | None]) -> float | None:
    """The timeout of a batch: its members' latest (None when one has none)."""
    return None if any(t is None for t in timeouts) else max(t for t in timeouts if t is not None)


@dataclass(eq=False, slots=True)
class _Call(Generic[T, R]):
    item: T
    deadline: float | None
    """Loop time when its caller stops waiting."""
    future: asyncio.Future[R]


class _Deadlines:
    """Fails each watched call's future with DEADLINE_EXCEEDED once its deadline passes, on one
    timer for them all: the calls of a batch mostly share their timeout, and an
    ``asyncio.wait_for`` per call (a future, a timer and callbacks each) took 35-73% more CPU per
    coalesced call."""

    def __init__(self, details: str) -> None:
        self.details = details
        self._heap: list[tuple[float, int, _Call[Any, Any]]] = []
        self._count = 0
        """Calls watched so far: ties in the heap by order of arrival."""
        self._timer: asyncio.TimerHandle | None = None

    def watch(self, call: _Call[Any, Any], loop: asyncio.AbstractEventLoop) -> None:
        assert call.deadline is not None
        heap = self._heap
        # Calls mostly end in the order they came, so the answered ones are at the top: dropped
        # here, they do not hold their requests and replies (a step's samples, megabytes) alive
        # until a sweep. The sweep bounds those behind a call still waiting.
        while heap and heap[0][2].future.done():
            heapq.heappop(heap)
        if len(heap) >= HEAP_SWEEP_AT and len(heap) % HEAP_SWEEP_AT == 0:
            self._sweep()
        self._count += 1
        heapq.heappush(self._heap, (call.deadline, self._count, call))
        if self._timer is None or call.deadline < self._timer.when():
            self._arm(loop)

    def _sweep(self) -> None:
        self._heap = [entry for entry in self._heap if not entry[2].future.done()]
        heapq.heapify(self._heap)

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._timer is not None:
            self._timer.cancel()
        while self._heap and self._heap[0][2].future.done():
            heapq.heappop(self._heap)
        self._timer = loop.call_at(self._heap[0][0], self._expire, loop) if self._heap else None

    def _expire(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        now = loop.time()
        while self._heap and self._heap[0][0] <= now:
            call = heapq.heappop(self._heap)[2]
            if not call.future.done():
                call.future.set_exception(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, self.details))
        self._arm(loop)


class Coalescer(Generic[T, R]):
    """Queues calls and sends them together through ``send``."""

    def __init__(
        self,
        send: Send[T],
        *,
        window_s: float,
        max_calls: int,
        name: str,
        observe: Callable[[int], None] | None = None,
    ) -> None:
        self.send = send
        self.window_s = window_s
        self.max_calls = max_calls
        self.name = name
        self.observe = observe
        """Told the number of calls of every batch sent (a metric)."""
        self._queue: list[_Call[T, R]] = []
        self._first_at = 0.0
        self._last_at = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._sending: set[asyncio.Task[None]] = set()
        self._deadlines = _Deadlines(f"{name}: deadline exceeded")

    async def call(self, item: T, timeout: float | None) -> R:
        """``item``'s result, or its failure raised; DEADLINE_EXCEEDED after ``timeout``."""
        loop = asyncio.get_running_loop()
        queued = _Call[T, R](item, None if timeout is None else loop.time() + timeout, loop.create_future())
        self._queue.append(queued)
        if queued.deadline is not None:
            self._deadlines.watch(queued, loop)
        if len(self._queue) >= self.max_calls:
            self._flush()
        else:
            self._schedule(loop)
        try:
            return await queued.future
        finally:
            if queued in self._queue:  # its caller left before it was sent: send nothing
                self._queue.remove(queued)

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        """Note the call's time; one timer per batch, which looks again when it fires (moving
        a timer for every call of a batch cost more than the batch saved)."""
        self._last_at = now = loop.time()
        if len(self._queue) == 1:
            self._first_at = now
        if self._timer is None:
            self._timer = loop.call_at(now + self.window_s, self._due, loop)

    def _due(self, loop: asyncio.AbstractEventLoop) -> None:
        """Flush when no call came for a window, or the first has waited its most; else wait on."""
        when = min(self._last_at + self.window_s, self._first_at + MAX_WAIT_WINDOWS * self.window_s)
        if loop.time() >= when or not self._queue:
            self._flush()
        else:
            self._timer = loop.call_at(when, self._due, loop)

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        calls, self._queue = self._queue, []
        if calls:
            task = asyncio.create_task(self._send(calls), name=f"{self.name} batch")
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send(self, calls: list[_Call[T, R]]) -> None:
        live = [call for call in calls if not call.future.done()]
        if not live:
            return
        if self.observe is not None:
            self.observe(len(live))
        now = asyncio.get_running_loop().time()
        timeouts = [None if c.deadline is None else max(0.0, c.deadline - now) for c in live]
        try:
            outcomes = await self.send([call.item for call in live], timeouts)
        except asyncio.CancelledError:
            for call in live:
                call.future.cancel()
            raise
        except Exception as err:  # a bug in ``send``: every caller hears of it rather than hangs
            log.exception("%s: a batch of %d calls failed", self.name, len(live))
            outcomes = [err] * len(live)
        for call, outcome in zip(live, outcomes, strict=True):
            if call.future.done():
                continue
            if isinstance(outcome, BaseException):
                call.future.set_exception(outcome)
            else:
                call.future.set_result(outcome)

    async def close(self) -> None:
        """Send what is queued and wait for the batches in flight (each has its deadline)."""
        self._flush()
        await asyncio.gather(*self._sending, return_exceptions=True)


async def one_by_one(
    call: Callable[..., Awaitable[R]], items: Sequence[Any], timeouts: Sequence[float | None]
) -> list[Outcome[R]]:
    """Each item in its own call, concurrently, with its own timeout."""
    return list(
        await asyncio.gather(
            *(call(item, timeout=timeout) for item, timeout in zip(items, timeouts, strict=True)),
            return_exceptions=True,
        )
    )


def _generate_outcome(
    result: rollout_pb2.PackedGenerateResult,
) -> Outcome[rollout_pb2.PackedGenerateResponse]:
    if result.code == grpc.StatusCode.OK.value[0]:
        return result.response
    return rpc_error(STATUS_BY_VALUE.get(result.code, grpc.StatusCode.UNKNOWN), result.details)


def _packed(outcome: Outcome[rollout_pb2.GenerateResponse]) -> Outcome[rollout_pb2.PackedGenerateResponse]:
    return outcome if isinstance(outcome, BaseException) else packed_response(outcome)


PackedBatchCall = Callable[..., Awaitable[rollout_pb2.PackedGenerateBatchResponse]]
"""The router's GenerateBatch read as a PackedGenerateBatchResponse (``packed_batch_call``)."""


def packed_batch_call(channel: grpc.aio.Channel) -> PackedBatchCall:
    """The router's GenerateBatch on ``channel``, its reply read by ``spliced.packed_batch``."""
    return channel.unary_unary(
        "/verst.v1.Router/GenerateBatch",
        request_serializer=rollout_pb2.GenerateBatchRequest.SerializeToString,
        response_deserializer=packed_batch,
    )


JoinedScoreCall = Callable[..., Awaitable[reward_pb2.ScoreBatchResponse]]
"""The reward service's ScoreBatch called with a list of ScoreBatchRequests (``joined_score_call``)."""


def joined_requests(requests: Sequence[reward_pb2.ScoreBatchRequest]) -> bytes:
    """One ScoreBatchRequest of all the requests' items, in order. Its only field is the repeated
    ``items``, so a message is its items' records and the requests' bytes joined are the merged
    request's (wire.py): no item is copied into a merged message first."""
    return b"".join(request.SerializeToString() for request in requests)


def joined_score_call(channel: grpc.aio.Channel) -> JoinedScoreCall:
    """The reward service's ScoreBatch on ``channel``, sent ``joined_requests``."""
    return channel.unary_unary(
        "/verst.v1.Reward/ScoreBatch",
        request_serializer=joined_requests,
        response_deserializer=reward_pb2.ScoreBatchResponse.FromString,
    )


class _CoalescingStub:
    """A stub whose one batched method is coalesced (``_calls``); its other methods are the stub's own."""

    stub: Any
    _calls: Coalescer[Any, Any]

    def __getattr__(self, name: str) -> Any:
        if name == "stub" or name.startswith("_"):  # not set up yet: no recursion
            raise AttributeError(name)
        return getattr(self.stub, name)

    async def close(self) -> None:
        await self._calls.close()


class CoalescingRouter(_CoalescingStub):
    """The router stub, its Generate calls coalesced into GenerateBatch calls; its other
    methods (GenerateStream, ListEngines...) are the stub's own. ``GeneratePacked`` answers with
    the completions' arrays as packed bytes (spliced.py), ``Generate`` parses them."""

    def __init__(
        self,
        stub: router_pb2_grpc.RouterStub,
        *,
        window_s: float,
        max_calls: int,
        observe: Callable[[int], None] | None = None,
        batch_call: PackedBatchCall | None = None,
    ) -> None:
        self.stub = stub
        self.batches = True
        """False once the router answered GenerateBatch with UNIMPLEMENTED."""
        self._batch_call = batch_call
        """GenerateBatch read packed (``packed_batch_call``); None: the stub's, packed again."""
        self._calls = Coalescer[rollout_pb2.GenerateRequest, rollout_pb2.PackedGenerateResponse](
            self._send, window_s=window_s, max_calls=max_calls, name="router Generate", observe=observe
        )

    async def Generate(
        self, request: rollout_pb2.GenerateRequest, timeout: float | None = None
    ) -> rollout_pb2.GenerateResponse:
        if not self.batches:
            return await self.stub.Generate(request, timeout=timeout)
        return unpacked_response(await self._calls.call(request, timeout))

    async def GeneratePacked(
        self, request: rollout_pb2.GenerateRequest, timeout: float | None = None
    ) -> rollout_pb2.PackedGenerateResponse:
        if not self.batches:
            return packed_response(await self.stub.Generate(request, timeout=timeout))
        return await self._calls.call(request, timeout)

    async def _batch(
        self, batch: rollout_pb2.GenerateBatchRequest, timeout: float | None
    ) -> rollout_pb2.PackedGenerateBatchResponse:
        if self._batch_call is not None:
            return await self._batch_call(batch, timeout=timeout)
        reply = await self.stub.GenerateBatch(batch, timeout=timeout)
        return rollout_pb2.PackedGenerateBatchResponse.FromString(reply.SerializeToString())

    async def _one_by_one(
        self, requests: list[rollout_pb2.GenerateRequest], timeouts: list[float | None]
    ) -> list[Outcome[rollout_pb2.PackedGenerateResponse]]:
        return [_packed(outcome) for outcome in await one_by_one(self.stub.Generate, requests, timeouts)]

    async def _send(
        self, requests: list[rollout_pb2.GenerateRequest], timeouts: list[float | None]
    ) -> list[Outcome[rollout_pb2.PackedGenerateResponse]]:
        if not self.batches or len(requests) == 1:
            return await self._one_by_one(requests, timeouts)
        batch = rollout_pb2.GenerateBatchRequest(requests=requests)
        try:
            reply = await self._batch(batch, latest(timeouts))
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                log.info("the router has no GenerateBatch: one Generate per request from now on")
                self.batches = False
            elif err.code() in SHARED_FAILURES:
                return [err] * len(requests)
            return await self._one_by_one(requests, timeouts)
        if len(reply.results) != len(requests):
            details = f"router GenerateBatch returned {len(reply.results)} results for {len(requests)}"
            return [rpc_error(grpc.StatusCode.INTERNAL, details)] * len(requests)
        return [_generate_outcome(result) for result in reply.results]


class CoalescingReward(_CoalescingStub):
    """The reward stub, its ScoreBatch calls coalesced into one ScoreBatch of all their items;
    its other methods are the stub's own."""

    def __init__(
        self,
        stub: reward_pb2_grpc.RewardStub,
        *,
        window_s: float,
        max_calls: int,
        observe: Callable[[int], None] | None = None,
        joined_call: JoinedScoreCall | None = None,
    ) -> None:
        self.stub = stub
        self._joined_call = joined_call
        """ScoreBatch sent the requests' bytes joined (``joined_score_call``); None: the stub's,
        sent a merged request."""
        self._calls = Coalescer[reward_pb2.ScoreBatchRequest, reward_pb2.ScoreBatchResponse](
            self._send, window_s=window_s, max_calls=max_calls, name="reward ScoreBatch", observe=observe
        )
        self._text_only: dict[str, asyncio.Task[bool]] = {}

    async def text_only(self, verifier: str) -> bool:
        """Whether the service's ``verifier`` reads texts alone (its CheckVerifier says so), so
        that ScoreRequests for it may leave the token ids out: most of a request's bytes. Asked
        once per name; False, asked again next time, when the service cannot tell now; False for
        good from a service without CheckVerifier or that does not say."""
        asked = self._text_only.get(verifier)
        if asked is None or (asked.done() and (asked.cancelled() or asked.exception() is not None)):
            asked = asyncio.ensure_future(self._check(verifier))
            self._text_only[verifier] = asked
        try:
            return await asyncio.shield(asked)
        except grpc.aio.AioRpcError:
            return False

    async def _check(self, verifier: str) -> bool:
        request = reward_pb2.CheckVerifierRequest(verifier=verifier)
        try:
            reply = await self.stub.CheckVerifier(request, timeout=CHECK_TIMEOUT_S)
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                return False
            raise
        return bool(reply.ok and reply.text_only)

    async def ScoreBatch(
        self, request: reward_pb2.ScoreBatchRequest, timeout: float | None = None
    ) -> reward_pb2.ScoreBatchResponse:
        return await self._calls.call(request, timeout)

    async def _send(
        self, requests: list[reward_pb2.ScoreBatchRequest], timeouts: list[float | None]
    ) -> list[Outcome[reward_pb2.ScoreBatchResponse]]:
        if len(requests) == 1:
            return await one_by_one(self.stub.ScoreBatch, requests, timeouts)
        items = sum(len(request.items) for request in requests)
        try:
            if self._joined_call is not None:
                reply = await self._joined_call(requests, timeout=latest(timeouts))
            else:
                merged = reward_pb2.ScoreBatchRequest(
                    items=[i for request in requests for i in request.items]
                )
                reply = await self.stub.ScoreBatch(merged, timeout=latest(timeouts))
        except grpc.aio.AioRpcError as err:
            if err.code() in SHARED_FAILURES:
                return [err] * len(requests)
            return await one_by_one(self.stub.ScoreBatch, requests, timeouts)
        if len(reply.results) != items:  # each group's own call tells whose it is
            return await one_by_one(self.stub.ScoreBatch, requests, timeouts)
        results: list[Outcome[reward_pb2.ScoreBatchResponse]] = []
        start = 0
        for request in requests:
            end = start + len(request.items)
            results.append(reward_pb2.ScoreBatchResponse(results=reply.results[start:end]))
            start = end
        return results
