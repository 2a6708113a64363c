"""Settings of the REST api (environment variables VERST_API_*)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from services.common.settings import ServiceSettings


class ApiSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="VERST_API_")
    service_name: ClassVar[str] = "api"

    port: int = Field(8000, ge=0, le=65535)
    """HTTP port of the REST api; 0 picks a free one."""
