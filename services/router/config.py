"""Settings of the router service (environment variables VERST_ROUTER_*)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from services.common.settings import ServiceSettings


class RouterSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="VERST_ROUTER_")
    service_name: ClassVar[str] = "router"

    port: int = Field(50051, ge=0, le=65535)
    """gRPC port of the router service; 0 picks a free one."""
