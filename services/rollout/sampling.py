"""A Generate request's sampling settings, validated once for every backend (``SamplingConfig``),
and the seed of each of its samples. The torch backend's batched sampler is torch/sampler.py."""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.common.pb import common_pb2

MAX_SAMPLES_PER_REQUEST = 4096
"""Bound on SamplingParams.n: one request must not be able to swamp an engine."""
_SEED_STRIDE = 1_000_003
"""Sample i of a request seeded s draws from seed s * stride + i: distinct streams, reproducible."""


@dataclass(frozen=True, slots=True)
class SamplingConfig:
    """The settings of one Generate request, validated and with defaults filled in."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    max_new_tokens: int
    stop_token_ids: frozenset[int]
    stop: tuple[str, ...]
    seed: int | None
    n: int
    ignore_eos: bool

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_proto(cls, params: common_pb2.SamplingParams) -> SamplingConfig:
        """Validate ``params``; raises ValueError with a message fit for INVALID_ARGUMENT."""
        top_p = params.top_p if params.HasField("top_p") else 1.0
        if not math.isfinite(params.temperature) or params.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {params.temperature}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if params.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {params.top_k}")
        if not 0.0 <= params.min_p < 1.0:
            raise ValueError(f"min_p must be in [0, 1) (0 disables it), got {params.min_p}")
        if params.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {params.max_new_tokens}")
        if not 0 <= params.n <= MAX_SAMPLES_PER_REQUEST:
            raise ValueError(f"n must be in [0, {MAX_SAMPLES_PER_REQUEST}] (0 means 1), got {params.n}")
        if any(not text for text in params.stop):
            raise ValueError("stop strings must not be empty")
        return cls(
            temperature=float(params.temperature),
            top_p=float(top_p),
            top_k=int(params.top_k),
            min_p=float(params.min_p),
            max_new_tokens=int(params.max_new_tokens),
            stop_token_ids=frozenset(params.stop_token_ids),
            stop=tuple(params.stop),
            seed=params.seed if params.HasField("seed") else None,
            n=max(1, params.n),
            ignore_eos=params.ignore_eos,
        )


def row_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` of a request seeded with ``seed`` (a valid torch seed)."""
    return (seed * _SEED_STRIDE + index) % (2**63 - 1)
