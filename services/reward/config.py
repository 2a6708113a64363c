"""Settings of the reward service (environment variables VERST_REWARD_*)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from services.common.settings import ServiceSettings


class RewardSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="VERST_REWARD_")
    service_name: ClassVar[str] = "reward"

    port: int = Field(50053, ge=0, le=65535)
    """gRPC port of the reward service; 0 picks a free one."""
