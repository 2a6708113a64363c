"""Settings of the reward service (environment variables VERST_REWARD_*)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from services.common.settings import ServiceSettings
from services.reward.plugins import PLUGIN_NAME
from services.reward.sandbox import Isolation
from services.reward.verifiers import VERIFIERS


class RewardSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="VERST_REWARD_")
    service_name: ClassVar[str] = "reward"

    port: int = Field(50053, ge=0, le=65535)
    """gRPC port of the reward service; 0 picks a free one."""
    default_verifier: str = Field("addition", min_length=1)
    """Verifier (or plugin, as module:function) used for a ScoreRequest whose `verifier` is empty."""
    score_timeout_s: float = Field(10.0, gt=0.0, le=3600.0)
    """Deadline of one verifier or plugin call (less when the gRPC call's deadline is sooner);
    a slower one yields ScoreResponse.error."""
    score_workers: int = Field(4, ge=1, le=1024)
    """Threads that run verifiers and sync plugins (a ScoreBatch's items are scored concurrently)."""
    metrics_port: int = Field(9463, ge=0, le=65535)
    """HTTP port of the Prometheus /metrics endpoint; 0 picks a free one."""
    metrics_enabled: bool = True
    """Serve /metrics (items, errors and seconds per verifier, RPC latency)."""

    numeric_rel_tol: float = Field(1e-6, ge=0.0, lt=1.0)
    """`numeric` verifier: relative tolerance between the response's last number and the answer."""
    numeric_abs_tol: float = Field(1e-9, ge=0.0)
    """`numeric` verifier: absolute tolerance (for answers near zero)."""
    math_workers: int = Field(2, ge=1, le=256)
    """`math` verifier: worker processes running math-verify (checks at once)."""
    math_timeout_s: float = Field(5.0, gt=0.0, le=3600.0)
    """`math` verifier: time for one parse and comparison (within score_timeout_s); a worker past
    it is replaced."""
    code_test_timeout_s: float = Field(2.0, gt=0.0, le=3600.0)
    """`code` verifier: time for one unit test (tests may ask for less)."""
    code_timeout_s: float = Field(8.0, gt=0.0, le=3600.0)
    """`code` verifier: wall time of the sandbox call that runs the program and all its tests
    (within score_timeout_s)."""

    plugins_enabled: bool = True
    """Score requests whose verifier is a user plugin `module:function` (JobSpec reward.plugin)."""
    plugin_modules: list[str] = Field(default_factory=list)
    """Packages plugins may come from (JSON list; `mypkg` allows `mypkg.rewards`); empty: any
    importable module but the standard library and verst's own."""

    tools_enabled: bool = True
    """Serve verst.v1.Tools (the sandboxed `python` tool) in this process beside verst.v1.Reward."""
    sandbox_timeout_s: float = Field(10.0, gt=0.0, le=3600.0)
    """Wall time of one python call whose ExecuteRequest.timeout_s is 0."""
    sandbox_max_timeout_s: float = Field(60.0, gt=0.0, le=3600.0)
    """Most wall time a python call may ask for; larger requests are cut to it."""
    sandbox_cpu_s: float = Field(10.0, gt=0.0, le=3600.0)
    """CPU seconds of one call, per sandbox process (RLIMIT_CPU)."""
    sandbox_memory_mb: int = Field(512, ge=64, le=1 << 20)
    """Address space of each sandbox process in MiB (RLIMIT_AS)."""
    sandbox_output_bytes: int = Field(64 * 1024, ge=1024, le=64 << 20)
    """stdout plus stderr one call may write; past it the code is stopped and the output truncated."""
    sandbox_processes: int = Field(32, ge=1, le=4096)
    """Processes plus threads a sandbox may have at once (RLIMIT_NPROC)."""
    sandbox_disk_mb: int = Field(64, ge=1, le=1 << 20)
    """Space for the code's files in MiB: its working directory's size, and the largest file."""
    sandbox_concurrency: int = Field(4, ge=1, le=1024)
    """Sandboxes running code at once; further calls wait within their deadline."""
    sandbox_max_sessions: int = Field(64, ge=0, le=4096)
    """Live stateful sessions (a sandbox process each); 0 turns sessions off."""
    sandbox_session_idle_s: float = Field(300.0, gt=0.0, le=86400.0)
    """A session without calls for this long is ended and its sandbox killed."""
    sandbox_session_cpu_s: float = Field(600.0, gt=0.0, le=86400.0)
    """CPU seconds a session's process may use over all its calls."""
    sandbox_python: str = ""
    """Interpreter that runs the code; empty means the service's own."""
    sandbox_site_packages: bool = False
    """Let the code import the interpreter's site-packages (numpy, ...); off: the standard library only."""
    sandbox_dir: str = ""
    """Directory for the sandboxes' working directories; empty means the system's temporary directory."""
    sandbox_uid_base: int = Field(2_000_000_000, ge=1000, le=4_000_000_000)
    """First of the uids the sandboxes run as when the service runs as root (one per live sandbox)."""
    sandbox_isolation: Isolation = Isolation.REQUIRED
    """`required`: python tool and `code` verifier calls fail with one clear error where the sandbox
    cannot get its namespaces, uid and seccomp filter; `unsafe-no-isolation`: trusted code only,
    run with the layers that apply (never without the seccomp filter, nor as root)."""

    @model_validator(mode="after")
    def _timeouts_in_order(self) -> RewardSettings:
        if self.sandbox_timeout_s > self.sandbox_max_timeout_s:
            names = [self.env_name(f) for f in ("sandbox_timeout_s", "sandbox_max_timeout_s")]
            raise ValueError(f"{names[0]} ({self.sandbox_timeout_s:g}) exceeds {names[1]}")
        return self

    @field_validator("default_verifier")
    @classmethod
    def _known_verifier(cls, value: str) -> str:
        if value not in VERIFIERS and PLUGIN_NAME.fullmatch(value) is None:
            known = ", ".join(sorted(VERIFIERS))
            raise ValueError(f"unknown verifier {value!r}; known: {known}, or a plugin as module:function")
        return value
