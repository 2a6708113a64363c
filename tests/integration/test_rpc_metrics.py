"""The RPC latency interceptor (services/common/rpc_metrics.py) on a real grpc.aio server on
loopback, built as every verst process builds its server (``grpc_server.build_server`` with the
process's registry): gRPC health's calls, and a tiny servicer whose methods stream either way."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from services.common.grpc_server import HEALTH_SERVICE, build_server

TOY = "verst.test.Toy"


def _identity(data: bytes) -> bytes:
    return data


async def count(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    """unary_stream as an async generator: one response per byte of the request; "x" fails."""
    for i, byte in enumerate(request):
        if byte == ord("x"):
            raise RuntimeError("a bug in the handler")
        await asyncio.sleep(0.01)
        yield str(i).encode()


async def total(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
    """stream_unary: how many bytes came in; an empty one aborts INVALID_ARGUMENT."""
    size = 0
    async for request in requests:
        if not request:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty message")
        size += len(request)
    return str(size).encode()


async def echo(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    """stream_stream as an async generator."""
    async for request in requests:
        yield request


def register_toy(server: grpc.aio.Server) -> list[str]:
    handlers = {
        "Count": grpc.unary_stream_rpc_method_handler(count, _identity, _identity),
        "Total": grpc.stream_unary_rpc_method_handler(total, _identity, _identity),
        "Echo": grpc.stream_stream_rpc_method_handler(echo, _identity, _identity),
    }
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(TOY, handlers)])
    return [TOY]


@pytest.fixture
async def served() -> AsyncIterator[tuple[grpc.aio.Channel, CollectorRegistry]]:
    registry = CollectorRegistry()
    server, health, _ = build_server(register_toy, registry=registry)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield channel, registry
    finally:
        await channel.close()
        await server.stop(None)


def calls(registry: CollectorRegistry, service: str, method: str, code: str) -> float:
    labels = {"service": service, "method": method, "code": code}
    value = registry.get_sample_value("verst_rpc_calls_total", labels)
    timed = registry.get_sample_value("verst_rpc_seconds_count", labels)
    assert value == timed, "every call is both counted and timed"
    return value or 0.0


async def test_unary_calls_are_timed_with_their_status(
    served: tuple[grpc.aio.Channel, CollectorRegistry],
) -> None:
    channel, registry = served
    stub = health_pb2_grpc.HealthStub(channel)
    for _ in range(3):
        await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
    assert failed.value.code() == grpc.StatusCode.NOT_FOUND
    assert calls(registry, HEALTH_SERVICE, "Check", "OK") == 3
    assert calls(registry, HEALTH_SERVICE, "Check", "NOT_FOUND") == 1
    labels = {"service": HEALTH_SERVICE, "method": "Check", "code": "OK"}
    assert 0 < registry.get_sample_value("verst_rpc_seconds_sum", labels) < 5


async def test_a_stream_is_timed_to_its_last_response(
    served: tuple[grpc.aio.Channel, CollectorRegistry],
) -> None:
    channel, registry = served
    counting = channel.unary_stream(f"/{TOY}/Count")
    responses = [response async for response in counting(b"abcde", timeout=5)]
    assert responses == [b"0", b"1", b"2", b"3", b"4"]
    assert calls(registry, TOY, "Count", "OK") == 1
    labels = {"service": TOY, "method": "Count", "code": "OK"}
    assert registry.get_sample_value("verst_rpc_seconds_sum", labels) >= 0.05  # five 10 ms sleeps
    with pytest.raises(grpc.aio.AioRpcError):
        async for _ in counting(b"abx", timeout=5):
            pass
    assert calls(registry, TOY, "Count", "UNKNOWN") == 1


async def test_client_streams_and_aborts(served: tuple[grpc.aio.Channel, CollectorRegistry]) -> None:
    channel, registry = served
    totalling = channel.stream_unary(f"/{TOY}/Total")
    assert await totalling(iter([b"ab", b"cde"]), timeout=5) == b"5"
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await totalling(iter([b"ab", b""]), timeout=5)
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    echoing = channel.stream_stream(f"/{TOY}/Echo")
    assert [r async for r in echoing(iter([b"a", b"b"]), timeout=5)] == [b"a", b"b"]
    assert calls(registry, TOY, "Total", "OK") == 1
    assert calls(registry, TOY, "Total", "INVALID_ARGUMENT") == 1
    assert calls(registry, TOY, "Echo", "OK") == 1


async def test_a_call_the_client_leaves_is_cancelled(
    served: tuple[grpc.aio.Channel, CollectorRegistry],
) -> None:
    """Health.Watch writes with context.write() (a coroutine, not a generator) and never ends by
    itself: the client's cancel ends it, and it is recorded as CANCELLED."""
    channel, registry = served
    watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
    first = await watch.read()
    assert first.status == health_pb2.HealthCheckResponse.SERVING
    watch.cancel()
    for _ in range(100):  # the server learns of the cancel shortly after
        if calls(registry, HEALTH_SERVICE, "Watch", "CANCELLED"):
            break
        await asyncio.sleep(0.02)
    assert calls(registry, HEALTH_SERVICE, "Watch", "CANCELLED") == 1


async def test_an_unknown_method_is_not_recorded(served: tuple[grpc.aio.Channel, CollectorRegistry]) -> None:
    channel, registry = served
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await channel.unary_unary(f"/{TOY}/Nothing")(b"", timeout=5)
    assert failed.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert all(sample.labels.get("method") != "Nothing" for m in registry.collect() for sample in m.samples)
