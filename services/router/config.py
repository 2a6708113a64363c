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
    engine_ttl_s: float = Field(5.0, gt=0.0, le=600.0)
    """An engine is alive while its last registry heartbeat is younger than this."""
    refresh_s: float = Field(0.5, gt=0.0, le=60.0)
    """Seconds between reads of the engine registry."""
    max_attempts: int = Field(3, ge=1, le=20)
    """Engines tried for one request before it fails (a retry goes to another engine)."""
    default_timeout_s: float = Field(300.0, gt=0.0, le=86_400.0)
    """Deadline of a forwarded call when the caller set none."""
    metrics_port: int = Field(9461, ge=0, le=65535)
    """HTTP port of the Prometheus /metrics endpoint; 0 picks a free one."""
    metrics_enabled: bool = True
    """Serve /metrics (requests routed per engine, engines in view, samples in flight, RPC latency)."""
