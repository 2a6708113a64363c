"""Settings of the trainer service (environment variables VERST_TRAINER_*)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from services.common.settings import ServiceSettings


class TrainerSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="VERST_TRAINER_")
    service_name: ClassVar[str] = "trainer"

    port: int = Field(50054, ge=0, le=65535)
    """gRPC port of the trainer service; 0 picks a free one."""
