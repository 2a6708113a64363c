"""The REST api (FastAPI): submit, list, inspect and cancel jobs; health and Prometheus metrics.

The job controller (services/api/controller.py) runs as a task of this process,
started and stopped with the app's lifespan.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import FastAPI, HTTPException, Path, Query, Request, Response, status
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict

from services.api.config import ApiSettings
from services.api.controller import Controller
from services.api.guard import error_responses, guard
from services.api.spec_checks import SpecChecker
from services.api.telemetry import ApiMetrics
from services.common.bus import Bus, connect
from services.common.config import JobSpec
from services.common.jobs import CANCELLED, JobNotFoundError, JobRecord, JobStore, MetricRow
from services.common.settings import require_redis_url

JobId = Annotated[str, Path(min_length=1, max_length=200, description="The job id, e.g. addition-1a2b3c4d.")]


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
    def fields_of(cls, record: JobRecord) -> dict[str, Any]:
        return {
            "job_id": record.job_id,
            "name": record.spec.name,
            "state": record.state,
            "policy_version": record.policy_version,
            "step": record.step,
            "reason": record.reason,
            "submitted_at": datetime.fromtimestamp(record.submitted_at, UTC),
            "updated_at": datetime.fromtimestamp(record.updated_at, UTC),
            "metrics": record.metrics,
        }

    @classmethod
    def of(cls, record: JobRecord) -> JobSummary:
        return cls(**cls.fields_of(record))


class JobView(JobSummary):
    """A job as the api shows it, with its spec."""

    spec: JobSpec

    @classmethod
    def of(cls, record: JobRecord) -> JobView:
        return cls(**cls.fields_of(record), spec=record.spec)


class JobList(View):
    jobs: list[JobSummary]
    """Newest first, without their specs (GET /v1/jobs/{job_id} has the spec)."""


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


def create_app(settings: ApiSettings) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        bus = Bus(connect(require_redis_url(settings), outage_s=settings.redis_outage_s))
        app.state.store = JobStore(bus.redis)
        app.state.metrics = ApiMetrics()
        app.state.controller = None
        stop = asyncio.Event()
        worker = None
        if settings.controller:
            app.state.controller = Controller(bus, app.state.store, settings, app.state.metrics)
            worker = asyncio.create_task(app.state.controller.run(stop), name="controller")
        try:
            yield
        finally:
            stop.set()
            if worker is not None:
                await worker
            await bus.close()

    app = FastAPI(
        title="verst",
        version="0.1.0",
        summary="RL post-training jobs over REST",
        lifespan=lifespan,
        redirect_slashes=False,  # `/v1/jobs/` is a 404, not a 307 to a route that says otherwise
    )
    guard(app, settings)
    _add_job_routes(app, settings)
    _add_ops_routes(app, settings)
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
    for part in path:
        value = getattr(value, part)
    return value


def _add_job_routes(app: FastAPI, settings: ApiSettings) -> None:
    checker = SpecChecker(settings) if settings.check_specs else None

    @app.post(
        "/v1/jobs",
        status_code=status.HTTP_201_CREATED,
        tags=["jobs"],
        responses=error_responses(400, 401, 413),
    )
    async def submit_job(spec: JobSpec, request: Request) -> JobView:
        """Queue a job. A bad spec is a 422 whose `detail[].loc` is the path of each bad field: the
        JobSpec's own rules, then the checks against the world (paths and their roots, the model and
        data, prompt lengths, the reward service and its verifier)."""
        await _check(checker, spec)
        return JobView.of(await _store(request).create(spec))

    @app.get("/v1/jobs", tags=["jobs"], responses=error_responses(401))
    async def list_jobs(request: Request, limit: int = Query(100, ge=1, le=settings.list_limit)) -> JobList:
        """The newest jobs, newest first, as summaries (no spec)."""
        return JobList(jobs=[JobSummary.of(record) for record in await _store(request).list(limit)])

    @app.get("/v1/jobs/{job_id}", tags=["jobs"], responses=error_responses(401, 404))
    async def get_job(job_id: JobId, request: Request) -> JobView:
        """One job: state, policy version, step, reason and latest metrics."""
        return JobView.of(await _record(request, job_id))

    @app.get("/v1/jobs/{job_id}/metrics", tags=["jobs"], responses=error_responses(401, 404))
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

    @app.post("/v1/jobs/{job_id}/cancel", tags=["jobs"], responses=error_responses(401, 404, 409, 413))
    async def cancel_job(job_id: JobId, request: Request) -> JobView:
        """Cancel a queued or running job: no more prompts are issued. 409 if it already finished."""
        record = await _record(request, job_id)
        if not await _store(request).set_state(job_id, CANCELLED, "cancelled by the user"):
            record = await _record(request, job_id)
            raise HTTPException(status.HTTP_409_CONFLICT, f"job {job_id!r} already finished: {record.state}")
        return JobView.of(await _record(request, record.job_id))


def _add_ops_routes(app: FastAPI, settings: ApiSettings) -> None:
    @app.get("/healthz", tags=["ops"])
    async def healthz() -> dict[str, str]:
        """Liveness: 200 while the process serves requests."""
        return {"status": "ok", "service": settings.service_name}

    @app.get("/metrics", tags=["ops"], response_class=Response)
    async def prometheus_metrics(request: Request) -> Response:
        """Prometheus text: jobs by state, policy version and latest metrics of running jobs."""
        metrics: ApiMetrics = request.app.state.metrics
        await metrics.refresh(_store(request))
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
