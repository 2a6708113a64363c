"""The REST api (FastAPI): submit, list, inspect and cancel jobs; health and Prometheus metrics.

The job controller (services/controller/controller.py) and the health monitor
(services/api/health.py) run as tasks of this process, started and stopped with
the app's lifespan. The request handlers reach Redis through a pool of their own
(``health.request_client``); the controller and its drivers through the bus's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import FastAPI, HTTPException, Query, Request, Response, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict
from redis.exceptions import RedisError

from services.api.artefacts import add_artefact_routes
from services.api.cluster import add_cluster_route
from services.api.config import ApiSettings
from services.api.events import add_events_route, event_client
from services.api.exports import add_export_route
from services.api.guard import JobId, error_responses, guard
from services.api.health import Health, RedisErrorHandler, Watchdog, request_client
from services.api.logs import add_log_routes
from services.api.site import add_dashboard
from services.api.spec_checks import SpecChecker
from services.api.telemetry import ApiMetrics
from services.common.bus import Bus, connect
from services.common.config import JobSpec
from services.common.events import EventLog
from services.common.jobs import CANCELLED, JobBrief, JobNotFoundError, JobRecord, JobStore, MetricRow
from services.common.long_lived import freeze_long_lived_objects
from services.common.settings import load_settings, redis_target
from services.controller.config import ControllerSettings
from services.controller.controller import Controller
from services.controller.telemetry import ControllerMetrics


class View(BaseModel):
    """Base of the api's response models: field docstrings become their OpenAPI descriptions."""

    model_config = ConfigDict(use_attribute_docstrings=True)


class JobSummary(View):
    """A job as lists show it: everything but its spec."""

    job_id: str
    name: str
    state: str
    """JobState name: JOB_STATE_QUEUED, _RUNNING, _SUCCEEDED, _FAILED or _CANCELLED."""
    policy_version: int
    """Newest policy version the trainer published."""
    step: int
    """Trainer step of that version."""
    reason: str
    """Why the job failed or was cancelled (or a note on a success)."""
    submitted_at: datetime
    updated_at: datetime
    metrics: dict[str, float]
    """Latest value of every metric, keyed "source/name" (e.g. "eval/accuracy", "trainer/loss")."""

    @classmethod
    def fields_of(cls, record: JobBrief) -> dict[str, Any]:
        return {
            "job_id": record.job_id,
            "name": record.name,
            "state": record.state,
            "policy_version": record.policy_version,
            "step": record.step,
            "reason": record.reason,
            "submitted_at": datetime.fromtimestamp(record.submitted_at, UTC),
            "updated_at": datetime.fromtimestamp(record.updated_at, UTC),
            "metrics": record.metrics,
        }

    @classmethod
    def of(cls, record: JobBrief) -> JobSummary:
        # The store's values are typed already; validating each of a list's rows again costs
        # a list request a fifth of its time.
        return cls.model_construct(**cls.fields_of(record))


class JobView(JobSummary):
    """A job as the api shows it, with its spec."""

    spec: JobSpec

    @classmethod
    def of(cls, record: JobRecord) -> JobView:
        return cls(**cls.fields_of(record), spec=record.spec)


class JobList(View):
    jobs: list[JobSummary]
    """Newest first, without their specs (GET /v1/jobs/{job_id} has the spec)."""


class RenderedLists:
    """Job lists as sent, by limit, each with the digest of the jobs it shows
    (``JobStore.list_digest``): while they are unchanged, a list is sent again without reading or
    rendering its jobs, and the digest is its ETag. The least recently used beyond MAX_ENTRIES
    limits are dropped."""

    MAX_ENTRIES = 8

    def __init__(self) -> None:
        self._bodies: OrderedDict[int, tuple[str, bytes]] = OrderedDict()

    async def body(self, store: JobStore, limit: int) -> tuple[str, bytes]:
        """(digest, JSON body) of the newest ``limit`` jobs now."""
        digest = await store.list_digest(limit)
        cached = self._bodies.get(limit)
        if cached is None or cached[0] != digest:
            briefs = await store.list_briefs(limit)  # read after the digest: never older than it
            rendered = JobList.model_construct(jobs=[JobSummary.of(brief) for brief in briefs])
            cached = self._bodies[limit] = (digest, rendered.model_dump_json().encode())
        self._bodies.move_to_end(limit)
        while len(self._bodies) > self.MAX_ENTRIES:
            self._bodies.popitem(last=False)
        return cached


