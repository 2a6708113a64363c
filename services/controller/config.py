"""Settings of the job controller (environment variables VERST_CONTROLLER_*).

The controller runs inside the api's process by default (``VERST_API_CONTROLLER``) or as its own
process (``python -m services.controller``); either way it reads these settings.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from services.common.settings import RolloutClientSettings
from services.common.tracking_config import DEFAULT_TRACKING_DIR


class ControllerSettings(RolloutClientSettings):
    model_config = SettingsConfigDict(env_prefix="VERST_CONTROLLER_")
    service_name: ClassVar[str] = "controller"

    port: int = Field(50056, ge=0, le=65535)
    """gRPC health port of `python -m services.controller` (unused inside the api); 0 picks a free one."""
    metrics_port: int = Field(9466, ge=0, le=65535)
    """Prometheus /metrics port of `python -m services.controller` (inside the api: the api's /metrics)."""
    poll_interval_s: float = Field(0.5, ge=0.05, le=60.0)
    """How often the controller looks for new, cancelled and finished jobs."""
    metrics_merge_s: float = Field(0.5, ge=0.0, le=60.0)
    """Least time between two merges of a job's new metrics into its record (each merges all that
    arrived meanwhile, in one transaction); 0: merge each read at once."""
    queue_timeout_s: float = Field(86_400.0, ge=1.0, le=30 * 86_400.0)
    """How long a queued job may wait for its first checkpoint (v0) before it fails."""
    stall_timeout_s: float = Field(600.0, ge=1.0, le=7 * 86_400.0)
    """Least time a running job may go without a new policy version before it fails (the bound
    grows with the job's own steps: stall_step_factor; controller/stall.py)."""
    stall_step_factor: float = Field(3.0, ge=1.0, le=1000.0)
    """A running job may also go this many times its slowest recent step without a new version."""
    stall_window_steps: int = Field(8, ge=1, le=10_000)
    """How many of a job's most recent steps (seconds between versions) its stall bound looks at."""
    stall_startup_s: float = Field(1800.0, ge=1.0, le=7 * 86_400.0)
    """Least time allowed for a job's first new version after it starts or resumes (model load,
    the engines' first weights, a first step that compiles)."""
    abort_timeout_s: float = Field(5.0, ge=0.1, le=600.0)
    """Deadline of the router's AbortJob when a job ends: its requests dropped on every engine at once."""
    eval_engine_timeout_s: float = Field(300.0, ge=0.1, le=86_400.0)
    """How long an evaluation waits for an engine to serve the version it evaluates."""
    eval_concurrency: int = Field(16, ge=1, le=4096)
    """Evaluation calls (Generate, ScoreBatch) in flight at once, per job."""
    eval_attempts: int = Field(3, ge=1, le=20)
    """Attempts of each evaluation call (Generate, ScoreBatch) whose engine, router or reward
    service failed or went away; a retried Generate waits for an engine that serves the version."""
    eval_retry_s: float = Field(60.0, ge=0.0, le=3600.0)
    """After its eval_attempts, such a call is made again while this long has not passed since its
    first attempt: a killed engine's successor takes seconds to load and serve the version."""
    reclaim_idle_ms: int = Field(5000, ge=100, le=86_400_000)
    """Controller stream entries left unacked this long by a dead controller are taken over."""
    repeated_failures: int = Field(16, ge=2, le=1_000_000)
    """Dead letters of a job with one reason and no new policy version between them that fail the
    job (at least one step's samples, prompts_per_step x group_size): a repeating failure ends it."""
    housekeeping_s: float = Field(10.0, ge=0.0, le=86_400.0)
    """How often the controller removes dead consumers from a running job's streams and trims the
    entries every group has acked, and once more (with verst:jobs) when the job ends; 0: never."""
    dead_consumer_s: float = Field(60.0, ge=1.0, le=30 * 86_400.0)
    """A consumer holding no entries that has not read its stream for this long has died: it is
    removed from its group (one that was only quiet comes back on its next read)."""
    tracking_dir: str = Field(DEFAULT_TRACKING_DIR, min_length=1, max_length=4096)
    """Where a job's tracker files go (TensorBoard, W&B, MLflow: `{tracking_dir}/{job_id}/`) when
    the controller cannot see its trainer.checkpoint_dir; else in the job's checkpoint directory."""
