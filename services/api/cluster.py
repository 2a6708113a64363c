"""``GET /v1/cluster``: the engines and trainers serving jobs now, as their owners record them.

Engines come from the engine registry (services/common/engine_registry.py): those whose heartbeat
is younger than ``engine_ttl_s``. Trainers are the consumers of the ``trainers`` group on
``verst:jobs`` (a trainer claims a job by reading it there and renews the claim while it trains):
each with the job it holds, if any, and how long it has been silent. Services are the restart
records of a `verst up` stack's supervisor (services/common/service_restarts.py): one row per
service restarted since the stack started, none otherwise.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI, Request
from redis.exceptions import ResponseError

from services.api.config import ApiSettings
from services.api.guard import error_responses
from services.common.engine_registry import EngineRegistry
from services.common.jobs import JobNotFoundError, JobStore
from services.common.payloads import decode_entry
from services.common.pb import common_pb2
from services.common.service_restarts import restarts
from services.common.streams import JOBS, TRAINERS_GROUP

MAX_CLAIMS = 1000
"""Most held jobs one request reads (one per trainer)."""


def engine_row(info: common_pb2.EngineInfo, now: float) -> dict[str, Any]:
    return {
        "engine_id": info.engine_id,
        "address": info.address,
        "backend": info.backend,
        "model": info.model,
        "job_id": info.job_id,
        "policy_version": info.policy_version,
        "state": common_pb2.EngineState.Name(info.state),
        "running_requests": info.running_requests,
        "queued_requests": info.queued_requests,
        "outstanding_tokens": info.outstanding_tokens,
        "heartbeat_age_s": round(max(0.0, now - info.last_heartbeat.ToNanoseconds() / 1e9), 3),
    }


async def trainer_rows(store: JobStore) -> list[dict[str, Any]]:
    """One row per consumer of the trainers' group, with the job it holds (none while it waits)."""
    redis = store.redis
    try:
        consumers = await redis.xinfo_consumers(JOBS, TRAINERS_GROUP)
        pending = await redis.xpending_range(JOBS, TRAINERS_GROUP, "-", "+", MAX_CLAIMS)
    except ResponseError:  # no trainer has created the group yet
        return []
    held: dict[str, str] = {}
    for claim in pending:
        entries = await redis.xrange(JOBS, claim["message_id"], claim["message_id"])
        if entries:
            message, _ = decode_entry(entries[0][1], common_pb2.JobSubmission, JOBS)
            if message is not None:
                held[_text(claim["consumer"])] = message.job_id
    rows = []
    for consumer in consumers:
        name = _text(consumer["name"])
        row: dict[str, Any] = {
            "trainer_id": name,
            "idle_s": consumer["idle"] / 1000,
            "job_id": held.get(name, ""),
        }
        if row["job_id"]:
            try:
                record = await store.get(row["job_id"])
                row |= {"policy_version": record.policy_version, "step": record.step, "state": record.state}
            except JobNotFoundError:
                pass
        rows.append(row)
    return sorted(rows, key=lambda row: row["trainer_id"])


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def add_cluster_route(app: FastAPI, settings: ApiSettings) -> None:
    @app.get("/v1/cluster", tags=["ops"], responses=error_responses(401, 503))
    async def cluster(request: Request) -> dict[str, Any]:
        """The live engines (id, address, model, the job and policy version they serve, state and
        load), the trainers (the job each holds, its version and step, seconds since each was
        last heard from) and the services a local stack restarted (how often, how each last ended,
        whether it is up again or crash-looping)."""
        store: JobStore = request.app.state.store
        now = time.time()
        engines = await EngineRegistry(store.redis).alive(settings.engine_ttl_s, now=now)
        return {
            "engines": [engine_row(info, now) for info in engines],
            "trainers": await trainer_rows(store),
            "services": [row.model_dump() for row in await restarts(store.redis)],
        }
