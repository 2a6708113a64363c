"""Process settings shared by every service, read from environment variables.

Each service subclasses ``ServiceSettings`` with its own prefix
(``VERST_ROUTER_PORT``, ``VERST_REWARD_PORT``, ...). ``REDIS_URL``,
``VERST_REDIS_OUTAGE_S``, ``VERST_REDIS_MAX_CONNECTIONS``, ``VERST_LOG_LEVEL`` and
``VERST_EVENTS_MAXLEN`` are shared by all.
compose/ uses exactly these names.
"""

from __future__ import annotations

import logging
import sys
from typing import ClassVar, TypeVar

from pydantic import AliasChoices, Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.common.bus import DEFAULT_MAX_CONNECTIONS
from services.common.events import DEFAULT_EVENTS_MAXLEN
from services.common.outage import DEFAULT_OUTAGE_S

S = TypeVar("S", bound="ServiceSettings")


class ServiceSettings(BaseSettings):
    """Settings every service has. Subclasses set ``env_prefix`` and a default port."""

    model_config = SettingsConfigDict(env_prefix="VERST_", extra="ignore", use_attribute_docstrings=True)
    service_name: ClassVar[str] = "verst"

    host: str = "127.0.0.1"
    """Interface to listen on (0.0.0.0 inside containers)."""
    port: int = Field(0, ge=0, le=65535)
    """Port to listen on; 0 picks a free one."""
    redis_url: str | None = Field(None, validation_alias=AliasChoices("REDIS_URL"))
    """Redis server, e.g. redis://localhost:6379/0; `verst up` sets it."""
    redis_outage_s: float = Field(
        DEFAULT_OUTAGE_S, ge=1.0, le=86_400.0, validation_alias=AliasChoices("VERST_REDIS_OUTAGE_S")
    )
    """Seconds a Redis outage is ridden through (calls retried); beyond it the jobs fail."""
    redis_max_connections: int = Field(
        DEFAULT_MAX_CONNECTIONS,
        ge=8,
        le=100_000,
        validation_alias=AliasChoices("VERST_REDIS_MAX_CONNECTIONS"),
    )
    """Redis connections this process may hold open at once; one more fails at once, saying so."""
    log_level: str = Field(
        "INFO", pattern=r"^(DEBUG|INFO|WARNING|ERROR)$", validation_alias=AliasChoices("VERST_LOG_LEVEL")
    )
    """Log level: DEBUG, INFO, WARNING or ERROR."""
    shutdown_grace_s: float = Field(5.0, ge=0.0, le=600.0)
    """Seconds that in-flight calls get to finish after SIGTERM."""
    events_maxlen: int = Field(
        DEFAULT_EVENTS_MAXLEN, ge=100, le=10_000_000, validation_alias=AliasChoices("VERST_EVENTS_MAXLEN")
    )
    """Events kept per job (its event log, GET /v1/jobs/{id}/events), about: the oldest are trimmed."""

    @classmethod
    def env_name(cls, field: str) -> str:
        """The environment variable that sets ``field``."""
        alias = cls.model_fields[field].validation_alias
        if isinstance(alias, AliasChoices):
            return str(alias.choices[0])
        return f"{cls.model_config.get('env_prefix', '')}{field}".upper()


class RolloutClientSettings(ServiceSettings):
    """Settings of a process that generates through the router and scores through the reward
    service (the runner, and the controller for evaluation)."""

    router_address: str = Field("127.0.0.1:50051", min_length=3)
    """host:port of the Router that generates the samples."""
    reward_address: str = Field("127.0.0.1:50053", min_length=3)
    """host:port of the Reward service for jobs whose spec names none."""


def load_settings(cls: type[S]) -> S:
    """Read settings from the environment; on a bad value, exit naming the variable."""
    try:
        return cls()
    except ValidationError as err:
        for error in err.errors():
            field = str(error["loc"][0]) if error["loc"] else ""
            name = cls.env_name(field) if field in cls.model_fields else field
            print(f"{cls.service_name}: invalid setting {name}: {error['msg']}", file=sys.stderr)
        raise SystemExit(2) from None


def setup_logging(service: str, level: str = "INFO") -> None:
    """One readable line per event, prefixed with the service, on stderr."""
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s %(levelname)-7s {service} %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )


def require_redis_url(settings: ServiceSettings) -> str:
    """The Redis URL, or exit with a message that says how to provide one."""
    if not settings.redis_url:
        raise SystemExit(
            f"{settings.service_name}: REDIS_URL is not set: start everything with `verst up`, "
            "or point REDIS_URL at a Redis server"
        )
    return settings.redis_url
