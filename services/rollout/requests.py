"""What the torch engine queues and reports: requests, their samples, weight updates, status."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.rollout.sampling import SamplingConfig, row_seed
from services.rollout.torch_backend import LoadedModel

FinishReason = int
"""A common_pb2.FinishReason value."""


class NoWeightsError(RuntimeError):
    """Generate before the first checkpoint was loaded."""


class EngineStoppedError(RuntimeError):
    """Generate after shutdown began."""


class WrongJobError(RuntimeError):
    """Generate for a job other than the one whose weights the engine serves."""


@dataclass(slots=True)
class Completion:
    """One finished (or aborted) sample of a request."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    policy_versions: list[int]
    finish_reason: FinishReason
    error: str = ""


@dataclass(eq=False)
class GenerationRequest:
    """One Generate call. ``on_completion`` is called on the worker thread per finished sample."""

    request_id: str
    prompt: list[int]
    config: SamplingConfig
    on_completion: Callable[[Completion], None]
    job_id: str = ""
    """When set, the engine must be serving this job's weights."""
    on_tokens: Callable[[int, int, float, int], None] | None = None
    """Streaming requests: called on the worker thread with (sample index, token, logprob,
    policy version) for every token as it is sampled."""
    submitted_at: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    aborted: bool = False
    unfinished: int = 0


@dataclass(eq=False)
class Row:
    """One sample being generated: the unit the worker batches."""

    request: GenerationRequest
    index: int
    stop_ids: frozenset[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: FinishReason | None = None

    @property
    def seed(self) -> int | None:
        """The seed of this sample's random stream, or None for the engine's shared one."""
        seed = self.request.config.seed
        return None if seed is None else row_seed(seed, self.index)


@dataclass(eq=False)
class WeightUpdate:
    """A verified checkpoint waiting for the worker: a new model, or a state dict to copy."""

    version: int
    job_id: str
    path: Path
    mode: int
    model: LoadedModel | None = None
    state_dict: dict[str, torch.Tensor] | None = None
    done: threading.Event = field(default_factory=threading.Event)
    error: Exception | None = None
    aborted_requests: int = 0


@dataclass(frozen=True, slots=True)
class EngineStatus:
    state: int
    policy_version: int
    job_id: str
    model_dir: str
    running_requests: int
    queued_requests: int
    outstanding_tokens: int


def validate_request(request: GenerationRequest, loaded: LoadedModel) -> None:
    """Raise ValueError (fit for INVALID_ARGUMENT) for a request ``loaded`` cannot serve."""
    prompt, config = request.prompt, request.config
    if not prompt:
        raise ValueError("prompt_token_ids is empty")
    bad = [t for t in prompt if not 0 <= t < loaded.vocab_size]
    if bad:
        raise ValueError(f"prompt token ids outside the vocabulary [0, {loaded.vocab_size}): {bad[:5]}")
    bad = [t for t in config.stop_token_ids if not 0 <= t < loaded.vocab_size]
    if bad:
        raise ValueError(f"stop_token_ids outside the vocabulary [0, {loaded.vocab_size}): {bad[:5]}")
    total = len(prompt) + config.max_new_tokens
    if loaded.max_positions and total > loaded.max_positions:
        raise ValueError(
            f"prompt ({len(prompt)} tokens) + max_new_tokens ({config.max_new_tokens}) = {total} "
            f"exceeds the model's {loaded.max_positions} positions"
        )
    if config.stop and loaded.tokenizer is None:
        raise ValueError("stop strings need a tokenizer in the checkpoint; use stop_token_ids")
