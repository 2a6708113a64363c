"""The controller as its own process: drives every unfinished job, serves gRPC health and
/metrics, and stops its drivers (leaving the jobs' states alone) on SIGTERM.

Run one: two controllers would both drive every job. The api then runs with
``VERST_API_CONTROLLER=false``.
"""

from __future__ import annotations

import asyncio
import functools
import logging

from services.common.bus import Bus, connect
from services.common.grpc_server import serve
from services.common.jobs import JobStore
from services.common.metrics_http import serving_service_metrics
from services.common.redis_client import RedisTarget
from services.common.settings import load_settings, redis_target, setup_logging
from services.controller.config import ControllerSettings
from services.controller.controller import Controller
from services.controller.telemetry import ControllerMetrics

log = logging.getLogger(__name__)


async def drive_jobs(
    settings: ControllerSettings, redis_url: RedisTarget, metrics: ControllerMetrics, stop: asyncio.Event
) -> None:
    """Run the controller until ``stop``, with its metrics served meanwhile."""
    bus = Bus(
        connect(redis_url, outage_s=settings.redis_outage_s, max_connections=settings.redis_max_connections)
    )
    try:
        with serving_service_metrics(metrics.registry, settings):
            store = JobStore(bus.redis, events_maxlen=settings.events_maxlen)
            await Controller(bus, store, settings, metrics).run(stop)
    finally:
        await bus.close()


def main() -> None:
    settings = load_settings(ControllerSettings)
    setup_logging(settings.service_name, settings.log_level)
    redis_url = redis_target(settings)
    metrics = ControllerMetrics()  # the gRPC server's calls are timed there too
    drive = functools.partial(drive_jobs, settings, redis_url, metrics)
    asyncio.run(serve(settings, background=drive, registry=metrics.registry))
