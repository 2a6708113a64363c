"""Latency and status of every RPC a gRPC server answers, as Prometheus series.

``RpcMetrics`` is a ``grpc.aio`` server interceptor: it wraps each method's handler (unary or
streaming, either side) so that the call's whole time, from the handler's start to its last
response, lands in ``verst_rpc_seconds{service,method,code}``, and each finished call in
``verst_rpc_calls{service,method,code}``. ``grpc_server.build_server`` installs it when it is
given a registry; every verst process passes the one its ``/metrics`` serves.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram

from services.common.metrics_http import LATENCY_BUCKETS

CODES_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}

Behaviour = Callable[..., Any]


def split_method(full_method: str) -> tuple[str, str]:
    """ "/verst.v1.Router/Generate" -> ("verst.v1.Router", "Generate")."""
    service, _, method = full_method.lstrip("/").rpartition("/")
    return service or "unknown", method


def code_name(context: grpc.aio.ServicerContext, error: BaseException | None) -> str:
    """The status the call ended with: what the handler set or aborted with, else OK, CANCELLED
    (the client left) or UNKNOWN (an exception the handler raised)."""
    code = context.code()
    if isinstance(code, int):
        code = CODES_BY_VALUE.get(code, grpc.StatusCode.UNKNOWN)
    if isinstance(code, grpc.StatusCode):
        return code.name
    if error is None:
        return grpc.StatusCode.OK.name
    if isinstance(error, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED.name
    return grpc.StatusCode.UNKNOWN.name


class RpcMetrics(grpc.aio.ServerInterceptor):
    """Times every call of the server it is installed on, into ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.seconds = Histogram(
            "verst_rpc_seconds",
            "Time of an RPC this process served, from its handler's start to its last response.",
            ["service", "method", "code"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.calls = Counter(
            "verst_rpc_calls",
            "RPCs this process served, by gRPC service, method and status code.",
            ["service", "method", "code"],
            registry=registry,
        )

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:  # no such method: gRPC answers UNIMPLEMENTED, nothing to time
            return None
        service, method = split_method(handler_call_details.method)
        return self._wrap(handler, service, method)

    def _record(self, service: str, method: str, code: str, seconds: float) -> None:
        self.seconds.labels(service, method, code).observe(seconds)
        self.calls.labels(service, method, code).inc()

    def _wrap(self, handler: grpc.RpcMethodHandler, service: str, method: str) -> grpc.RpcMethodHandler:
        """The same handler with its behaviour timed (the (de)serialisers kept)."""
        if handler.unary_unary:
            kind, behaviour = grpc.unary_unary_rpc_method_handler, handler.unary_unary
        elif handler.unary_stream:
            kind, behaviour = grpc.unary_stream_rpc_method_handler, handler.unary_stream
        elif handler.stream_unary:
            kind, behaviour = grpc.stream_unary_rpc_method_handler, handler.stream_unary
        else:
            kind, behaviour = grpc.stream_stream_rpc_method_handler, handler.stream_stream
        if inspect.isasyncgenfunction(behaviour):  # responses yielded: time until the last one
            timed = self._timed_stream(behaviour, service, method)
        else:  # one response, or a streaming handler that writes with context.write()
            timed = self._timed_call(behaviour, service, method)
        return kind(
            timed,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _timed_call(self, behaviour: Behaviour, service: str, method: str) -> Behaviour:
        async def timed(request: Any, context: grpc.aio.ServicerContext) -> Any:
            started = time.perf_counter()
            error: BaseException | None = None
            try:
                result = behaviour(request, context)
                return await result if inspect.isawaitable(result) else result
            except BaseException as err:
                error = err
                raise
            finally:
                self._record(service, method, code_name(context, error), time.perf_counter() - started)

        return timed

    def _timed_stream(self, behaviour: Behaviour, service: str, method: str) -> Behaviour:
        async def timed(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            started = time.perf_counter()
            error: BaseException | None = None
            try:
                async for response in behaviour(request, context):
                    yield response
            except BaseException as err:
                error = err
                raise
            finally:
                self._record(service, method, code_name(context, error), time.perf_counter() - started)

        return timed
