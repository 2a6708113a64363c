"""The trainer process: the ``verst.v1.Trainer`` gRPC service beside the job consumer loop.

One process by default. Under a launcher (``torchrun --nproc_per_node=N -m services.trainer``)
rank 0 is this service and the other ranks follow it (services/trainer/leader.py).
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

import grpc
import torch

from services.common.bus import Bus
from services.common.bus_lag import BusLagCollector
from services.common.grpc_server import Register, serve
from services.common.metrics_http import serving_service_metrics
from services.common.pb import trainer_pb2, trainer_pb2_grpc
from services.common.settings import load_settings, redis_target, setup_logging
from services.trainer.config import TrainerSettings
from services.trainer.distributed import World, world_from_env
from services.trainer.job_control import CheckpointUnavailable
from services.trainer.leader import follow, start_leader
from services.trainer.telemetry import TrainerMetrics
from services.trainer.worker import NoJobError, TrainerWorker

SERVICE_NAME = trainer_pb2.DESCRIPTOR.services_by_name["Trainer"].full_name


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    """Status and control of one trainer; training data itself arrives on Redis streams."""

    def __init__(self, worker: TrainerWorker) -> None:
        self.worker = worker

    async def GetStatus(
        self, request: trainer_pb2.GetTrainerStatusRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.TrainerStatus:
        return self.worker.progress.to_proto()

    async def SaveCheckpoint(
        self, request: trainer_pb2.SaveCheckpointRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.SaveCheckpointResponse:
        try:
            handle = await self.worker.checkpoint(request.job_id)
        except (NoJobError, CheckpointUnavailable) as err:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        return trainer_pb2.SaveCheckpointResponse(handle=handle)

    async def Stop(
        self, request: trainer_pb2.StopTrainerRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.StopTrainerResponse:
        # save_checkpoint needs no work: the job stops at a step boundary and writes a
        # durable checkpoint of its weights before it ends.
        try:
            handle = await self.worker.stop_job(request.reason)
        except NoJobError as err:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        except TimeoutError as err:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(err))
        return trainer_pb2.StopTrainerResponse(last_checkpoint=handle)


def registrar(worker: TrainerWorker) -> Register:
    """The ``register`` callback of grpc_server.serve for this worker's servicer."""

    def register(server: grpc.aio.Server) -> list[str]:
        trainer_pb2_grpc.add_TrainerServicer_to_server(TrainerServicer(worker), server)
        return [SERVICE_NAME]

    return register


def trainer_device(settings: TrainerSettings) -> torch.device:
    from services.trainer.policy import select_device

    try:
        return select_device(settings.device)
    except RuntimeError as err:
        raise SystemExit(f"{settings.service_name}: {err}") from None


def warm_up(device: torch.device) -> None:
    """Blocking: what every job needs first, done before the trainer waits for jobs, so that it
    takes over a dead trainer's job in seconds: transformers' model classes (a slow import) and
    DeepSpeed's process group (once per process; already there under run_rank)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    from services.trainer.policy import init_distributed

    init_distributed(device)


async def serve_trainer(settings: TrainerSettings, device: torch.device | None = None) -> None:
    """Warm up, then serve the Trainer service and train claimed jobs until SIGTERM/SIGINT."""
    device = device or trainer_device(settings)
    await asyncio.to_thread(warm_up, device)
    redis_url = redis_target(settings)
    bus = Bus.from_url(
        redis_url,
        outage_s=settings.redis_outage_s,
        max_connections=settings.redis_max_connections,
        max_deliveries=settings.max_deliveries,
    )
    metrics = TrainerMetrics(BusLagCollector(redis_url))
    worker = TrainerWorker(bus, settings, device, metrics)
    try:
        with serving_service_metrics(metrics.registry, settings):
            await serve(settings, registrar(worker), background=worker.run, registry=metrics.registry)
    finally:
        metrics.close()
        await bus.close()


def run_rank(settings: TrainerSettings, world: World) -> None:
    """One of several trainer processes: join the group, then lead (rank 0) or follow."""
    from services.trainer.policy import init_distributed

    device = trainer_device(settings)
    if world.leader:
        redis_target(settings)  # exit now on a missing or bad REDIS_URL
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    init_distributed(device, timedelta(seconds=settings.distributed_timeout_s))
    if not world.leader:
        follow(device)
    else:
        leader = start_leader(settings.distributed_timeout_s)
        try:
            asyncio.run(serve_trainer(settings, device))
        finally:
            leader.close()  # the followers exit once the step in progress, if any, is over
    torch.distributed.destroy_process_group()


def main() -> None:
    """``python -m services.trainer``: settings from VERST_TRAINER_* and REDIS_URL; under
    torchrun or the deepspeed launcher (WORLD_SIZE > 1), one rank of a data parallel trainer."""
    settings = load_settings(TrainerSettings)
    try:
        world = world_from_env()
    except ValueError as err:
        raise SystemExit(f"{settings.service_name}: {err}") from None
    name = settings.service_name if world.leader else f"{settings.service_name}[{world.rank}]"
    setup_logging(name, settings.log_level)
    if world.size > 1:
        run_rank(settings, world)
        return
    redis_target(settings)
    asyncio.run(serve_trainer(settings))
