"""Sampling: validated per-request settings and a batched sampler with per-row settings.

Every row of a batch carries its own temperature, top-p, top-k, min-p and (optionally) its
own seeded random stream, so requests with different settings share one forward pass. The
logprob reported for a sampled token is always log-softmax of the *raw* logits (temperature
1, before any filtering): exactly what the trainer computes for the same weights.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

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


class BatchSampler:
    """Samples one token per row from a batch of logits, each row under its own settings."""

    def __init__(
        self, configs: Sequence[SamplingConfig], seeds: Sequence[int | None], device: torch.device
    ) -> None:
        if len(configs) != len(seeds):
            raise ValueError("one seed (or None) per row")
        self.device = device
        self.greedy = torch.tensor([c.greedy for c in configs], device=device)
        temperatures = [c.temperature if not c.greedy else 1.0 for c in configs]
        self.temperature = torch.tensor(temperatures, dtype=torch.float32, device=device).unsqueeze(1)
        self.top_p = torch.tensor([c.top_p for c in configs], dtype=torch.float32, device=device)
        self.top_k = torch.tensor([c.top_k for c in configs], dtype=torch.long, device=device)
        self.min_p = torch.tensor([c.min_p for c in configs], dtype=torch.float32, device=device)
        self.needs_filter = any(c.top_p < 1.0 or c.top_k > 0 or c.min_p > 0.0 for c in configs)
        self.all_greedy = all(c.greedy for c in configs)
        self.generators: list[torch.Generator | None] = []
        for seed in seeds:
            if seed is None:
                self.generators.append(None)
            else:
                generator = torch.Generator(device=device)
                generator.manual_seed(seed)
                self.generators.append(generator)

    def select(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (indices into the current batch), in that order."""
        self.greedy = self.greedy[rows]
        self.temperature = self.temperature[rows]
        self.top_p = self.top_p[rows]
        self.top_k = self.top_k[rows]
        self.min_p = self.min_p[rows]
        self.generators = [self.generators[i] for i in rows.tolist()]

    def sample(self, logits: torch.Tensor, active: Sequence[bool]) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens [B] and their raw logprobs [B] for logits [B, V] (float32).

        Seeded rows draw from their own stream only while ``active``, so what a row samples
        depends on its own history alone, not on which other rows share the batch.
        """
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        greedy_tokens = logits.argmax(dim=-1)
        if self.all_greedy:
            tokens = greedy_tokens
        else:
            scaled = logits / self.temperature
            if self.needs_filter:
                scaled = self._filter(scaled)
            probs = torch.softmax(scaled, dim=-1)
            # Exponential race (Gumbel-max): argmax(p / E), E ~ Exp(1), is a draw from p.
            noise = torch.empty_like(probs).exponential_()
            for row, generator in enumerate(self.generators):
                if generator is not None and active[row]:
                    noise[row].exponential_(generator=generator)
            sampled = (probs / noise).argmax(dim=-1)
            tokens = torch.where(self.greedy, greedy_tokens, sampled)
        return tokens, raw_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)

    def _filter(self, scaled: torch.Tensor) -> torch.Tensor:
        """Apply top-k, then top-p on what is left, then min-p, in sorted space (HF order)."""
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        ranks = torch.arange(scaled.shape[-1], device=scaled.device).unsqueeze(0)
        k = self.top_k.unsqueeze(1)
        removed = (k > 0) & (ranks >= k)
        sorted_logits = sorted_logits.masked_fill(removed, -math.inf)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        removed |= mass_before > self.top_p.unsqueeze(1)
        removed |= probs < self.min_p.unsqueeze(1) * probs[:, :1]
        removed[:, 0] = False  # the most likely token always survives
        sorted_logits = sorted_logits.masked_fill(removed, -math.inf)
        return torch.empty_like(scaled).scatter_(1, order, sorted_logits)
