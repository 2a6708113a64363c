"""``GET /v1/jobs/{job_id}/events``: a job's event log (services/common/events.py) as Server-Sent
Events, served with sse-starlette.

Each event's SSE ``id`` is its entry id in the log and its ``event`` its kind (``state``,
``metrics``, ``evaluation``, ``warning``, ``dead_letter``); ``data`` is its JSON. A client that
reconnects with ``Last-Event-ID`` gets exactly the events after that one. The stream of a job that
finished ends after its terminal state event; while nothing happens, a comment line goes out every
``events_heartbeat_s``.

The streams wait on a Redis pool of their own (``event_connections``), so watchers never take the
connections of the other requests; each read blocks READ_BLOCK_MS at most, then the stream looks
at the api's stop flag and the job's state again.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Annotated, Any

import redis.asyncio as aioredis
from fastapi import FastAPI, Header, HTTPException, Request, status
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from sse_starlette import EventSourceResponse, ServerSentEvent

from services.api.config import ApiSettings
from services.api.guard import JobId, error_responses
from services.common.events import START, EventLog
from services.common.jobs import JobStore
from services.common.redis_client import AsyncClient, RedisTarget, async_client

log = logging.getLogger(__name__)

READ_BLOCK_MS = 1000
"""Longest wait of one read for the next event: how often a stream checks the stop flag."""
READ_COUNT = 200
"""Most events one read takes (a client catching up gets them in batches of this)."""
SEND_TIMEOUT_S = 30.0
"""A client that takes no bytes for this long is dropped (it may reconnect and resume)."""

LastEventId = Annotated[
    str | None,
    Header(
        pattern=r"^\d{1,20}-\d{1,20}$",
        description="Resume after this event (the id of the last one received): only newer events come.",
    ),
]


def event_client(url: str | RedisTarget, settings: ApiSettings) -> AsyncClient:
    """The event streams' Redis client: ``event_connections`` at most, each read's reply due within
    its block time plus ``request_timeout_s``."""
    timeout = settings.request_timeout_s
    return async_client(
        url,
        max_connections=settings.event_connections,
        pool_wait_s=timeout,
        socket_timeout_s=timeout + READ_BLOCK_MS / 1000,
        socket_connect_timeout_s=timeout,
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), retries=2),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
        cluster_retries=2,
        pool_class=aioredis.BlockingConnectionPool,
    )


async def follow(
    events: EventLog, store: JobStore, job_id: str, after: str, stopping: asyncio.Event
) -> AsyncIterator[ServerSentEvent]:
    """The job's events after ``after``, as they come, until its terminal state event (or the
    api stops, or Redis fails: the client reconnects with Last-Event-ID)."""
    try:
        while not stopping.is_set():
            # Read the state first: a finished job's terminal event is in the log by then (the
            # store logs it with the change), so a read that finds nothing more means the end.
            finished = await store.is_terminal(job_id)
            block = None if finished else READ_BLOCK_MS
            batch = await events.read(job_id, after, count=READ_COUNT, block_ms=block)
            for event in batch:
                yield ServerSentEvent(data=json.dumps(event.data()), id=event.id, event=event.kind)
                after = event.id
                if event.terminal:
                    return
            if finished and not batch:
                return
    except RedisError as err:
        log.warning("events of %s: ending the stream after %s: %s", job_id, after, err)


def add_events_route(app: FastAPI, settings: ApiSettings) -> None:
    responses: dict[int | str, dict[str, Any]] = {
        200: {
            "content": {"text/event-stream": {}},
            "description": "Server-Sent Events: `id` the event id, `event` its kind, `data` its JSON.",
        },
        **error_responses(401, 404, 503),
    }

    @app.get(
        "/v1/jobs/{job_id}/events", tags=["jobs"], response_class=EventSourceResponse, responses=responses
    )
    async def job_events(job_id: JobId, request: Request, last_event_id: LastEventId = None) -> Any:
        """The job's events as Server-Sent Events, oldest first, then live: state changes, each
        step's metrics (one event per source), evaluations, warnings and dead letters. Each
        event's `id` resumes: send it back as `Last-Event-ID` to get only the events after it.
        A finished job's stream ends after its terminal state event."""
        store: JobStore = request.app.state.store
        if await store.state(job_id) is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"no job {job_id!r}")
        state = request.app.state
        stream = follow(state.event_log, store, job_id, last_event_id or START, state.stopping)
        return EventSourceResponse(stream, ping=settings.events_heartbeat_s, send_timeout=SEND_TIMEOUT_S)
