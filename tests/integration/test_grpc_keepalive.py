"""A call that outlasts many client pings lives as long as its deadline on a verst server, and
(the control) dies of GOAWAY "too_many_pings" on a server with gRPC's default ping policy. The
intervals are shortened through the shared policy (grpc_options.KeepAlive) so this takes seconds;
gRPC core sends a client's pings at most once a second, hence the 1 s interval."""

from __future__ import annotations

import asyncio
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.grpc_client import channel
from services.common.grpc_options import KeepAlive
from services.common.grpc_server import make_server

POLICY = KeepAlive(ping_interval_ms=1000, ping_timeout_ms=2000)
CALL_S = 6.0
"""Six client pings: the default policy closes the connection at the third early one."""


class SlowHealth(health_pb2_grpc.HealthServicer):
    """A Check that sends nothing for CALL_S seconds, like a long Generate."""

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: object
    ) -> health_pb2.HealthCheckResponse:
        await asyncio.sleep(CALL_S)
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


async def long_call(server: grpc.aio.Server) -> tuple[str, float]:
    """The outcome of one CALL_S call ("ok", or the status code and details) and its seconds."""
    health_pb2_grpc.add_HealthServicer_to_server(SlowHealth(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    started = time.monotonic()
    try:
        async with channel(f"127.0.0.1:{port}", POLICY) as chan:
            stub = health_pb2_grpc.HealthStub(chan)
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=4 * CALL_S)
            return "ok", time.monotonic() - started
    except grpc.aio.AioRpcError as err:
        return f"{err.code().name}: {err.details()}", time.monotonic() - started
    finally:
        await server.stop(0)


async def test_a_long_quiet_call_outlives_many_pings_on_a_verst_server() -> None:
    verst, default = await asyncio.gather(long_call(make_server(POLICY)), long_call(grpc.aio.server()))
    assert verst[0] == "ok" and verst[1] >= CALL_S, verst
    assert default[0] == "UNAVAILABLE: Too many pings" and default[1] < CALL_S, default
