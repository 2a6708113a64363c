"""The dashboard: a static page at ``/`` and its assets under ``/dashboard/`` (services/api/dashboard/,
shipped as package data; plain JavaScript modules, no build step and nothing from a CDN).

The page reads the api as any client does (GET /v1/jobs, /v1/cluster, the job's event stream) with
the bearer token it asks for once, so serving it needs no token (guard.OPEN_PATHS, OPEN_PREFIXES).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

ASSETS = Path(__file__).resolve().parent / "dashboard"
"""index.html, app.js, chart.js, style.css."""


def add_dashboard(app: FastAPI) -> None:
    @app.get("/", include_in_schema=False)
    async def dashboard() -> FileResponse:
        return FileResponse(ASSETS / "index.html", headers={"Cache-Control": "no-cache"})

    app.mount("/dashboard", StaticFiles(directory=ASSETS), name="dashboard")
