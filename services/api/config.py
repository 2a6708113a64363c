"""Settings of the REST api (environment variables VERST_API_*); the controller has its own."""

from __future__ import annotations

import os
from pathlib import Path
from typing import ClassVar

from pydantic import AliasChoices, Field, SecretStr
from pydantic_settings import SettingsConfigDict

from services.common.settings import RolloutClientSettings


class ApiSettings(RolloutClientSettings):
    model_config = SettingsConfigDict(env_prefix="VERST_API_")
    service_name: ClassVar[str] = "api"

    port: int = Field(8000, ge=0, le=65535)
    """HTTP port of the REST api; 0 picks a free one."""
    controller: bool = True
    """Run the job controller in this process (settings VERST_CONTROLLER_*); off where it runs as its
    own process (`python -m services.controller`) or for an api replica that only serves REST."""
    request_connections: int = Field(32, ge=1, le=10_000)
    """Redis connections the request handlers may hold at once: a pool of their own, which the
    job drivers' blocking reads cannot use up."""
    request_timeout_s: float = Field(5.0, gt=0.0, le=300.0)
    """How long a request waits for a free connection and for each Redis reply before it is a 503."""
    event_connections: int = Field(64, ge=1, le=10_000)
    """Redis connections the event streams (GET /v1/jobs/{id}/events) share, a pool of their own: each
    holds one while it waits for the next event (a second at most); more streams wait their turn."""
    events_heartbeat_s: float = Field(15.0, ge=1.0, le=3600.0)
    """An event stream sends a comment line after this long without an event, so that clients and
    proxies see it alive."""
    metrics_refresh_s: float = Field(1.0, ge=0.0, le=300.0)
    """/metrics reads the job gauges from the store at most this often (scrapes in between get the
    last reading)."""
    controller_stall_s: float = Field(60.0, ge=1.0, le=86_400.0)
    """/healthz is a 503 once the controller has not finished a poll for this long."""
    unhealthy_exit_s: float = Field(180.0, ge=0.0, le=86_400.0)
    """`python -m services.api` exits (status 3) for its supervisor once it has been unhealthy, or its
    event loop stuck, this long; longer than a Redis outage the services ride through; 0: never."""
    engine_ttl_s: float = Field(5.0, gt=0.0, le=600.0)
    """GET /v1/cluster lists an engine while its last registry heartbeat is younger than this (as the
    router's VERST_ROUTER_ENGINE_TTL_S)."""
    list_limit: int = Field(1000, ge=1, le=100_000)
    """Most jobs one GET /v1/jobs returns."""
    max_body_bytes: int = Field(1_048_576, ge=1024, le=1_073_741_824)
    """Largest request body the api reads; a longer one is a 413."""
    token: SecretStr | None = Field(None, min_length=16, max_length=4096)
    """Bearer token every endpoint but /healthz and /metrics requires (`Authorization: Bearer
    <token>`, else 401); unset: no authentication."""
    data_roots: str = Field("", max_length=65_536, validation_alias=AliasChoices("VERST_DATA_ROOTS"))
    """Directories (separated by `:`) that model.path, model.tokenizer, data.train, data.eval and the
    eval.sets locations must lie in (`builtin:` names always allowed); empty: any path."""
    checkpoint_root: str = Field("", max_length=4096, validation_alias=AliasChoices("VERST_CHECKPOINT_ROOT"))
    """Directory that trainer.checkpoint_dir, and the out_dir of an export, must lie in; empty: any path."""
    log_dir: str = Field("", max_length=4096)
    """Directory of the services' log files (`<name>.log`, as `verst up` writes them) that GET
    /v1/services/{name}/logs reads; `verst up` sets it; empty: no service logs over REST."""
    log_lines_limit: int = Field(10_000, ge=1, le=1_000_000)
    """Most lines one GET of a job's or a service's logs returns."""
    check_specs: bool = True
    """Check a submitted spec against the world (paths, data, prompt lengths, reward service); off:
    only the JobSpec's own validation."""
    check_timeout_s: float = Field(5.0, gt=0.0, le=600.0)
    """Deadline of each submission check that waits (the reward service, reading the data)."""
    check_prompts: int = Field(64, ge=1, le=100_000)
    """Training prompts read at submission to check that some fit data.max_prompt_tokens."""

    def data_root_paths(self) -> list[Path]:
        """VERST_DATA_ROOTS as resolved directories (symlinks followed)."""
        return [Path(os.path.realpath(p)) for p in self.data_roots.split(os.pathsep) if p.strip()]

    def checkpoint_root_path(self) -> Path | None:
        """VERST_CHECKPOINT_ROOT resolved, or None when unset."""
        return Path(os.path.realpath(self.checkpoint_root)) if self.checkpoint_root.strip() else None
