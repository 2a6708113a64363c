"""Settings of the rollout processes: engines (VERST_ENGINE_*) and runners (VERST_RUNNER_*)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from services.common.settings import ServiceSettings


class EngineSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="VERST_ENGINE_")
    service_name: ClassVar[str] = "rollout-engine"

    port: int = Field(50052, ge=0, le=65535)
    """gRPC port of the Rollout service; 0 picks a free one."""


class RunnerSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="VERST_RUNNER_")
    service_name: ClassVar[str] = "rollout-runner"

    port: int = Field(50055, ge=0, le=65535)
    """Port of the runner's health service; 0 picks a free one."""
