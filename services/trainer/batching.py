"""Training samples, their packing into micro-batches by a token budget, and collation.

A micro-batch is right-padded to its longest sequence, so its cost is
``rows * longest``; packing keeps that under ``trainer.micro_batch_tokens``.
Per-token tensors are aligned with the *targets* (``input_ids[:, 1:]``): the
logits at position t score token t + 1, so response token j of a sample whose
prompt has P tokens sits at column P + j - 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class TrainSample:
    """One response to learn from, with everything the loss needs."""

    prompt_token_ids: Sequence[int]
    response_token_ids: Sequence[int]
    loss_mask: Sequence[bool]
    behaviour_logprobs: Sequence[float]
    advantage: float

    @property
    def length(self) -> int:
        return len(self.prompt_token_ids) + len(self.response_token_ids)

    @property
    def loss_tokens(self) -> int:
        return sum(1 for keep in self.loss_mask if keep)


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """Right-padded tensors of a few samples; target-aligned ones have one column less."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    behaviour_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    weights: torch.Tensor
    tokens: int
    """Real (unpadded) tokens, prompts included."""


def pack_micro_batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped so that ``rows * longest <= token_budget`` in each group.

    First-fit decreasing: longest first, each into the first group it fits. A
    sequence longer than the budget on its own gets a group of its own. Every
    index appears exactly once.
    """
    if token_budget < 1:
        raise ValueError("token_budget must be >= 1")
    order = sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True)
    groups: list[list[int]] = []
    longest: list[int] = []  # the first (longest) length of each group
    for index in order:
        for slot, members in enumerate(groups):
            if (len(members) + 1) * longest[slot] <= token_budget:
                members.append(index)
                break
        else:
            groups.append([index])
            longest.append(lengths[index])
    return groups


def collate(
    samples: Sequence[TrainSample],
    token_weights: Sequence[float],
    device: torch.device | str,
    pad_token_id: int = 0,
) -> MicroBatch:
    """Right-padded tensors of ``samples`` on ``device``; ``token_weights`` holds each
    sample's aggregation weight per loss token (see losses.sample_token_weights)."""
    if not samples or len(samples) != len(token_weights):
        raise ValueError("collate needs one token weight per sample, and at least one sample")
    width = max(sample.length for sample in samples)
    rows = len(samples)
    input_ids = torch.full((rows, width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((rows, width), dtype=torch.long)
    targets = (rows, max(width - 1, 0))
    behaviour = torch.zeros(targets, dtype=torch.float32)
    advantages = torch.zeros(targets, dtype=torch.float32)
    mask = torch.zeros(targets, dtype=torch.bool)
    weights = torch.zeros(targets, dtype=torch.float32)
    for row, (sample, weight) in enumerate(zip(samples, token_weights, strict=True)):
        prompt_len = len(sample.prompt_token_ids)
        tokens = [*sample.prompt_token_ids, *sample.response_token_ids]
        input_ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        attention_mask[row, : len(tokens)] = 1
        span = slice(prompt_len - 1, prompt_len - 1 + len(sample.response_token_ids))
        behaviour[row, span] = torch.tensor(sample.behaviour_logprobs, dtype=torch.float32)
        mask[row, span] = torch.tensor(sample.loss_mask, dtype=torch.bool)
        advantages[row, span] = sample.advantage
        weights[row, span] = weight
    return MicroBatch(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        behaviour_logprobs=behaviour.to(device),
        advantages=advantages.to(device),
        mask=mask.to(device),
        weights=(weights * mask).to(device),
        tokens=sum(sample.length for sample in samples),
    )


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """log p of each next token, in fp32: ``[batch, tokens - 1]``, aligned with the targets.

    log_softmax of the raw logits (temperature 1), like the engines' behaviour logprobs.
    """
    shifted = logits[:, :-1].float()
    targets = input_ids[:, 1:].unsqueeze(-1)
    return shifted.gather(-1, targets).squeeze(-1) - torch.logsumexp(shifted, dim=-1)
