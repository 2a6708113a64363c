"""The rollout engine process: ``verst.v1.Rollout`` over the backend ``VERST_ENGINE_BACKEND``
names in the registry of backends.py (torch: a TorchEngine in this process; sglang: SGLang
servers; or a user's ``module:function``).

``python -m services.rollout`` runs ``main()``: the Rollout service, a watcher that loads the
newest running job's checkpoints, and a heartbeat into the engine registry.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import socket
import sys

import grpc
import redis.asyncio as aioredis
import torch

from services.common.bus import connect
from services.common.engine_registry import EngineRegistry
from services.common.grpc_server import serve
from services.common.metrics_http import serving_service_metrics
from services.common.pb import common_pb2, rollout_pb2_grpc
from services.common.redis_server import free_port
from services.common.settings import load_settings, redis_target, setup_logging
from services.rollout.backends import ENGINE_BACKENDS
from services.rollout.config import EngineSettings
from services.rollout.engine_protocol import Engine
from services.rollout.metrics import EngineMetrics
from services.rollout.servicer import SERVICE_NAME, EngineInfoSource, RolloutServicer
from services.rollout.transport import DISTRIBUTED, FILESYSTEM, BroadcastReceiver
from services.rollout.watcher import Heartbeat, LoadReport, WeightLoader, WeightWatcher

log = logging.getLogger(__name__)

WATCHER_EXIT_S = 10.0
"""How long an engine that stops waits for its weight watcher (a blocking read at most)."""


class MeteredWeightLoader(WeightLoader):
    """A WeightLoader whose loads (the watcher's and LoadWeights') are counted and timed."""

    def __init__(
        self, engine: Engine, timeout_s: float, metrics: EngineMetrics, receiver: BroadcastReceiver | None
    ) -> None:
        super().__init__(engine, timeout_s, receiver)
        self.metrics = metrics

    async def load(
        self, handle: common_pb2.CheckpointHandle, mode: int, timeout_s: float | None = None
    ) -> LoadReport:
        return await self.metrics.observe_load(super().load(handle, mode, timeout_s))


WILDCARD_HOSTS = ("0.0.0.0", "::", "")
"""Listening on every interface: the address to advertise is not the one bound."""
AUTO_ADVERTISE = "auto"


def advertised_address(settings: EngineSettings) -> str:
    """Where the router reaches this engine."""
    if settings.advertise_address == AUTO_ADVERTISE:
        return own_ip_address(settings.host, settings.port)
    if settings.advertise_address:
        return settings.advertise_address
    host = socket.gethostname() if settings.host in WILDCARD_HOSTS else settings.host
    return f"{host}:{settings.port}"


def own_ip_address(host: str, port: int) -> str:
    """``ip:port`` of this host as peers dial it: the address of ``host``, or of this machine's
    hostname when ``host`` is a wildcard (in a container, the container's own address)."""
    family = socket.AF_INET6 if host == "::" else socket.AF_INET
    name = socket.gethostname() if host in WILDCARD_HOSTS else host
    try:
        infos = socket.getaddrinfo(name, port, family, socket.SOCK_STREAM)
    except OSError as err:
        raise ValueError(
            f"VERST_ENGINE_ADVERTISE_ADDRESS=auto: cannot resolve {name!r} to an address ({err}); "
            "set VERST_ENGINE_ADVERTISE_ADDRESS to host:port"
        ) from None
    ip = str(infos[0][4][0])
    if ipaddress.ip_address(ip).is_loopback and host in WILDCARD_HOSTS:
        log.warning("advertising %s: %r resolves to loopback, so only this host reaches it", ip, name)
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


class EngineApp:
    """One engine process: its Engine, the Rollout servicer and the background work."""

    def __init__(self, settings: EngineSettings, redis: aioredis.Redis, engine: Engine) -> None:
        if settings.port == 0 and settings.advertise_address in ("", AUTO_ADVERTISE):
            raise ValueError("an engine needs a fixed port (or an advertise_address host:port) to register")
        self.settings = settings
        self.engine = engine
        engine_id = settings.engine_id or f"engine-{socket.gethostname()}-{os.getpid()}"
        self.info = EngineInfoSource(engine, engine_id, advertised_address(settings))
        self.metrics = EngineMetrics(engine.status)
        self.metrics.follow_sampling(engine)
        self.receiver = receiver_for(settings, engine, engine_id)
        self.info.weight_transports = (FILESYSTEM, DISTRIBUTED) if self.receiver else (FILESYSTEM,)
        self.loader = MeteredWeightLoader(engine, settings.weight_load_timeout_s, self.metrics, self.receiver)
        self.watcher = WeightWatcher(redis, self.loader, settings.weight_poll_s)
        self.heartbeat = Heartbeat(EngineRegistry(redis), self.info, settings.heartbeat_s)
        self.servicer = RolloutServicer(
            engine,
            self.loader,
            self.info,
            self.metrics,
            version_wait_s=settings.version_wait_s,
            max_pause_s=settings.max_pause_s,
        )

    @property
    def engine_id(self) -> str:
        return self.info.engine_id

    def register(self, server: grpc.aio.Server) -> list[str]:
        """Add the Rollout servicer to ``server``; returns the service names for health."""
        rollout_pb2_grpc.add_RolloutServicer_to_server(self.servicer, server)
        return [SERVICE_NAME]

    async def run(self, stop: asyncio.Event) -> None:
        """Watch for weights and heartbeat until ``stop``; then leave the registry."""
        log.info("engine %s at %s on %s", self.engine_id, self.info.address, self.engine.describe())
        # The watcher has a stop of its own, set however this ends: a cancellation that a Redis
        # read swallows would otherwise leave it looping (its stop never set) and this waiting.
        watcher_stop = asyncio.Event()
        watching = asyncio.create_task(self.watcher.run(watcher_stop))
        try:
            await self.heartbeat.run(stop)  # returns after leaving the registry
        finally:
            self.engine.set_draining()
            watcher_stop.set()
            watching.cancel()  # a load in flight is released when the engine closes
            _, late = await asyncio.wait([watching], timeout=WATCHER_EXIT_S)
            if late:
                log.warning("the weight watcher did not end within %.0fs", WATCHER_EXIT_S)

    async def close(self) -> None:
        """Stop the engine (unfinished requests end as ABORT) and leave its weight group."""
        await self.engine.close()
        if self.receiver is not None:
            self.receiver.leave()


def receiver_for(settings: EngineSettings, engine: Engine, engine_id: str) -> BroadcastReceiver | None:
    """This engine's end of the trainer's weight groups, when it takes weights that way."""
    if not (settings.weight_transport_distributed and engine.receives_state_dicts):
        return None
    return BroadcastReceiver(engine_id, settings.weight_transport_host)


async def serve_engine(settings: EngineSettings) -> None:
    redis = connect(
        redis_target(settings),
        outage_s=settings.redis_outage_s,
        max_connections=settings.redis_max_connections,
    )
    try:
        engine = await ENGINE_BACKENDS.resolve(settings.backend).fn(settings)
        if engine is None:
            return
        try:
            app = EngineApp(settings, redis, engine)
            with serving_service_metrics(app.metrics.registry, settings):
                await serve(settings, app.register, background=app.run, registry=app.metrics.registry)
        finally:
            await engine.close()
    finally:
        await redis.aclose()


def in_process_torch(settings: EngineSettings) -> None:
    """Torch threads and device for a backend that runs the model here; exit on a bad device."""
    from services.rollout.torch.model import resolve_device  # only a backend in this process needs it

    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    try:
        resolve_device(settings.device)
    except (ValueError, RuntimeError) as err:  # e.g. cuda asked for on a machine without one
        name = EngineSettings.env_name("device")
        print(f"{settings.service_name}: invalid setting {name}: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def main() -> None:
    """``python -m services.rollout``."""
    settings = load_settings(EngineSettings)
    setup_logging(settings.service_name, settings.log_level)
    try:
        backend = ENGINE_BACKENDS.resolve(settings.backend)
    except ValueError as err:  # an unknown name, or a module:function that does not import
        print(f"{settings.service_name}: invalid setting VERST_ENGINE_BACKEND: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    problem = backend.check_settings(settings) if backend.check_settings else None
    if problem:
        print(f"{settings.service_name}: {problem}", file=sys.stderr)
        raise SystemExit(2)
    if backend.in_process:
        in_process_torch(settings)
    if settings.port == 0:  # the registry needs the real port before the server binds it
        settings = settings.model_copy(update={"port": free_port(settings.host)})
    try:  # resolved once, now: a name that does not resolve stops the process here
        settings = settings.model_copy(update={"advertise_address": advertised_address(settings)})
    except ValueError as err:
        print(f"{settings.service_name}: invalid setting {err}", file=sys.stderr)
        raise SystemExit(2) from None
    asyncio.run(serve_engine(settings))
