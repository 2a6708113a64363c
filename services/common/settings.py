"""Process settings shared by every service, read from environment variables.

Each service subclasses ``ServiceSettings`` with its own prefix
(``VERST_ROUTER_PORT``, ``VERST_REWARD_PORT``, ...). ``REDIS_URL``,
``VERST_REDIS_OUTAGE_S``, ``VERST_REDIS_MAX_CONNECTIONS``, ``VERST_LOG_LEVEL`` and
``VERST_EVENTS_MAXLEN`` are shared by all.
compose/ uses exactly these names.

Secrets may come from files (Docker secrets): for any variable ``X`` of these settings, ``X_FILE``
names a file whose contents (less one trailing newline) are the value, e.g. ``VERST_API_TOKEN_FILE``
or ``VERST_REDIS_PASSWORD_FILE``; setting both ``X`` and ``X_FILE`` is an error.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any, ClassVar, TypeVar
from urllib.parse import quote, urlsplit, urlunsplit

from pydantic import AliasChoices, Field, SecretStr, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from services.common.bus import DEFAULT_MAX_CONNECTIONS
from services.common.events import DEFAULT_EVENTS_MAXLEN
from services.common.outage import DEFAULT_OUTAGE_S
from services.common.redis_client import RedisConfigError, RedisTarget, parse_redis_url

S = TypeVar("S", bound="ServiceSettings")

SECRET_FILE_SUFFIX = "_FILE"
"""``X_FILE`` names a file holding the value of the variable ``X`` (Docker secrets)."""
SECRET_FILE_MAX_BYTES = 65_536
"""Longest value file read: a secret is short; a bigger file is the wrong path."""


class SettingFileError(ValueError):
    """A ``X_FILE`` variable that cannot stand for ``X``: unreadable, too long, or ``X`` set too."""


class SecretFileSource(PydanticBaseSettingsSource):
    """Values of unset variables from the files their ``X_FILE`` variables name."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        raise NotImplementedError  # __call__ reads every field at once

    def __call__(self) -> dict[str, Any]:
        settings_cls: Any = self.settings_cls
        values: dict[str, Any] = {}
        for field, info in settings_cls.model_fields.items():
            name = settings_cls.env_name(field)
            path = os.environ.get(name + SECRET_FILE_SUFFIX, "")
            if not path:
                continue
            if os.environ.get(name):
                raise SettingFileError(f"{name} and {name}{SECRET_FILE_SUFFIX} are both set: set one")
            key = name if isinstance(info.validation_alias, AliasChoices) else field
            values[key] = read_setting_file(name + SECRET_FILE_SUFFIX, Path(path))
        return values


def read_setting_file(variable: str, path: Path) -> str:
    """The value in ``path`` (one trailing newline dropped), or an error naming ``variable``."""
    try:
        with path.open("rb") as handle:
            data = handle.read(SECRET_FILE_MAX_BYTES + 1)
    except OSError as err:
        raise SettingFileError(f"{variable}: cannot read {path}: {err.strerror}") from None
    if len(data) > SECRET_FILE_MAX_BYTES:
        raise SettingFileError(f"{variable}: {path} is longer than {SECRET_FILE_MAX_BYTES} bytes")
    try:
        text = data.decode("utf-8").removesuffix("\n").removesuffix("\r")
    except UnicodeDecodeError:
        raise SettingFileError(f"{variable}: {path} is not UTF-8 text") from None
    if not text:
        raise SettingFileError(f"{variable}: {path} is empty")
    return text


