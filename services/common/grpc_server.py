"""Run a gRPC service: health checking, server reflection, graceful shutdown on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from services.common.grpc_options import KEEPALIVE, KeepAlive
from services.common.long_lived import freeze_long_lived_objects
from services.common.rpc_metrics import RpcMetrics
from services.common.settings import ServiceSettings, load_settings, setup_logging

log = logging.getLogger(__name__)

Register = Callable[[grpc.aio.Server], Iterable[str]]
"""Adds servicers to a server and returns their full service names (for health and reflection)."""
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


def make_server(
    keepalive: KeepAlive = KEEPALIVE, *, registry: CollectorRegistry | None = None
) -> grpc.aio.Server:
    """A gRPC server that admits the pings of verst's channels (grpc_options.py); with a
    ``registry``, every call it serves is timed there (rpc_metrics.py)."""
    interceptors = [RpcMetrics(registry)] if registry is not None else []
    return grpc.aio.server(options=keepalive.server_options(), interceptors=interceptors)


def build_server(
    register: Register | None = None,
    keepalive: KeepAlive = KEEPALIVE,
    *,
    registry: CollectorRegistry | None = None,
) -> tuple[grpc.aio.Server, health.aio.HealthServicer, list[str]]:
    """A server holding what ``register`` adds, gRPC health and server reflection (so that
    `grpcurl list` and other reflection clients see every service); its health servicer and the
    service names ``register`` returned. Not started, no port bound. With a ``registry``, each
    call's latency and status go there (``verst_rpc_seconds``)."""
    server = make_server(keepalive, registry=registry)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(register(server)) if register else []
    reflection.enable_server_reflection([*names, HEALTH_SERVICE, reflection.SERVICE_NAME], server)
    return server, health_servicer, names


def add_servicer(
    add: Callable[[Any, Any], None], servicer: Any, server: grpc.aio.Server, *, wire_responses: Iterable[str]
) -> None:
    """``add(servicer, server)``, a generated ``add_*Servicer_to_server``, except that the methods
    named in ``wire_responses`` may return their response's wire bytes as well as a message: a
    service that passes on what it received as bytes need not parse it into a new message and
    copy it (the router's GenerateBatch: a step's samples, megabytes)."""
    wrapped = _WireResponses(server, frozenset(wire_responses))
    add(servicer, wrapped)
    if not wrapped.registered:
        raise RuntimeError(f"{add.__name__} registered no method handlers")


def _serialized(serialize: Callable[[Any], bytes]) -> Callable[[Any], bytes]:
    def wire(response: Any) -> bytes:
        return response if isinstance(response, bytes) else serialize(response)

    return wire


class _WireResponses:
    """The server as a generated ``add_*Servicer_to_server`` sees it: it registers the handlers
    with the named methods' serializers taking bytes as they are."""

    def __init__(self, server: grpc.aio.Server, methods: frozenset[str]) -> None:
        self.server = server
        self.methods = methods
        self.registered = False

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        """Built from the same handlers as the registered ones: replaced by theirs below."""

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        if unknown := self.methods - handlers.keys():
            raise ValueError(f"{service} has no methods {sorted(unknown)}")
        handlers = dict(handlers)
        for name in self.methods:
            handlers[name] = handlers[name]._replace(
                response_serializer=_serialized(handlers[name].response_serializer)
            )
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
        self.server.add_registered_method_handlers(service, handlers)
        self.registered = True


def shutdown_event() -> asyncio.Event:
    """An event set by the first SIGTERM or SIGINT."""
    event = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, event.set)
    return event


async def serve(
    settings: ServiceSettings,
    register: Register | None = None,
    *,
    background: Callable[[asyncio.Event], Awaitable[None]] | None = None,
    registry: CollectorRegistry | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT, then report NOT_SERVING, let calls finish, and return.

    ``background`` runs beside the server (a consumer loop, say) and receives
    the shutdown event; it must return soon after the event is set. ``registry``: where the
    calls' latencies go (the registry the process's /metrics serves).
    """
    stop = shutdown_event()
    server, health_servicer, names = build_server(register, registry=registry)
    port = server.add_insecure_port(f"{settings.host}:{settings.port}")
    await server.start()
    for name in ["", *names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("%s serving on %s:%d", settings.service_name, settings.host, port)
    freeze_long_lived_objects()  # the imports and the server live as long as the process
    worker = asyncio.create_task(background(stop)) if background else None
    await stop.wait()
    log.info("%s shutting down", settings.service_name)
    await health_servicer.enter_graceful_shutdown()
    if worker is not None:
        await _stop_worker(worker, settings.shutdown_grace_s)
    await server.stop(settings.shutdown_grace_s)
    log.info("%s stopped", settings.service_name)


async def _stop_worker(worker: asyncio.Task[None], grace_s: float) -> None:
    """Give background work ``grace_s`` to return, then cancel it, bounded too: a cancel
    swallowed inside a client library must not hang the shutdown."""
    done, _ = await asyncio.wait({worker}, timeout=grace_s)
    if not done:
        log.warning("background work did not stop within %.1fs; cancelling it", grace_s)
        worker.cancel()
        done, _ = await asyncio.wait({worker}, timeout=2.0)
        if not done:
            log.error("background work ignored its cancellation; shutting down without it")
            return
    if not worker.cancelled() and worker.exception() is not None:
        log.error("background work failed", exc_info=worker.exception())


def run(
    settings: ServiceSettings, register: Register | None = None, registry: CollectorRegistry | None = None
) -> None:
    """Blocking entry point for a service's ``__main__``."""
    asyncio.run(serve(settings, register, registry=registry))


def main(settings_type: type[ServiceSettings], register: Register | None = None) -> None:
    """A service's whole ``__main__``: settings from the environment, logging, serve."""
    settings = load_settings(settings_type)
    setup_logging(settings.service_name, settings.log_level)
    run(settings, register)
