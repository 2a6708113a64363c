"""The running batch of the engine's fast path: samples join at any decode step and leave
as soon as they finish.

``ContinuousBatch`` keeps its live samples in the first slots of a ``SlotDecoder`` (keys and
values) and a ``BatchSampler`` (settings and random streams), with each slot's position and
last token. The engine's worker calls, per iteration: ``retire`` (drop finished samples),
``admit`` (prefill new ones, one prefill per request however many samples it has, and sample
their first tokens) and ``step`` (one decode step for every live sample);
``requests.record_tokens`` appends what was sampled to each sample. Its KV cache grows to the
rows it holds, within ``max_tokens`` (the engine admits rows only while they fit it).
"""

from __future__ import annotations

import torch

from services.rollout.torch.decoder import SlotDecoder
from services.rollout.torch.requests import LoadedModel, Row, kv_need
from services.rollout.torch.sampler import BatchSampler


class ContinuousBatch:
    """Live samples of one model in slots ``0..len(rows)-1`` (worker thread only)."""

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        capacity: int,
        device: torch.device,
        compile_step: bool = False,
        max_tokens: int | None = None,
    ) -> None:
        self.loaded = loaded
        self.capacity = capacity
        self.max_tokens = max_tokens
        """Most KV positions the batch holds: rows x the longest ``kv_need`` among them."""
        self.decoder = SlotDecoder(
            loaded.model,
            slots=capacity,
            max_positions=loaded.max_positions,
            compile_step=compile_step,
            max_tokens=max_tokens,
        )
        self.sampler = BatchSampler([], [], device, capacity=capacity)
        self.rows: list[Row] = []
        self.positions = torch.zeros(capacity, dtype=torch.long, device=device)
        """Where each slot's next token goes (= the tokens it has seen)."""
        self.span = 0
        """1 + the largest position of a live slot (kept here so a step needs no device sync)."""
        self.last_tokens = torch.zeros(capacity, dtype=torch.long, device=device)
        self.device = device

    @property
    def free(self) -> int:
        return self.capacity - len(self.rows)

    @property
    def longest(self) -> int:
        """The largest ``kv_need`` of a live row (0 when none): how long every slot must be."""
        return max((kv_need(row) for row in self.rows), default=0)

    def admit(self, rows: list[Row]) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill ``rows`` into the next free slots; returns their first tokens and logprobs."""
        if len(rows) > self.free:
            raise ValueError(f"{len(rows)} samples for {self.free} free slots")
        start = len(self.rows)
        prompts: list[list[int]] = []
        slots: list[list[int]] = []
        group_of: dict[int, int] = {}
        row_groups: list[int] = []
        for offset, row in enumerate(rows):
            request = row.request
            group = group_of.setdefault(id(request), len(prompts))
            if group == len(prompts):
                prompts.append(request.prompt)
                slots.append([])
            slots[group].append(start + offset)
            row_groups.append(group)
        self.sampler.assign_range(start, [r.request.config for r in rows], [r.seed for r in rows])
        self.decoder.reserve(max([self.longest, *map(kv_need, rows)]), rows=start + len(rows))
        logits = self.decoder.prefill(prompts, slots)
        logits = logits[torch.tensor(row_groups, device=logits.device)]
        tokens, logprobs = self.sampler.sample(logits, start=start)
        end = start + len(rows)
        lengths = [len(r.request.prompt) for r in rows]
        self.positions[start:end] = torch.tensor(lengths)
        self.span = max(self.span, max(lengths) + 1)
        self.last_tokens[start:end] = tokens
        self.rows.extend(rows)
        return tokens, logprobs

    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step for every live slot; returns the sampled tokens and logprobs."""
        count = len(self.rows)
        inputs = self.last_tokens[:count], self.positions[:count], self.span
        draw = self.sampler.unfiltered_draw(count)
        if draw is not None:  # the common case: sampling ends the (compiled) decode step
            tokens, logprobs = self.decoder.decode_and_sample(*inputs, draw)
        else:
            tokens, logprobs = self.sampler.sample(self.decoder.decode(*inputs))
        self.positions[:count] += 1
        self.span += 1
        self.last_tokens[:count] = tokens
        return tokens, logprobs

    def retire(self) -> None:
        """Drop finished rows: live rows past the new end move into the slots finished ones left."""
        live = sum(1 for row in self.rows if row.finish is None)
        if live == len(self.rows):
            return
        holes = [slot for slot in range(live) if self.rows[slot].finish is not None]
        movers = [slot for slot in range(live, len(self.rows)) if self.rows[slot].finish is None]
        if movers:
            length = int(self.positions[movers].max())
            self.decoder.move(movers, holes, length)
            self.sampler.move(movers, holes)
            self.positions[holes] = self.positions[movers]
            self.last_tokens[holes] = self.last_tokens[movers]
            for hole, mover in zip(holes, movers, strict=True):
                self.rows[hole] = self.rows[mover]
        del self.rows[live:]
        self.span = int(self.positions[:live].max()) + 1 if live else 0
