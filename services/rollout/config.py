"""Settings of the rollout engine (VERST_ENGINE_*)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from services.common.pb import rollout_pb2
from services.common.settings import ServiceSettings


class EngineSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="VERST_ENGINE_")
    service_name: ClassVar[str] = "rollout-engine"

    port: int = Field(50052, ge=0, le=65535)
    """gRPC port of the Rollout service; 0 picks a free one."""
    advertise_address: str = Field("", pattern=r"^$|^auto$|^(\[[0-9A-Fa-f:.]+\]|[^\s:\[\]]+):\d{1,5}$")
    """host:port the router dials; empty: this host and port (the hostname when host is 0.0.0.0);
    auto: this host's own IP address and port (the hostname's address when host is 0.0.0.0 or ::),
    so that each of `docker compose up --scale engine=N`'s containers registers its own."""
    engine_id: str = Field("", max_length=200)
    """Name in the engine registry; empty: engine-{hostname}-{pid}."""
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?|mps|xpu(:\d+)?)$")
    """Torch device: auto (CUDA when available, else CPU), cpu, cuda, cuda:N, mps or xpu."""
    dtype: str = Field("auto", pattern=r"^(auto|float32|bfloat16|float16)$")
    """Weight dtype: auto (each checkpoint's own: the job's model.dtype), float32, bfloat16 or float16."""
    max_batch_size: int = Field(256, ge=1, le=4096)
    """Most samples decoded together in one batch (its KV cache grows to the samples in it)."""
    max_batch_tokens: int = Field(0, ge=0, le=1 << 26)
    """Most KV-cache positions of a batch: its samples x the longest prompt + max_new_tokens among
    them (every slot is that long); a sample joins while it fits. 0: 64 samples of the model's
    full length (max_position_embeddings, counted at most 2,048)."""
    batch_wait_ms: float = Field(5.0, ge=0.0, le=1000.0)
    """The admission window: how long an idle engine waits, once a request is queued, for more
    to fill its batch (max_batch_size or max_batch_tokens); 0 starts at once. A busy engine never
    waits: requests join the running batch at its next step."""
    weight_poll_s: float = Field(1.0, gt=0.0, le=60.0)
    """Longest wait for a new checkpoint handle (a blocking read) before the watcher looks again
    which job is the newest running one; a new handle is loaded as soon as it is published."""
    version_wait_s: float = Field(10.0, gt=0.0, le=600.0)
    """Longest a Generate waits for the version of its job's weights it requires
    (min_policy_version) before it fails FAILED_PRECONDITION (the runner retries)."""
    max_pause_s: float = Field(300.0, gt=0.0, le=86_400.0)
    """Longest a Pause holds the engine without a Resume: then it resumes by itself and says so
    (a caller that died between the two must not leave the engine idle for good)."""
    heartbeat_s: float = Field(1.0, gt=0.0, le=60.0)
    """Seconds between heartbeats into the engine registry (keep well below the router's ttl)."""
    torch_threads: int = Field(0, ge=0, le=1024)
    """Torch intra-op CPU threads; 0 keeps torch's default. 1 is fastest for tiny models."""
    weight_load_timeout_s: float = Field(300.0, gt=0.0, le=3600.0)
    """Longest wait for the worker to take verified weights (it swaps models between batches)."""
    max_prefill_tokens: int = Field(4096, ge=1, le=1_048_576)
    """Most prompt tokens prefilled in one step while other samples decode (new samples join
    the running batch at every step; a longer prompt is prefilled alone)."""
    compile_decode: bool = False
    """Compile the fast path's prefill and decode steps with inductor (on a CPU, the decode step
    ahead of time with AOTInductor; either needs a C++ compiler there): small models run faster
    after one-off compiles of ~15-40 s per process."""
    weight_update_mode: str = Field("continue", pattern=r"^(continue|abort)$")
    """What a new checkpoint does to samples in flight: continue under the new weights (each
    token records its version) or abort them, returning their tokens for partial rollout."""
    metrics_port: int = Field(9400, ge=0, le=65535)
    """HTTP port of the Prometheus /metrics endpoint; 0 picks a free one."""
    metrics_enabled: bool = True
    """Serve /metrics (tokens/s, running requests, queue depth, TTFT, weight version)."""
    backend: str = Field("torch", max_length=256, pattern=r"^(\w+|[A-Za-z_][\w.]*:\w+)$")
    """Generation backend (services/rollout/backends.py): torch (in this process), sglang (SGLang
    servers over HTTP; CUDA hosts), or a backend of one's own as `module:function`."""
    weight_transport_distributed: bool = True
    """Take weights over the trainer's torch.distributed group when a handle offers it (torch
    backend; the trainer's VERST_TRAINER_WEIGHT_TRANSPORT=distributed); false: always the files."""
    weight_transport_host: str = Field("", max_length=255, pattern=r"^[\w.:-]*$")
    """The address this engine's end of a weight group binds (gloo); empty: from the hostname."""
    sglang_urls: str = Field("", max_length=4000)
    """sglang: comma-separated base URLs of running SGLang servers to attach to; empty: launch one."""
    sglang_model_path: str = Field("", max_length=4096)
    """sglang, launch: the HF model directory SGLang starts with (the base model of the jobs it serves)."""
    sglang_port: int = Field(30000, ge=1, le=65535)
    """sglang, launch: HTTP port of the launched SGLang server (bound to 127.0.0.1)."""
    sglang_args: str = Field("", max_length=4000)
    """sglang, launch: extra sglang.launch_server flags, split like a shell (--dtype bfloat16 --tp 2)."""
    sglang_startup_timeout_s: float = Field(900.0, gt=0.0, le=7200.0)
    """sglang: longest wait at start for every server to answer /health_generate."""
    sglang_generate_timeout_s: float = Field(600.0, gt=0.0, le=86400.0)
    """sglang: longest wait for one /generate call (all samples of a request)."""
    sglang_always_seed: bool = False
    """sglang: send a sampling_seed with every sample (for --enable-deterministic-inference servers)."""

    @property
    def default_update_mode(self) -> int:
        """The WeightUpdateMode of loads that name none (the watcher's), from weight_update_mode."""
        if self.weight_update_mode == "abort":
            return rollout_pb2.WEIGHT_UPDATE_MODE_ABORT
        return rollout_pb2.WEIGHT_UPDATE_MODE_CONTINUE
