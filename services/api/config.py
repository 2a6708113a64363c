"""Settings of the REST api and its job controller (environment variables VERST_API_*)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from services.common.settings import RolloutClientSettings


class ApiSettings(RolloutClientSettings):
    model_config = SettingsConfigDict(env_prefix="VERST_API_")
    service_name: ClassVar[str] = "api"

    port: int = Field(8000, ge=0, le=65535)
    """HTTP port of the REST api; 0 picks a free one."""
    controller: bool = True
    """Drive jobs from this process (off for an api replica that only serves REST)."""
    poll_interval_s: float = Field(0.5, ge=0.05, le=60.0)
    """How often the controller looks for new, cancelled and finished jobs."""
    queue_timeout_s: float = Field(86_400.0, ge=1.0, le=30 * 86_400.0)
    """How long a queued job may wait for its first checkpoint (v0) before it fails."""
    stall_timeout_s: float = Field(600.0, ge=1.0, le=7 * 86_400.0)
    """How long a running job may go without a new policy version before it fails."""
    eval_engine_timeout_s: float = Field(300.0, ge=0.1, le=86_400.0)
    """How long an evaluation waits for an engine to serve the version it evaluates."""
    eval_concurrency: int = Field(16, ge=1, le=4096)
    """Evaluation Generate calls in flight at once, per job."""
    reclaim_idle_ms: int = Field(30_000, ge=100, le=86_400_000)
    """Controller stream entries left unacked this long by a dead api are taken over."""
    list_limit: int = Field(1000, ge=1, le=100_000)
    """Most jobs one GET /v1/jobs returns."""
