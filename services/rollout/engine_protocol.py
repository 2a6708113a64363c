"""The ``Engine`` protocol: what the Rollout servicer, the weight loader and the heartbeat ask of a
generation backend, and the types they exchange.

Two backends implement it: ``engine.TorchEngine`` (in this process) and
``sglang.engine.SGLangEngine`` (SGLang servers over HTTP). ``server.py`` picks one from
``VERST_ENGINE_BACKEND`` and serves ``verst.v1.Rollout`` over it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from services.common.pb import common_pb2
from services.rollout.sampling import SamplingConfig

if TYPE_CHECKING:
    import torch

FinishReason = int
"""A common_pb2.FinishReason value."""
NO_WEIGHTS = "no weights loaded: the engine serves the newest checkpoint of the newest running job"


class NoWeightsError(RuntimeError):
    """Generate before the first checkpoint was loaded."""


class EngineStoppedError(RuntimeError):
    """Generate (or a load) after shutdown began."""


class WrongJobError(RuntimeError):
    """Generate for a job other than the one whose weights the engine serves."""


class StaleWeightsError(RuntimeError):
    """Generate requires a newer version of its job's weights (min_policy_version) than the
    engine served within the wait allowed."""


class EngineUnavailableError(ConnectionError):
    """The backend cannot be reached or is failing (SGLang servers down, say); a retry may work."""


@dataclass(slots=True)
class Completion:
    """One finished (or aborted) sample of a request."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    policy_versions: list[int]
    finish_reason: FinishReason
    error: str = ""
    text: str | None = None
    """The response's text without special tokens, when the backend detokenizes (SGLang)."""


@dataclass(eq=False)
class GenerationRequest:
    """One Generate call. ``on_completion`` is called once per finished sample, from any thread."""

    request_id: str
    prompt: list[int]
    config: SamplingConfig
    on_completion: Callable[[Completion], None]
    job_id: str = ""
    """When set, the engine must be serving this job's weights."""
    on_tokens: Callable[[int, int, float, int], None] | None = None
    """Streaming requests: called with (sample index, token, logprob, policy version) for every
    token as it is sampled (the torch engine; SGLang answers with whole samples)."""
    on_error: Callable[[Exception], None] | None = None
    """Called instead of ``on_completion`` when the backend fails the request as a whole (SGLang:
    bad input or an unreachable server); when unset, each sample ends as FINISH_REASON_ERROR."""
    submitted_at: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    aborted: bool = False
    unfinished: int = 0


def check_job(request: GenerationRequest, served_job_id: str) -> None:
    """Raise WrongJobError when ``request`` names a job other than the one served."""
    if request.job_id and request.job_id != served_job_id:
        raise WrongJobError(f"engine serves job {served_job_id!r}, not {request.job_id!r}")


@dataclass(frozen=True, slots=True)
class EngineStatus:
    state: int
    policy_version: int
    job_id: str
    model_dir: str
    running_requests: int
    queued_requests: int
    outstanding_tokens: int
    decode_path: str = ""
    """EngineInfo.decode_path: "fast", "general", or "" (no weights yet, or a backend without paths)."""
    decode_path_reason: str = ""
    """Why the general path (EngineInfo.decode_path_reason)."""


def engine_state(*, serving: bool, draining: bool, loading: bool, paused: bool) -> int:
    """The EngineState of a backend: STARTING until it serves weights, then the first that holds
    of draining, loading weights, paused; else SERVING."""
    if not serving:
        return common_pb2.ENGINE_STATE_STARTING
    if draining:
        return common_pb2.ENGINE_STATE_DRAINING
    if loading:
        return common_pb2.ENGINE_STATE_LOADING_WEIGHTS
    if paused:
        return common_pb2.ENGINE_STATE_PAUSED
    return common_pb2.ENGINE_STATE_SERVING


