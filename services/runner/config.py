"""Settings of the rollout runner (VERST_RUNNER_*)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from services.common.settings import RolloutClientSettings


class RunnerSettings(RolloutClientSettings):
    model_config = SettingsConfigDict(env_prefix="VERST_RUNNER_")
    service_name: ClassVar[str] = "runner"

    port: int = Field(50055, ge=0, le=65535)
    """Port of the runner's health service; 0 picks a free one."""
    max_concurrent_groups: int = Field(128, ge=1, le=65_536)
    """PromptTasks (groups of n samples) in flight at once, over all jobs: room for a whole
    step's groups (and the next step's), whose calls are then batched together."""
    batch_window_s: float = Field(0.002, ge=0.0, le=1.0)
    """Calls to the router and the reward service (and publishes of finished groups) made within
    this long of each other go out as one batch; 0: those of one event-loop turn."""
    batch_max_calls: int = Field(64, ge=1, le=65_536)
    """A batch goes out at once when it holds this many calls (groups' Generates, ScoreBatches
    or publishes)."""
    reclaim_idle_ms: int = Field(5000, ge=100, le=86_400_000)
    """A task left unacked this long (its runner died, or its rollout failed) is retried by any
    runner, which looks every fifth of it; live runners renew the tasks they work on every fifth
    of it, at most a second apart."""
    jobs_refresh_s: float = Field(1.0, ge=0.05, le=300.0)
    """How often the runner looks for jobs that started or finished."""
    max_deliveries: int = Field(5, ge=1, le=1000)
    """A task delivered this many times without an ack is dead-lettered."""
    retry_s: float = Field(30.0, ge=0.0, le=3600.0)
    """How long fast router/reward failures (UNAVAILABLE, no weights yet) are retried in place."""
    max_resumes: int = Field(8, ge=0, le=1000)
    """Times one aborted sample (weight update in abort mode, Abort, Pause) is resumed from its
    partial tokens; past it, or at 0, it is published with finish reason ABORT and its tokens so far."""
    tools_address: str = Field("", pattern=r"^$|^\S+:\d{1,5}$")
    """host:port of the Tools service that runs multi-turn episodes' tool calls; empty: the job's
    reward service (the reward process serves Tools too)."""
    metrics_port: int = Field(9465, ge=0, le=65535)
    """HTTP port of the Prometheus /metrics endpoint; 0 picks a free one."""
    metrics_enabled: bool = True
    """Serve /metrics (groups per stage, stage seconds, groups in flight, prompts stream lag, RPC latency)."""
