"""The REST api (FastAPI). Today: health; job submission lands with the end-to-end loop."""

from __future__ import annotations

from fastapi import FastAPI

from services.api.config import ApiSettings


def create_app(settings: ApiSettings) -> FastAPI:
    app = FastAPI(title="verst", version="0.1.0", summary="RL post-training jobs over REST")

    @app.get("/healthz", tags=["ops"])
    async def healthz() -> dict[str, str]:
        """Liveness: 200 while the process serves requests."""
        return {"status": "ok", "service": settings.service_name}

    return app
