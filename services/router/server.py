"""The router: the Rollout Generate contract, spread over the live engines of the registry.

A caller cannot tell the router from an engine. Each request goes to an engine serving its
job_id (when one does), the one with the fewest samples in flight through this router,
except that requests sharing a session_id stay on one engine while it is alive (its KV
cache and weights version stay consistent for a group). A connection failure (UNAVAILABLE)
drops that engine from the local view and the request is retried on another; an engine
that cannot serve it yet (FAILED_PRECONDITION: no weights, another job) is skipped for the
request. Every forwarded call carries the caller's remaining deadline.

GenerateBatch picks an engine for each of its requests the same way, sends each engine its
share as one GenerateBatch (the engine batches them together), and retries the requests of a
share that failed, or that an engine could not serve yet, elsewhere; each request's result
carries its own status.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
from redis.exceptions import RedisError

from services.common.bus import connect
from services.common.engine_registry import EngineRegistry
from services.common.grpc_server import add_servicer, serve
from services.common.metrics_http import serving_service_metrics
from services.common.pb import common_pb2, rollout_pb2, router_pb2, router_pb2_grpc
from services.common.settings import load_settings, redis_target, setup_logging
from services.common.wire import record, records
from services.router.config import RouterSettings
from services.router.pool import EngineLink, EnginePool
from services.router.telemetry import RouterMetrics

log = logging.getLogger(__name__)

SERVICE_NAME = "verst.v1.Router"
STATUS_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}
RESULTS_FIELD = rollout_pb2.GenerateBatchResponse.RESULTS_FIELD_NUMBER
PRUNE_EVERY_S = 30.0
"""How often the router deletes registry entries of engines long dead."""


class RequestFailed(Exception):
    """A request no engine could serve: the status its caller gets."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details

    def result(self) -> rollout_pb2.GenerateResult:
        return rollout_pb2.GenerateResult(code=self.code.value[0], details=self.details)