@dataclass(frozen=True, slots=True)
class ServedWeights:
    """A checkpoint an engine serves now, and what taking it did to the requests in flight."""

    version: int
    job_id: str
    path: Path
    mode: int
    """The WeightUpdateMode applied (an unspecified one resolved to the engine's default)."""
    aborted_requests: int = 0


@runtime_checkable
class Engine(Protocol):
    """A generation backend behind the Rollout service.

    ``submit`` and ``cancel`` run on the event loop and return at once; completions arrive through
    the request's callbacks. ``submit`` raises NoWeightsError, WrongJobError, EngineStoppedError
    or ValueError (bad input); ``load_weights`` raises CheckpointError, TimeoutError,
    EngineStoppedError or ConnectionError; abort, pause and resume raise ConnectionError when the
    backend cannot be reached.
    """

    backend: str
    """EngineInfo.backend: "torch" or "sglang"."""

    def describe(self) -> str:
        """Where it generates (a device, SGLang servers), for the log."""
        ...

    def status(self) -> EngineStatus: ...

    def submit(self, request: GenerationRequest) -> None: ...

    def cancel(self, request: GenerationRequest) -> None:
        """Abort one request whose caller went away."""
        ...

    async def load_weights(
        self, path: Path, *, sha256: str, version: int, job_id: str, mode: int, timeout_s: float
    ) -> ServedWeights:
        """Verify the checkpoint directory ``path`` against ``sha256`` and serve it."""
        ...

    receives_state_dicts: bool
    """Whether ``load_state_dict`` can serve tensors received over a weight group."""

    async def load_state_dict(
        self,
        state: Mapping[str, torch.Tensor],
        *,
        path: Path,
        version: int,
        job_id: str,
        mode: int,
        timeout_s: float,
    ) -> ServedWeights:
        """Serve ``state`` (every tensor of checkpoint ``path``, fingerprint checked) as ``version``
        of ``job_id``, copied into the model of that job served now. Raises CheckpointError
        (no model of that job, other tensors than it has, or a backend that cannot),
        TimeoutError or EngineStoppedError."""
        ...

    async def abort(self, request_ids: Sequence[str] = (), *, all_requests: bool = False) -> int:
        """Abort requests by id (or all); returns how many were hit."""
        ...

    async def pause(self, *, abort_inflight: bool) -> int:
        """Hold generation; returns how many requests were aborted."""
        ...

    async def resume(self) -> None: ...

    def set_draining(self) -> None:
        """The process is stopping: report DRAINING from now on."""
        ...

    async def close(self) -> None:
        """Stop generating and release the backend: unfinished requests end (as ABORT on the torch
        engine; SGLang's calls are cancelled and their samples aborted on the servers)."""
        ...


@runtime_checkable
class TokenCountingEngine(Protocol):
    """A backend that reports tokens as it samples them (the torch engine: once per decode step),
    so that the engine's token counter and rate move during a long generation. Other backends'
    tokens are counted when each sample finishes (SGLang's ``/generate`` answers whole samples)."""

    def count_tokens(self, counter: Callable[[int], None]) -> None:
        """Call ``counter(n)`` (from any thread) with each batch of ``n`` tokens sampled from now on."""
        ...


@runtime_checkable
class AdapterEngine(Protocol):
    """A backend that serves LoRA adapters (a handle with ``adapter`` set): the torch engine.
    A backend without ``load_adapter`` refuses such handles (``transport.serve_adapter``)."""

    async def load_adapter(
        self,
        path: Path,
        *,
        sha256: str,
        base: Path,
        base_sha256: str,
        version: int,
        job_id: str,
        mode: int,
        timeout_s: float,
    ) -> ServedWeights:
        """Verify the adapter in ``path`` (``sha256`` of its adapter_model.safetensors) and the
        base model in ``base`` (``base_sha256``), and serve the base with the adapter applied.
        Raises what ``Engine.load_weights`` raises."""
        ...