def etag_matches(request: Request, etag: str) -> bool:
    """Whether the request's If-None-Match names ``etag`` (or is ``*``)."""
    tags = {tag.strip().removeprefix("W/") for tag in request.headers.get("if-none-match", "").split(",")}
    return etag in tags or "*" in tags


class MetricPoint(View):
    step: int
    policy_version: int
    source: str
    """Who measured it: "trainer", "eval", ..."""
    values: dict[str, float]
    time: datetime

    @classmethod
    def of(cls, row: MetricRow) -> MetricPoint:
        return cls(
            step=row.step,
            policy_version=row.policy_version,
            source=row.source,
            values=row.values,
            time=datetime.fromtimestamp(row.time, UTC),
        )


class MetricHistory(View):
    job_id: str
    points: list[MetricPoint]
    """Oldest first."""


def create_app(
    settings: ApiSettings,
    *,
    exit_when_unhealthy: bool = False,
    controller: ControllerSettings | None = None,
) -> FastAPI:
    """The api; with ``exit_when_unhealthy`` (``python -m services.api``) a watchdog ends the
    process once it has been unhealthy for ``unhealthy_exit_s``. With ``settings.controller`` it
    runs the job controller, with ``controller`` settings or those of the environment."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        url = redis_target(settings)
        bus = Bus(
            connect(url, outage_s=settings.redis_outage_s, max_connections=settings.redis_max_connections)
        )
        requests = request_client(url, settings)
        app.state.store = JobStore(requests, events_maxlen=settings.events_maxlen)
        app.state.metrics = ApiMetrics(settings.metrics_refresh_s)
        app.state.controller = None
        app.state.event_log = EventLog(event_client(url, settings), maxlen=settings.events_maxlen)
        app.state.stopping = stop = asyncio.Event()
        tasks: list[asyncio.Task[None]] = []
        if settings.controller:
            driving = controller or load_settings(ControllerSettings)
            store = JobStore(bus.redis, events_maxlen=settings.events_maxlen)
            app.state.controller = Controller(bus, store, driving, ControllerMetrics())
            tasks.append(asyncio.create_task(app.state.controller.run(stop), name="controller"))
        app.state.health = health = Health(requests, settings, app.state.controller)
        await health.check()
        tasks.append(asyncio.create_task(health.run(stop), name="health"))
        watchdog = None
        if exit_when_unhealthy and settings.unhealthy_exit_s > 0:
            watchdog = Watchdog(health, settings.unhealthy_exit_s)
            watchdog.start()
        freeze_long_lived_objects()  # the imports and the app live as long as the process
        try:
            yield
        finally:
            if watchdog is not None:
                watchdog.stop()
            stop.set()
            for task in tasks:
                await task
            await bus.close()
            await requests.aclose()
            await app.state.event_log.redis.aclose()

    app = FastAPI(
        title="verst",
        version="0.1.0",
        summary="RL post-training jobs over REST",
        lifespan=lifespan,
        redirect_slashes=False,  # `/v1/jobs/` is a 404, not a 307 to a route that says otherwise
    )
    guard(app, settings)
    app.add_exception_handler(RedisError, RedisErrorHandler())
    _add_job_routes(app, settings)
    add_export_route(app, settings)
    add_events_route(app, settings)
    add_artefact_routes(app, settings)
    add_log_routes(app, settings)
    _add_ops_routes(app, settings)
    add_cluster_route(app, settings)
    add_dashboard(app)
    return app


def _store(request: Request) -> JobStore:
    store: JobStore = request.app.state.store
    return store


async def _record(request: Request, job_id: str) -> JobRecord:
    try:
        return await _store(request).get(job_id)
    except JobNotFoundError:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no job {job_id!r}") from None


async def _check(checker: SpecChecker | None, spec: JobSpec) -> None:
    """422 naming each field of ``spec`` that the submission checks (spec_checks.py) refuse."""
    if checker is None:
        return
    problems = await checker.check(spec)
    if problems:
        errors = [
            {"type": "spec_check", "loc": ("body", *path), "msg": message, "input": _value_at(spec, path)}
            for path, message in problems
        ]
        raise RequestValidationError(errors)


def _value_at(spec: JobSpec, path: tuple[str, ...]) -> Any:
    value: Any = spec
    for part in path:  # a section's field, a key of a mapping (eval.sets.<name>), an index of a list
        if isinstance(value, list):
            value = value[int(part)]
        else:
            value = value[part] if isinstance(value, dict) else getattr(value, part)
    return value


def _add_job_routes(app: FastAPI, settings: ApiSettings) -> None:
    checker = SpecChecker(settings) if settings.check_specs else None

    @app.post(
        "/v1/jobs",
        status_code=status.HTTP_201_CREATED,
        tags=["jobs"],
        responses=error_responses(400, 401, 413, 503),
    )
    async def submit_job(spec: JobSpec, request: Request) -> JobView:
        """Queue a job. A bad spec is a 422 whose `detail[].loc` is the path of each bad field: the
        JobSpec's own rules, then the checks against the world (paths and their roots, the model and
        data, prompt lengths, the reward service and its verifier)."""
        await _check(checker, spec)
        return JobView.of(await _store(request).create(spec))

    lists = RenderedLists()
    list_responses = {
        **error_responses(401, 503),
        304: {"description": "The list is unchanged since the ETag in If-None-Match."},
    }

    @app.get("/v1/jobs", tags=["jobs"], response_model=JobList, responses=list_responses)
    async def list_jobs(request: Request, limit: int = Query(100, ge=1, le=settings.list_limit)) -> Response:
        """The newest jobs, newest first, as summaries (no spec). The ETag changes whenever a job
        of the list does; send it back as If-None-Match to get a 304 while nothing changed."""
        digest, body = await lists.body(_store(request), limit)
        etag = f'"{digest}"'
        if etag_matches(request, etag):
            return Response(status_code=status.HTTP_304_NOT_MODIFIED, headers={"ETag": etag})
        return Response(body, media_type="application/json", headers={"ETag": etag})

    @app.get("/v1/jobs/{job_id}", tags=["jobs"], responses=error_responses(401, 404, 503))
    async def get_job(job_id: JobId, request: Request) -> JobView:
        """One job: state, policy version, step, reason and latest metrics."""
        return JobView.of(await _record(request, job_id))

    @app.get("/v1/jobs/{job_id}/metrics", tags=["jobs"], responses=error_responses(401, 404, 503))
    async def job_metrics(
        job_id: JobId,
        request: Request,
        source: Annotated[str | None, Query(max_length=64, description='e.g. "eval" or "trainer"')] = None,
        limit: Annotated[int, Query(ge=1, le=100_000)] = 10_000,
    ) -> MetricHistory:
        """Every metric the job reported, per step, oldest first (optionally of one source)."""
        try:
            rows = await _store(request).history(job_id, source=source, limit=limit)
        except JobNotFoundError:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"no job {job_id!r}") from None
        return MetricHistory(job_id=job_id, points=[MetricPoint.of(row) for row in rows])

    @app.post("/v1/jobs/{job_id}/cancel", tags=["jobs"], responses=error_responses(401, 404, 409, 413, 503))
    async def cancel_job(job_id: JobId, request: Request) -> JobView:
        """Cancel a queued or running job: no more prompts are issued. 409 if it already finished."""
        record = await _record(request, job_id)
        if not await _store(request).set_state(job_id, CANCELLED, "cancelled by the user"):
            record = await _record(request, job_id)
            raise HTTPException(status.HTTP_409_CONFLICT, f"job {job_id!r} already finished: {record.state}")
        return JobView.of(await _record(request, record.job_id))


def _add_ops_routes(app: FastAPI, settings: ApiSettings) -> None:
    @app.get("/healthz", tags=["ops"], responses={503: {"description": "The api cannot serve now."}})
    async def healthz(request: Request) -> JSONResponse:
        """200 while the api can serve: Redis answers a ping through the request pool and the
        controller keeps polling. 503 with the problems otherwise."""
        health: Health = request.app.state.health
        problems = health.current()
        body: dict[str, Any] = {"status": "unhealthy" if problems else "ok", "service": settings.service_name}
        if problems:
            body["problems"] = problems
        return JSONResponse(body, 503 if problems else 200)

    @app.get("/metrics", tags=["ops"], response_class=Response, responses=error_responses(503))
    async def prometheus_metrics(request: Request) -> Response:
        """Prometheus text: jobs by state, policy version and latest metrics of running jobs."""
        metrics: ApiMetrics = request.app.state.metrics
        await metrics.refresh(_store(request))
        controller: Controller | None = request.app.state.controller
        others = [controller.metrics.registry] if controller is not None else []
        return Response(metrics.render(*others), media_type="text/plain; version=0.0.4; charset=utf-8")