@contextlib.asynccontextmanager
async def aborting(context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
    """Abort the call with the status of a RequestFailed raised in the block."""
    try:
        yield
    except RequestFailed as err:
        await context.abort(err.code, err.details)


class _Attempts:
    """The engines tried for one request, within its deadline and the attempt bound."""

    def __init__(
        self,
        pool: EnginePool,
        request: rollout_pb2.GenerateRequest,
        deadline: float,
        limit: int,
        metrics: RouterMetrics | None = None,
    ):
        self.pool = pool
        self.metrics = metrics
        self.session_id = request.session_id
        self.job_id = request.job_id
        self.samples = max(1, request.sampling.n)
        self.deadline = deadline
        self.limit = limit
        self.tried: list[str] = []
        self.errors: list[str] = []
        self.last_code = grpc.StatusCode.UNAVAILABLE

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    async def next(self) -> EngineLink:
        """The next engine to try (counted as busy); raises RequestFailed when none is left."""
        if len(self.tried) >= self.limit:
            raise self._given_up()
        link = self.pool.pick(self.session_id, exclude=set(self.tried), job_id=self.job_id)
        if link is None and not self.tried:
            await self.pool.refresh()  # maybe an engine appeared since the last refresh
            link = self.pool.pick(self.session_id, exclude=set(), job_id=self.job_id)
        if link is None:
            raise self._given_up()
        if self.remaining() <= 0:
            raise RequestFailed(
                grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed before an engine answered"
            )
        self.tried.append(link.engine_id)
        self.pool.acquire(link, self.samples)
        if self.metrics is not None:
            self.metrics.routed.labels(link.engine_id).inc()
        return link

    async def failed(self, link: EngineLink, code: grpc.StatusCode, details: str) -> None:
        """Note a failed attempt; raises RequestFailed unless another engine may do better."""
        if code == grpc.StatusCode.UNAVAILABLE:
            if not link.retired:  # once per engine, not once per request of a failed share
                log.warning("engine %s at %s is unavailable: %s", link.engine_id, link.address, details)
            await self.pool.mark_failed(link)
        elif code != grpc.StatusCode.FAILED_PRECONDITION:  # bad input or a deadline: the same anywhere
            raise RequestFailed(code, details or code.name)
        self.last_code = code
        self.errors.append(f"{link.engine_id}: {code.name} {details}")

    def _given_up(self) -> RequestFailed:
        if not self.tried:
            return RequestFailed(
                grpc.StatusCode.UNAVAILABLE,
                "no live engines: none is in the registry with a heartbeat younger than the ttl, "
                "or all are draining; start one with `python -m services.rollout`",
            )
        return RequestFailed(
            self.last_code,
            f"no engine could serve the request after {len(self.tried)} attempt(s): "
            + "; ".join(self.errors),
        )


Share = tuple[EngineLink, list[int]]
"""One engine and the indices of the batch's requests it is sent."""


@dataclass
class _Batch:
    """A GenerateBatch in progress: its requests, their attempts, and the answers so far."""

    requests: list[rollout_pb2.GenerateRequest]
    attempts: list[_Attempts]
    answers: list[bytes | memoryview] = field(default_factory=list)
    """Each request's result as it is on the wire: a record of GenerateBatchResponse's
    ``results`` (services/common/wire.py). The reply is their concatenation, so an engine's
    answers go on as the bytes they came as (copying a step's samples into a new message cost
    the router more than routing them: 0.28 ms a group of eight 1,000-token samples)."""
    whole: bytes | None = None
    """One engine's reply that answered every request, in order, each OK: the batch's answer."""

    def __post_init__(self) -> None:
        self.answers = [b""] * len(self.requests)

    def answer(self, index: int, result: rollout_pb2.GenerateResult) -> None:
        self.answers[index] = record(RESULTS_FIELD, result.SerializeToString())

    def reply(self) -> bytes:
        return self.whole if self.whole is not None else b"".join(self.answers)


@dataclass(frozen=True, slots=True)
class _EngineReply:
    """An engine's GenerateBatch reply: the bytes it came as, parsed, and each result's record."""

    wire: bytes
    parsed: rollout_pb2.PackedGenerateBatchResponse
    """Read for the results' codes and details only."""
    records: list[memoryview]


class Router(router_pb2_grpc.RouterServicer):
    """Generate, GenerateBatch, GenerateStream, ListEngines, DrainEngine and AbortJob over an
    EnginePool."""

    def __init__(
        self, settings: RouterSettings, registry: EngineRegistry, metrics: RouterMetrics | None = None
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.pool = EnginePool(registry, settings.engine_ttl_s)
        self.metrics = metrics or RouterMetrics()
        self.metrics.follow(self.pool.links, self.pool.is_drained)

    def _deadline(self, context: grpc.aio.ServicerContext) -> float:
        remaining = context.time_remaining()
        return time.monotonic() + (self.settings.default_timeout_s if remaining is None else remaining)

    def _attempts(self, request: rollout_pb2.GenerateRequest, deadline: float) -> _Attempts:
        return _Attempts(self.pool, request, deadline, self.settings.max_attempts, self.metrics)

    async def Generate(
        self, request: rollout_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.GenerateResponse:
        attempts = self._attempts(request, self._deadline(context))
        async with aborting(context):
            while True:
                link = await attempts.next()
                try:
                    response = await link.stub.Generate(request, timeout=attempts.remaining())
                except grpc.aio.AioRpcError as err:
                    await attempts.failed(link, err.code(), err.details() or "")
                    continue
                finally:
                    await self.pool.release(link, attempts.samples)
                self.pool.bind(request.session_id, link)
                return response
        raise AssertionError("unreachable: aborting aborts")

    async def GenerateBatch(
        self, request: rollout_pb2.GenerateBatchRequest, context: grpc.aio.ServicerContext
    ) -> bytes:
        """Each request goes where Generate would send it; each engine's share goes as one
        GenerateBatch. Requests whose share failed (UNAVAILABLE) or that the engine could not
        serve yet (FAILED_PRECONDITION) are tried again elsewhere; other failures are theirs.
        The GenerateBatchResponse is returned as its wire bytes (``register`` sends them)."""
        deadline = self._deadline(context)
        requests = list(request.requests)
        batch = _Batch(requests, [self._attempts(item, deadline) for item in requests])
        await self._dispatch(batch, list(range(len(requests))))
        return batch.reply()

    async def _dispatch(self, batch: _Batch, indices: list[int]) -> None:
        """Send these requests of the batch, each engine's share as one call, concurrently."""
        shares: dict[str, Share] = {}
        for index in indices:
            try:
                link = await batch.attempts[index].next()
            except RequestFailed as err:
                batch.answer(index, err.result())
                continue
            shares.setdefault(link.engine_id, (link, []))[1].append(index)
        await asyncio.gather(*(self._serve_share(batch, share) for share in shares.values()))

    async def _serve_share(self, batch: _Batch, share: Share) -> None:
        """One share's results; those worth another engine are sent again as soon as it returns."""
        link, indices = share
        again = []
        replies = await self._send_share(share, batch)
        records: list[memoryview] | None = None
        if isinstance(replies, _EngineReply):
            results, records = list(replies.parsed.results), replies.records
            if indices == list(range(len(batch.requests))) and all(r.code == 0 for r in results):
                batch.whole = replies.wire  # every request, in order
        else:
            results = replies
        for k, (index, reply) in enumerate(zip(indices, results, strict=True)):
            if reply.code == grpc.StatusCode.OK.value[0]:
                self.pool.bind(batch.requests[index].session_id, link)
                if records is not None:
                    batch.answers[index] = records[k]
                else:
                    batch.answer(index, reply)
                continue
            try:
                await batch.attempts[index].failed(link, status(reply.code), reply.details)
                again.append(index)
            except RequestFailed as err:
                batch.answer(index, err.result())
        if again:
            await self._dispatch(batch, again)

    async def _send_share(
        self, share: Share, batch: _Batch
    ) -> _EngineReply | list[rollout_pb2.GenerateResult]:
        """One engine's share as one GenerateBatch, its reply (an engine without it: one Generate
        each, their results); a failure of the whole call is every request's."""
        link, indices = share
        sent = rollout_pb2.GenerateBatchRequest(requests=[batch.requests[i] for i in indices])
        timeout = max(batch.attempts[i].remaining() for i in indices)
        try:
            try:
                wire = await link.generate_batch_wire(sent, timeout=timeout)
            except grpc.aio.AioRpcError as err:
                if err.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                return list(await asyncio.gather(*(_one(link, r, timeout) for r in sent.requests)))
        except grpc.aio.AioRpcError as err:
            failed = rollout_pb2.GenerateResult(code=err.code().value[0], details=err.details() or "")
            return [failed] * len(indices)
        finally:
            for index in indices:
                await self.pool.release(link, batch.attempts[index].samples)
        # the results' codes and count are all read here: their arrays stay bytes (a step's
        # reply parsed whole, every token a varint, was 40% of the router's CPU)
        reply = rollout_pb2.PackedGenerateBatchResponse.FromString(wire)
        if len(reply.results) != len(indices):
            details = f"engine {link.engine_id} answered {len(reply.results)} results for {len(indices)}"
            return [
                rollout_pb2.GenerateResult(code=grpc.StatusCode.INTERNAL.value[0], details=details)
            ] * len(indices)
        try:
            return _EngineReply(wire, reply, records(wire, RESULTS_FIELD))
        except ValueError:  # fields besides the results (a newer engine's): each result copied
            return list(rollout_pb2.GenerateBatchResponse.FromString(wire).results)

    async def GenerateStream(
        self, request: rollout_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[rollout_pb2.GenerateChunk]:
        """Relays an engine's chunks. A failure before the first chunk is retried elsewhere;
        after it, the error is passed on (the caller already holds part of the answer)."""
        attempts = self._attempts(request, self._deadline(context))
        async with aborting(context):
            while True:
                link = await attempts.next()
                relayed = False
                try:
                    async for chunk in link.stub.GenerateStream(request, timeout=attempts.remaining()):
                        relayed = True
                        yield chunk
                except grpc.aio.AioRpcError as err:
                    if relayed:
                        raise RequestFailed(
                            err.code(), f"engine {link.engine_id} failed mid-stream: {err.details()}"
                        ) from None
                    await attempts.failed(link, err.code(), err.details() or "")
                    continue
                finally:
                    await self.pool.release(link, attempts.samples)
                self.pool.bind(request.session_id, link)
                return

    async def ListEngines(
        self, request: router_pb2.ListEnginesRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ListEnginesResponse:
        engines = []
        for info in await self.registry.alive(self.settings.engine_ttl_s):
            if self.pool.is_drained(info.engine_id):
                info.state = common_pb2.ENGINE_STATE_DRAINING
            if info.state == common_pb2.ENGINE_STATE_DRAINING and not request.include_draining:
                continue
            engines.append(info)
        return router_pb2.ListEnginesResponse(engines=engines)

    async def DrainEngine(
        self, request: router_pb2.DrainEngineRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.DrainEngineResponse:
        alive = {info.engine_id: info for info in await self.registry.alive(self.settings.engine_ttl_s)}
        info = alive.get(request.engine_id)
        if info is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"engine {request.engine_id!r} is not alive in the registry"
            )
        self.pool.set_drained(request.engine_id, request.drain)
        if request.drain:
            info.state = common_pb2.ENGINE_STATE_DRAINING
        log.info("engine %s %s", request.engine_id, "drained" if request.drain else "routed to again")
        return router_pb2.DrainEngineResponse(engine=info)

    async def AbortJob(
        self, request: rollout_pb2.AbortJobRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.AbortJobEverywhereResponse:
        """Rollout.AbortJob on every engine in the view at once (drained ones too: they may still
        run the job's requests), each within the call's deadline; an engine that fails or does
        not answer in time is named, not retried (its requests end with their callers' deadlines)."""
        if not request.job_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "job_id is empty")
        with contextlib.suppress(RedisError, OSError):  # without Redis: the view as it stands
            await self.pool.refresh()  # an engine that joined since the last refresh holds requests too
        links = self.pool.links()
        timeout = max(0.0, self._deadline(context) - time.monotonic())
        for link in links:
            self.pool.acquire(link, 0)  # a retired link's channel stays open until the call ends
        try:
            replies = await asyncio.gather(
                *(link.stub.AbortJob(request, timeout=timeout) for link in links), return_exceptions=True
            )
        finally:
            for link in links:
                await self.pool.release(link, 0)
        response = router_pb2.AbortJobEverywhereResponse()
        for link, reply in zip(links, replies, strict=True):
            if isinstance(reply, rollout_pb2.AbortJobResponse):
                response.aborted += reply.aborted
                response.engine_ids.append(link.engine_id)
            else:
                response.failed_engine_ids.append(link.engine_id)
                why = (
                    f"{reply.code().name}: {reply.details()}"
                    if isinstance(reply, grpc.aio.AioRpcError)
                    else repr(reply)
                )
                log.warning("engine %s: AbortJob %s failed: %s", link.engine_id, request.job_id, why)
        log.info(
            "job %s ended: %d requests aborted on %d engines (%d failed)",
            *(request.job_id, response.aborted, len(response.engine_ids), len(response.failed_engine_ids)),
        )
        return response

    def register(self, server: grpc.aio.Server) -> list[str]:
        """Add the Router servicer to ``server``; returns the service names for health."""
        add_servicer(
            router_pb2_grpc.add_RouterServicer_to_server, self, server, wire_responses={"GenerateBatch"}
        )
        return [SERVICE_NAME]

    async def run(self, stop: asyncio.Event) -> None:
        """Refresh the local view of the engines every refresh_s until ``stop``."""
        last_prune = 0.0
        failing = False
        while not stop.is_set():
            try:
                await self.pool.refresh()
                if time.monotonic() - last_prune > PRUNE_EVERY_S:
                    await self.registry.prune(max(60.0, 10 * self.settings.engine_ttl_s))
                    last_prune = time.monotonic()
                failing = False
            except (RedisError, OSError) as err:
                if not failing:
                    log.warning("could not read the engine registry: %s", err)
                failing = True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self.settings.refresh_s)

    async def close(self) -> None:
        await self.pool.close()


def status(value: int) -> grpc.StatusCode:
    """The StatusCode of a GenerateResult's code (UNKNOWN for a value gRPC does not define)."""
    return STATUS_BY_VALUE.get(value, grpc.StatusCode.UNKNOWN)


async def _one(
    link: EngineLink, request: rollout_pb2.GenerateRequest, timeout: float
) -> rollout_pb2.GenerateResult:
    """One request of a share as a Generate, its failure as its result."""
    try:
        return rollout_pb2.GenerateResult(response=await link.stub.Generate(request, timeout=timeout))
    except grpc.aio.AioRpcError as err:
        return rollout_pb2.GenerateResult(code=err.code().value[0], details=err.details() or "")


async def serve_router(settings: RouterSettings) -> None:
    redis = connect(
        redis_target(settings),
        outage_s=settings.redis_outage_s,
        max_connections=settings.redis_max_connections,
    )
    router = Router(settings, EngineRegistry(redis))
    registry = router.metrics.registry
    try:
        with serving_service_metrics(registry, settings):
            await serve(settings, router.register, background=router.run, registry=registry)
    finally:
        await router.close()
        await redis.aclose()


def main() -> None:
    """``python -m services.router``."""
    settings = load_settings(RouterSettings)
    setup_logging(settings.service_name, settings.log_level)
    asyncio.run(serve_router(settings))
