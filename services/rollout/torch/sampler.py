"""The torch engine's batched sampler: each row under its own settings.

Every row of a batch carries its own temperature, top-p, top-k, min-p and (optionally) its
own seeded random stream, so requests with different settings share one forward pass. The
logprob reported for a sampled token is always log-softmax of the *raw* logits (temperature
1, before any filtering): exactly what the trainer computes for the same weights.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import torch

from services.rollout.sampling import SamplingConfig


class BatchSampler:
    """Samples one token per row from a batch of logits, each row under its own settings.

    Rows live in slots ``0..capacity-1``; the continuous batch assigns a slot when a sample
    joins and moves the last slot into a freed one when a sample leaves, so the live rows are
    always a prefix (or, for newly admitted ones, a contiguous range) of the slots.

    A draw inverts the CDF of the row's (tempered, filtered) distribution at one uniform
    number: a seeded row takes that number from its own random stream, so what it samples
    depends on its own history alone, not on which other rows share the batch.
    """

    def __init__(
        self,
        configs: Sequence[SamplingConfig],
        seeds: Sequence[int | None],
        device: torch.device,
        *,
        capacity: int = 0,
    ) -> None:
        if len(configs) != len(seeds):
            raise ValueError("one seed (or None) per row")
        self.device = device
        capacity = max(capacity, len(configs))
        self.temperature = torch.ones((capacity, 1), dtype=torch.float32, device=device)
        self.top_p = torch.ones(capacity, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(capacity, dtype=torch.long, device=device)
        self.min_p = torch.zeros(capacity, dtype=torch.float32, device=device)
        self.greedy = torch.zeros(capacity, dtype=torch.bool, device=device)
        self.configs: list[SamplingConfig | None] = [None] * capacity
        self.filters: list[bool] = [False] * capacity
        """Whether each slot's sample filters its distribution (top-k, top-p or min-p)."""
        self.streams: list[random.Random | None] = [None] * capacity
        self._shared = random.Random(torch.initial_seed())
        """Where unseeded rows draw from (seeded once from torch's global seed)."""

        if configs:
            self.assign_range(0, configs, seeds)

    def assign(self, slot: int, config: SamplingConfig, seed: int | None) -> None:
        """Give ``slot`` the settings (and, when seeded, a fresh random stream) of a sample."""
        self.assign_range(slot, [config], [seed])

    def assign_range(
        self, start: int, configs: Sequence[SamplingConfig], seeds: Sequence[int | None]
    ) -> None:
        """Give slots start, start+1, ... the settings and random streams of these samples."""
        end = start + len(configs)
        self.configs[start:end] = configs
        self.filters[start:end] = [c.top_p < 1.0 or c.top_k > 0 or c.min_p > 0.0 for c in configs]
        self.streams[start:end] = [None if seed is None else random.Random(seed) for seed in seeds]
        greedy = [c.greedy for c in configs]
        self.greedy[start:end] = torch.tensor(greedy)
        self.temperature[start:end, 0] = torch.tensor([1.0 if c.greedy else c.temperature for c in configs])
        self.top_p[start:end] = torch.tensor([c.top_p for c in configs])
        self.top_k[start:end] = torch.tensor([c.top_k for c in configs])
        self.min_p[start:end] = torch.tensor([c.min_p for c in configs])

    def move(self, sources: list[int], targets: list[int]) -> None:
        """Each slot in ``targets`` takes over the sample (settings, random stream) of its source."""
        for values in (self.temperature, self.top_p, self.top_k, self.min_p, self.greedy):
            values[targets] = values[sources]
        for source, target in zip(sources, targets, strict=True):
            self.configs[target] = self.configs[source]
            self.filters[target] = self.filters[source]
            self.streams[target] = self.streams[source]

    def select(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (indices into the current slots), in that order, from slot 0."""
        self.greedy = self.greedy[rows]
        self.temperature = self.temperature[rows]
        self.top_p = self.top_p[rows]
        self.top_k = self.top_k[rows]
        self.min_p = self.min_p[rows]
        kept = rows.tolist()
        self.configs = [self.configs[i] for i in kept]
        self.filters = [self.filters[i] for i in kept]
        self.streams = [self.streams[i] for i in kept]

    def sample(
        self, logits: torch.Tensor, active: Sequence[bool] | None = None, *, start: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens [B] and their raw logprobs [B] for logits [B, V] (float32) of slots start..start+B-1.

        A seeded row draws from its stream only while ``active`` (default: all rows are).
        """
        draw = self.unfiltered_draw(logits.shape[0], active, start=start)
        if draw is not None:
            return sample_unfiltered(logits, *draw)
        rows = slice(start, start + logits.shape[0])
        uniform = self._uniforms(rows, active)
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        probs = torch.softmax(self._filter(logits / self.temperature[rows], rows), dim=-1)
        tokens = torch.where(self.greedy[rows], logits.argmax(dim=-1), _invert_cdf(probs, uniform))
        return tokens, raw_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)

    def unfiltered_draw(
        self, count: int, active: Sequence[bool] | None = None, *, start: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(temperature, uniform, greedy) of slots start..start+count-1 for ``sample_unfiltered``,
        or None when a row filters (top-k, top-p, min-p). Draws each row's uniform number."""
        rows = slice(start, start + count)
        if any(self.filters[rows]):
            return None
        return self.temperature[rows], self._uniforms(rows, active), self.greedy[rows]

    def _uniforms(self, rows: slice, active: Sequence[bool] | None) -> torch.Tensor:
        """One uniform number per row; seeded rows draw theirs from their own stream.

        The streams are Python ``random.Random`` (Mersenne Twister): one draw per row costs
        ~0.1 us on the host, where a torch draw per row costs a kernel launch each.
        """
        shared = self._shared
        if active is None:  # every step of the running batch: keep it a plain comprehension
            values = [(stream or shared).random() for stream in self.streams[rows]]
        else:
            values = [
                (stream if stream is not None and live else shared).random()
                for stream, live in zip(self.streams[rows], active, strict=True)
            ]
        return torch.tensor(values, dtype=torch.float32, device=self.device)

    def _filter(self, scaled: torch.Tensor, rows: slice) -> torch.Tensor:
        """Apply top-k, then top-p on what is left, then min-p, in sorted space (HF order)."""
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        ranks = torch.arange(scaled.shape[-1], device=scaled.device).unsqueeze(0)
        k = self.top_k[rows].unsqueeze(1)
        removed = (k > 0) & (ranks >= k)
        sorted_logits = sorted_logits.masked_fill(removed, -math.inf)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        removed |= mass_before > self.top_p[rows].unsqueeze(1)
        removed |= probs < self.min_p[rows].unsqueeze(1) * probs[:, :1]
        removed[:, 0] = False  # the most likely token always survives
        sorted_logits = sorted_logits.masked_fill(removed, -math.inf)
        return torch.empty_like(scaled).scatter_(1, order, sorted_logits)


def sample_unfiltered(
    logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor, greedy: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens drawn from softmax(logits / temperature) at ``uniform`` (argmax where ``greedy``),
    and their raw logprobs: the common case (no top-k, top-p, min-p), in tensor ops only, so
    that the compiled decode step can end with it."""
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    drawn = _invert_cdf(torch.softmax(logits / temperature, dim=-1), uniform)
    tokens = torch.where(greedy, logits.argmax(dim=-1), drawn)
    return tokens, raw_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)


def _invert_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """For each row, the first token whose cumulative probability exceeds ``uniform`` of the total.

    The target stays strictly below the total, so the token found always has mass (a float
    cumsum only rises where a probability is positive); no device sync is needed.
    """
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(uniform.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)
