"""The router: the Rollout Generate contract, spread over the live engines of the registry.

A caller cannot tell the router from an engine. Each request goes to an engine serving its
job_id (when one does), the one with the fewest samples in flight through this router,
except that requests sharing a session_id stay on one engine while it is alive (its KV
cache and weights version stay consistent for a group). A connection failure (UNAVAILABLE)
drops that engine from the local view and the request is retried on another; an engine
that cannot serve it yet (FAILED_PRECONDITION: no weights, another job) is skipped for the
request. Every forwarded call carries the caller's remaining deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import grpc
from redis.exceptions import RedisError

from services.common.bus import connect
from services.common.engine_registry import EngineRegistry
from services.common.grpc_server import serve
from services.common.pb import common_pb2, rollout_pb2, router_pb2, router_pb2_grpc
from services.common.settings import load_settings, require_redis_url, setup_logging
from services.router.config import RouterSettings
from services.router.pool import EngineLink, EnginePool

log = logging.getLogger(__name__)

SERVICE_NAME = "verst.v1.Router"
PRUNE_EVERY_S = 30.0
"""How often the router deletes registry entries of engines long dead."""


class _Attempts:
    """The engines tried for one request, within its deadline and the attempt bound."""

    def __init__(self, pool: EnginePool, request: rollout_pb2.GenerateRequest, deadline: float, limit: int):
        self.pool = pool
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

    async def next(self, context: grpc.aio.ServicerContext) -> EngineLink | None:
        """The next engine to try (counted as busy), or None when there is none left."""
        if len(self.tried) >= self.limit:
            return None
        link = self.pool.pick(self.session_id, exclude=set(self.tried), job_id=self.job_id)
        if link is None and not self.tried:
            await self.pool.refresh()  # maybe an engine appeared since the last refresh
            link = self.pool.pick(self.session_id, exclude=set(), job_id=self.job_id)
        if link is None:
            return None
        if self.remaining() <= 0:
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed before an engine answered"
            )
        self.tried.append(link.engine_id)
        self.pool.acquire(link, self.samples)
        return link

    async def failed(
        self, link: EngineLink, err: grpc.aio.AioRpcError, context: grpc.aio.ServicerContext
    ) -> None:
        """Note a failed attempt; aborts the call unless another engine may do better."""
        code = err.code()
        if code == grpc.StatusCode.UNAVAILABLE:
            log.warning("engine %s at %s is unavailable: %s", link.engine_id, link.address, err.details())
            await self.pool.mark_failed(link)
        elif code != grpc.StatusCode.FAILED_PRECONDITION:  # bad input or a deadline: the same anywhere
            await context.abort(code, err.details() or code.name)
        self.last_code = code
        self.errors.append(f"{link.engine_id}: {code.name} {err.details()}")

    async def give_up(self, context: grpc.aio.ServicerContext) -> None:
        if not self.tried:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                "no live engines: none is in the registry with a heartbeat younger than the ttl, "
                "or all are draining; start one with `python -m services.rollout`",
            )
        await context.abort(
            self.last_code,
            f"no engine could serve the request after {len(self.tried)} attempt(s): "
            + "; ".join(self.errors),
        )


class Router(router_pb2_grpc.RouterServicer):
    """Generate, GenerateStream, ListEngines and DrainEngine over an EnginePool."""

    def __init__(self, settings: RouterSettings, registry: EngineRegistry) -> None:
        self.settings = settings
        self.registry = registry
        self.pool = EnginePool(registry, settings.engine_ttl_s)

    def _attempts(self, request: rollout_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> _Attempts:
        remaining = context.time_remaining()
        timeout = self.settings.default_timeout_s if remaining is None else remaining
        return _Attempts(self.pool, request, time.monotonic() + timeout, self.settings.max_attempts)

    async def Generate(
        self, request: rollout_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.GenerateResponse:
        attempts = self._attempts(request, context)
        while (link := await attempts.next(context)) is not None:
            try:
                response = await link.stub.Generate(request, timeout=attempts.remaining())
            except grpc.aio.AioRpcError as err:
                await attempts.failed(link, err, context)
                continue
            finally:
                await self.pool.release(link, attempts.samples)
            self.pool.bind(request.session_id, link)
            return response
        await attempts.give_up(context)
        raise AssertionError("unreachable: give_up aborts")

    async def GenerateStream(
        self, request: rollout_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[rollout_pb2.GenerateChunk]:
        """Relays an engine's chunks. A failure before the first chunk is retried elsewhere;
        after it, the error is passed on (the caller already holds part of the answer)."""
        attempts = self._attempts(request, context)
        while (link := await attempts.next(context)) is not None:
            relayed = False
            try:
                async for chunk in link.stub.GenerateStream(request, timeout=attempts.remaining()):
                    relayed = True
                    yield chunk
            except grpc.aio.AioRpcError as err:
                if relayed:
                    await context.abort(
                        err.code(), f"engine {link.engine_id} failed mid-stream: {err.details()}"
                    )
                await attempts.failed(link, err, context)
                continue
            finally:
                await self.pool.release(link, attempts.samples)
            self.pool.bind(request.session_id, link)
            return
        await attempts.give_up(context)

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

    def register(self, server: grpc.aio.Server) -> list[str]:
        """Add the Router servicer to ``server``; returns the service names for health."""
        router_pb2_grpc.add_RouterServicer_to_server(self, server)
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


async def serve_router(settings: RouterSettings) -> None:
    redis = connect(require_redis_url(settings), outage_s=settings.redis_outage_s)
    router = Router(settings, EngineRegistry(redis))
    try:
        await serve(settings, router.register, background=router.run)
    finally:
        await router.close()
        await redis.aclose()


def main() -> None:
    """``python -m services.router``."""
    settings = load_settings(RouterSettings)
    setup_logging(settings.service_name, settings.log_level)
    asyncio.run(serve_router(settings))
