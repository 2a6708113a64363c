"""Logs over REST: the end of a job's log and of a service's log file.

A job has no log file of its own: the services that work on it log to their own files, mixed with
every other job's. Its log is its event log (services/common/events.py) rendered one line per event
(``events.log_line``: state changes, each step's metrics, evaluations, warnings, dead letters);
``after`` (an event id) gives the lines after it, which is how `verst logs <job> --follow` polls.

A service's log is the file the local stack writes for it (services/common/service_logs.py), in
VERST_API_LOG_DIR, which `verst up` sets; elsewhere (compose, Kubernetes) logs are the container
runtime's and the route answers 404. Every read is bounded by ``log_lines_limit`` lines of at most
``service_logs.MAX_LINE_BYTES`` bytes each.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated, Any

from fastapi import FastAPI, HTTPException, Query, Request, status
from fastapi import Path as PathParam
from pydantic import BaseModel, ConfigDict

from services.api.config import ApiSettings
from services.api.guard import JobId, error_responses
from services.common import service_logs
from services.common.events import EVENT_ID, log_line
from services.common.jobs import TERMINAL_STATES, JobStore

LISTED_SERVICES = 50
"""A 404 for a service without a log names at most this many that have one."""

ServiceName = Annotated[
    str,
    PathParam(pattern=service_logs.SERVICE_NAME.pattern, description="e.g. api, trainer-0, engine-0, router"),
]


class JobLogs(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True)

    job_id: str
    lines: list[str]
    """The newest events of the job, oldest first, one line each: `<UTC time> <kind> <what>`."""
    last_event_id: str | None
    """The id of the last event shown: pass it as `after` (or as the Last-Event-ID of GET
    /v1/jobs/{id}/events) to get only newer ones."""
    finished: bool
    """The job had ended when its events were read: once such an answer holds fewer lines than
    asked for, no more will come."""


class ServiceLogs(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True)

    service: str
    lines: list[str]
    """Oldest first; a line longer than 4096 bytes is cut and says its length."""
    end: int
    """Byte offset after the last line: pass it as `after` to get only what was written since."""


def _log_file(settings: ApiSettings, name: str) -> Path:
    """The service's log file; 404 saying what is missing."""
    if not settings.log_dir.strip():
        detail = "this api serves no service logs: VERST_API_LOG_DIR is not set (`verst up` sets it)"
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail)
    log_dir = Path(settings.log_dir).resolve()
    path = service_logs.log_path(log_dir, name)
    if not path.is_file() or not path.resolve().is_relative_to(log_dir):
        there = sorted(p.stem for p in log_dir.glob("*.log") if service_logs.SERVICE_NAME.match(p.stem))
        named = ", ".join(there[:LISTED_SERVICES]) or "none"
        raise HTTPException(
            status.HTTP_404_NOT_FOUND, f"no log of service {name!r} (services with logs: {named})"
        )
    return path


def add_log_routes(app: FastAPI, settings: ApiSettings) -> None:
    def lines_query() -> Any:  # a fresh Query per route; an alias would be a forward reference here
        return Query(100, ge=1, le=settings.log_lines_limit, description="How many lines at most.")

    @app.get("/v1/jobs/{job_id}/logs", tags=["logs"], responses=error_responses(401, 404, 503))
    async def job_logs(
        job_id: JobId,
        request: Request,
        lines: int = lines_query(),
        after: Annotated[
            str | None,
            Query(pattern=EVENT_ID.pattern, description="Only the events after this id (a `last_event_id`)."),
        ] = None,
    ) -> JobLogs:
        """The job's newest `lines` events as log lines, oldest first, or with `after`, the first
        `lines` events after that one (a job has no log file of its own: services log to theirs,
        GET /v1/services/{name}/logs)."""
        store: JobStore = request.app.state.store
        state = await store.state(job_id)  # before the events: a finished job's last one is in by then
        if state is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"no job {job_id!r}")
        if after is None:  # the request pool: the event streams keep theirs
            events = await store.events.tail(job_id, lines)
        else:
            events = await store.events.read(job_id, after, count=lines)
        return JobLogs(
            job_id=job_id,
            lines=[log_line(event.data()) for event in events],
            last_event_id=events[-1].id if events else after,
            finished=state in TERMINAL_STATES,
        )

    @app.get("/v1/services/{name}/logs", tags=["logs"], responses=error_responses(401, 404))
    async def service_log(
        name: ServiceName,
        lines: int = lines_query(),
        after: Annotated[
            int | None, Query(ge=0, description="Lines from this byte offset on (an `end` from before).")
        ] = None,
    ) -> ServiceLogs:
        """The end of a service's log file as the local stack writes it (`verst up`), or with
        `after`, the lines written since that offset. 404 when the api has no log directory or
        the service no log there (the detail names the services that have one)."""
        path = _log_file(settings, name)
        if after is None:
            tail = await asyncio.to_thread(service_logs.tail, path, lines)
        else:
            tail = await asyncio.to_thread(service_logs.after, path, after, lines)
        return ServiceLogs(service=name, lines=tail.lines, end=tail.end)
