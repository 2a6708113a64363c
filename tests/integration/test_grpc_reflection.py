"""gRPC server reflection on every verst service: each service's real ``register`` callback in a
server built as its process builds it (``grpc_server.build_server``), started on loopback and
asked by a reflection client (what `grpcurl list` does) for its services and a method's
descriptor."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import torch
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from services.common.bus import Bus, connect
from services.common.engine_registry import EngineRegistry
from services.common.grpc_server import HEALTH_SERVICE, Register, build_server
from services.common.redis_server import free_port
from services.reward.config import RewardSettings
from services.reward.server import register as register_reward
from services.rollout.config import EngineSettings
from services.rollout.server import EngineApp
from services.rollout.torch.backend import open_torch_engine
from services.router.config import RouterSettings
from services.router.server import Router
from services.trainer.config import TrainerSettings
from services.trainer.server import registrar
from services.trainer.worker import TrainerWorker

REFLECTION_SERVICE = "grpc.reflection.v1alpha.ServerReflection"
BASE = {HEALTH_SERVICE, REFLECTION_SERVICE}
GENERATE = ("verst.v1.GenerateRequest", "verst.v1.GenerateResponse")


def reflect(address: str, method: str) -> tuple[set[str], tuple[str, str]]:
    """(the services the server lists, (input, output) message names of ``method``), as a
    reflection client resolves them from the server alone."""
    with grpc.insecure_channel(address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = set(database.get_services())
        service_name, _, method_name = method.rpartition(".")
        found = DescriptorPool(database).FindServiceByName(service_name).FindMethodByName(method_name)
        return services, (found.input_type.full_name, found.output_type.full_name)


@asynccontextmanager
async def started(register: Register | None) -> AsyncIterator[tuple[str, list[str]]]:
    """A server built as the service's process builds it, on a free loopback port: its address
    and the names ``register`` returned."""
    server, _, names = build_server(register)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}", names
    finally:
        await server.stop(None)


async def check(register: Register | None, method: str, messages: tuple[str, str]) -> None:
    async with started(register) as (address, names):
        services, resolved = await asyncio.to_thread(reflect, address, method)  # a blocking client
    assert services == BASE | set(names)
    assert resolved == messages


async def test_reward_and_tools() -> None:
    settings = RewardSettings(port=0)

    def register(server: grpc.aio.Server) -> list[str]:
        return register_reward(server, settings)

    await check(register, "verst.v1.Reward.Score", ("verst.v1.ScoreRequest", "verst.v1.ScoreResponse"))
    await check(register, "verst.v1.Tools.Execute", ("verst.v1.ExecuteRequest", "verst.v1.ExecuteResponse"))


async def test_router(redis_url: str) -> None:
    redis = connect(redis_url)
    router = Router(RouterSettings(port=0, redis_url=redis_url), EngineRegistry(redis))
    try:
        await check(router.register, "verst.v1.Router.Generate", GENERATE)
    finally:
        await router.close()
        await redis.aclose()


async def test_rollout_engine(redis_url: str) -> None:
    settings = EngineSettings(port=free_port(), redis_url=redis_url, device="cpu")
    redis = connect(redis_url)
    app = EngineApp(settings, redis, await open_torch_engine(settings))
    try:
        await check(app.register, "verst.v1.Rollout.Generate", GENERATE)
    finally:
        await app.close()
        await redis.aclose()


async def test_trainer(bus: Bus) -> None:
    worker = TrainerWorker(bus, TrainerSettings(port=0), torch.device("cpu"))
    await check(
        registrar(worker),
        "verst.v1.Trainer.GetStatus",
        ("verst.v1.GetTrainerStatusRequest", "verst.v1.TrainerStatus"),
    )


async def test_a_service_of_health_alone() -> None:
    """The runner and a separate controller register nothing (their work is on Redis streams):
    health and reflection still answer."""
    await check(
        None,
        "grpc.health.v1.Health.Check",
        ("grpc.health.v1.HealthCheckRequest", "grpc.health.v1.HealthCheckResponse"),
    )
