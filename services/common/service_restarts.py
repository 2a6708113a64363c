"""Restarts of a local stack's services, as its supervisor (services/supervisor.py) records them.

The hash ``SERVICE_RESTARTS`` (services/common/streams.py) maps a service name (``engine-0``) to
a JSON ServiceRestart: how often it was restarted, how it last ended, and whether it is waiting
out a backoff. Only
services that have been restarted have a row. `verst up` writes it (synchronously, from its
supervisor thread); the api's GET /v1/cluster reads it and `verst status` prints it. Stacks that
share one Redis (REDIS_URL) and name their services alike share rows.
"""

from __future__ import annotations

import json
from typing import Literal

import redis
import redis.asyncio as aioredis
from pydantic import BaseModel, ConfigDict, Field

from services.common.streams import SERVICE_RESTARTS


class ServiceRestart(BaseModel):
    """One service's restart record."""

    model_config = ConfigDict(extra="forbid")
    service: str = Field(min_length=1, max_length=200)
    """The stack's name of the service process (``engine-0``, ``router``)."""
    restarts: int = Field(ge=0)
    """Restarts since the stack started (a process that ended and is waiting counts once it is started)."""
    last_exit: str = Field(max_length=200)
    """How the process last ended: ``signal SIGKILL`` or ``exit status 1``."""
    last_exit_at: float = Field(ge=0.0)
    """Unix time the supervisor saw it end."""
    state: Literal["restarting", "running"]
    """``restarting``: down, waiting out its backoff; ``running``: started again."""
    next_delay_s: float = Field(ge=0.0)
    """The backoff before the next restart, were it to end again now (doubling, capped)."""
    crash_loop: bool = False
    """It ended too often within the policy's window: restarted at the capped delay since."""


def record(client: redis.Redis, row: ServiceRestart) -> None:
    """Write one service's row (the supervisor, synchronously)."""
    client.hset(SERVICE_RESTARTS, row.service, row.model_dump_json())


def forget(client: redis.Redis, services: list[str]) -> None:
    """Drop the rows of these services (a stack starting afresh: an earlier run's rows would mislead)."""
    if services:
        client.hdel(SERVICE_RESTARTS, *services)


async def restarts(client: aioredis.Redis) -> list[ServiceRestart]:
    """Every service's row, by service name."""
    rows = await client.hgetall(SERVICE_RESTARTS)
    return sorted(
        (ServiceRestart.model_validate(json.loads(raw)) for raw in rows.values()), key=lambda row: row.service
    )
