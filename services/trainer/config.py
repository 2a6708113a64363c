"""Settings of the trainer service (environment variables VERST_TRAINER_*)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator
from pydantic_settings import SettingsConfigDict

from services.common.settings import ServiceSettings

KEEPALIVES_PER_RECLAIM = 3
"""Renewals a live trainer makes at least within each reclaim idle bound."""


class TrainerSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="VERST_TRAINER_")
    service_name: ClassVar[str] = "trainer"

    port: int = Field(50054, ge=0, le=65535)
    """gRPC port of the trainer service; 0 picks a free one."""
    trainer_id: str = Field("", max_length=200, pattern=r"^[\w.:-]*$")
    """Consumer name of this trainer on the streams; empty means `trainer-<host>-<pid>`."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train: cuda when available under `auto`, else cpu."""
    torch_threads: int = Field(0, ge=0, le=1024)
    """CPU threads for torch; 0 keeps torch's default."""
    thread_tuning: bool = True
    """On a CPU, one process: time a job's first steps on these threads and on half of them,
    then keep the faster (services/trainer/threads.py)."""
    poll_block_ms: int = Field(1000, ge=10, le=20_000)
    """Longest wait of one stream read (jobs or trajectories) before looking at stop requests again."""
    job_reclaim_idle_ms: int = Field(5000, ge=1000, le=86_400_000)
    """A job held this long by a trainer that stopped sending keep-alives is taken over by another
    (which looks every fifth of it): a dead trainer's job moves within about 1.2 times this."""
    trajectory_reclaim_idle_ms: int = Field(5000, ge=1000, le=86_400_000)
    """Trajectories pending this long on a silent consumer (a dead trainer) are taken over."""
    max_deliveries: int = Field(5, ge=1, le=1000)
    """Deliveries of a job or trajectory without an ack before it is dead-lettered as a poison
    message; every trainer that dies redelivers what it held (a job, unacked trajectories)."""
    keepalive_s: float = Field(1.0, gt=0.0, le=3600.0)
    """How often the trainer renews its claim on its job and on buffered trajectories (at most a
    third of the shorter reclaim bound, so that a late renewal or two is no takeover)."""
    stop_wait_s: float = Field(600.0, gt=0.0, le=86_400.0)
    """Longest a Stop call waits for the job to end at its step boundary (it ends all the same)."""
    distributed_timeout_s: float = Field(600.0, ge=10.0, le=86_400.0)
    """Deadline of one collective operation between trainer ranks (under torchrun): a rank that
    waits longer for the others fails; an idle rank 0 pings the others every quarter of it."""
    weight_transport: Literal["filesystem", "distributed"] = "filesystem"
    """How engines get each version: `filesystem` (the files on a shared volume) or `distributed`
    (also broadcast from rank 0 over a torch.distributed group; the files stay the fallback)."""
    weight_transport_host: str = Field("", max_length=255, pattern=r"^[\w.:-]*$")
    """distributed: the host engines reach this trainer at (its TCPStore, gloo); empty: the hostname."""
    weight_transport_port: int = Field(0, ge=0, le=65535)
    """distributed: the TCPStore port the groups meet on; 0 picks a free one (named in each handle)."""
    weight_transport_backend: Literal["auto", "gloo", "nccl"] = "auto"
    """distributed: the group's backend; `auto` is nccl when training on CUDA, else gloo."""
    weight_transport_deadline_s: float = Field(60.0, gt=0.0, le=3600.0)
    """distributed: longest a round may take on either side, forming the group included."""
    weight_transport_bucket_bytes: int = Field(64 << 20, ge=4096, le=1 << 34)
    """distributed: bytes of one broadcast call (the tensors laid end to end, cut into buckets)."""
    weight_transport_engine_ttl_s: float = Field(5.0, gt=0.0, le=3600.0)
    """distributed: an engine is a member while its registry heartbeat is younger than this."""
    metrics_port: int = Field(9464, ge=0, le=65535)
    """HTTP port of the Prometheus /metrics endpoint; 0 picks a free one."""
    metrics_enabled: bool = True
    """Serve /metrics (steps, step stage seconds, policy version, trajectories stream lag, RPC latency)."""

    @field_validator("keepalive_s")
    @classmethod
    def _keepalive_beats_reclaim(cls, value: float, info: ValidationInfo) -> float:
        names = ("job_reclaim_idle_ms", "trajectory_reclaim_idle_ms")
        bounds = [info.data[name] for name in names if name in info.data]  # absent when invalid
        if bounds and value * 1000 * KEEPALIVES_PER_RECLAIM > min(bounds):
            raise ValueError("must be at most a third of the shorter of the *_RECLAIM_IDLE_MS settings")
        return value