class ServiceSettings(BaseSettings):
    """Settings every service has. Subclasses set ``env_prefix`` and a default port."""

    model_config = SettingsConfigDict(env_prefix="VERST_", extra="ignore", use_attribute_docstrings=True)
    service_name: ClassVar[str] = "verst"

    host: str = "127.0.0.1"
    """Interface to listen on (0.0.0.0 inside containers)."""
    port: int = Field(0, ge=0, le=65535)
    """Port to listen on; 0 picks a free one."""
    redis_url: str | None = Field(None, validation_alias=AliasChoices("REDIS_URL"))
    """Redis server, e.g. redis://localhost:6379/0; `verst up` sets it. Also rediss:// (TLS),
    redis+sentinel://s1:26379,s2:26379/<master name>, redis+cluster://n1:6379,n2:6379."""
    redis_tls_ca_file: Path | None = Field(None, validation_alias=AliasChoices("VERST_REDIS_TLS_CA_FILE"))
    """CA bundle that signs the Redis servers' certificates (rediss:// only; default: the system's)."""
    redis_tls_cert_file: Path | None = Field(None, validation_alias=AliasChoices("VERST_REDIS_TLS_CERT_FILE"))
    """Client certificate (PEM) for Redis servers that require one (rediss:// only)."""
    redis_tls_key_file: Path | None = Field(None, validation_alias=AliasChoices("VERST_REDIS_TLS_KEY_FILE"))
    """Private key of VERST_REDIS_TLS_CERT_FILE."""
    redis_sentinel_password: SecretStr | None = Field(
        None, min_length=1, max_length=4096, validation_alias=AliasChoices("VERST_REDIS_SENTINEL_PASSWORD")
    )
    """Password of the Redis sentinels themselves (redis+sentinel:// only), if they require one."""
    redis_password: SecretStr | None = Field(
        None, min_length=1, max_length=4096, validation_alias=AliasChoices("VERST_REDIS_PASSWORD")
    )
    """Password put into REDIS_URL when that URL carries none (compose: VERST_REDIS_PASSWORD_FILE)."""
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
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """The environment first, then the files that ``X_FILE`` variables name."""
        files = SecretFileSource(settings_cls)
        return init_settings, env_settings, files, dotenv_settings, file_secret_settings

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
    except SettingFileError as err:
        print(f"{cls.service_name}: invalid setting {err}", file=sys.stderr)
        raise SystemExit(2) from None
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
    """The Redis URL (with VERST_REDIS_PASSWORD in it, when set), or exit with a message that
    says how to provide one."""
    if not settings.redis_url:
        raise SystemExit(
            f"{settings.service_name}: REDIS_URL is not set: start everything with `verst up`, "
            "or point REDIS_URL at a Redis server"
        )
    if settings.redis_password is None:
        return settings.redis_url
    try:
        return url_with_password(settings.redis_url, settings.redis_password.get_secret_value())
    except ValueError as err:
        raise SystemExit(f"{settings.service_name}: {err}") from None


def url_with_password(url: str, password: str) -> str:
    """``url`` with ``password`` (percent-encoded) as its password; a URL with one of its own is
    an error, since two passwords leave it unclear which is meant."""
    parts = urlsplit(url)
    if parts.password is not None:
        raise ValueError("REDIS_URL carries a password and VERST_REDIS_PASSWORD is set too: set one")
    user = quote(parts.username or "", safe="")
    netloc = f"{user}:{quote(password, safe='')}@{parts.netloc.rpartition('@')[2]}"
    return urlunsplit(parts._replace(netloc=netloc))


def redis_target(settings: ServiceSettings) -> RedisTarget:
    """``require_redis_url`` with the VERST_REDIS_TLS_* and sentinel settings
    (services/common/redis_client.py), or exit naming the bad setting (never a password)."""
    url = require_redis_url(settings)
    sentinel_password = settings.redis_sentinel_password
    try:
        return parse_redis_url(
            url,
            tls_ca_file=settings.redis_tls_ca_file,
            tls_cert_file=settings.redis_tls_cert_file,
            tls_key_file=settings.redis_tls_key_file,
            sentinel_password=sentinel_password.get_secret_value() if sentinel_password else None,
        )
    except RedisConfigError as err:
        raise SystemExit(f"{settings.service_name}: invalid setting {err}") from None
