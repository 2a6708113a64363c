"""Training samples, their packing into micro-batches by a token budget, and collation.

A micro-batch is right-padded to its longest sequence, so its cost is
``rows * longest``; packing keeps that under ``trainer.micro_batch_tokens``.
Per-token tensors are aligned with the *targets* (``input_ids[:, 1:]``): the
logits at position t score token t + 1, so response token j of a sample whose
prompt has P tokens sits at column P + j - 1.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class TrainSample:
    """One response to learn from, with everything the loss needs.

    The optional per-token lists are aligned with ``response_token_ids`` and filled in
    at the start of a step (``services/trainer/prepare.py``); left None they default
    as their docstrings say.
    """

    prompt_token_ids: Sequence[int]
    response_token_ids: Sequence[int]
    loss_mask: Sequence[bool]
    behaviour_logprobs: Sequence[float]
    advantage: float | Sequence[float]
    """One per response token, or one number for all of them (an outcome estimator's)."""
    old_logprobs: Sequence[float] | None = None
    """log p under the trainer's weights when the step began (PPO's old policy); None: behaviour's."""
    ref_logprobs: Sequence[float] | None = None
    """log p under the frozen reference model; None when there is no KL term."""
    returns: Sequence[float] | None = None
    """The critic's targets (GAE); None without a critic."""
    old_values: Sequence[float] | None = None
    """The critic's values when the step began (for the value clip); None without a critic."""
    is_weights: Sequence[float] | None = None
    """Truncated importance weight of each token's policy loss (TIS); None: 1."""
    weight: float = 1.0
    """Multiplies every token weight of the sample (staleness downweighting)."""

    @property
    def length(self) -> int:
        return len(self.prompt_token_ids) + len(self.response_token_ids)

    @property
    def loss_tokens(self) -> int:
        return sum(1 for keep in self.loss_mask if keep)

    def token_advantages(self) -> list[float]:
        if isinstance(self.advantage, int | float):
            return [float(self.advantage)] * len(self.response_token_ids)
        if len(self.advantage) != len(self.response_token_ids):
            raise ValueError("a sample needs one advantage per response token")
        return [float(a) for a in self.advantage]


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """Right-padded tensors of a few samples; target-aligned ones have one column less."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    behaviour_logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    """The trainer's logprobs at the start of the step (behaviour's where a sample has none)."""
    ref_logprobs: torch.Tensor
    """The reference model's logprobs (0 where a sample has none)."""
    advantages: torch.Tensor
    returns: torch.Tensor
    old_values: torch.Tensor
    is_weights: torch.Tensor
    """TIS weight of each token (1 where a sample has none)."""
    mask: torch.Tensor
    weights: torch.Tensor
    """Aggregation weight x the sample's weight; 0 off the mask."""
    tokens: int
    """Real (unpadded) tokens, prompts included."""
    padded_tokens: int
    """Tokens the forward pass computes: rows x the longest row."""


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
    per_token = {
        name: torch.full(targets, 1.0 if name == "is_weights" else 0.0, dtype=torch.float32)
        for name in ("behaviour", "old", "ref", "advantages", "returns", "old_values", "is_weights")
    }
    mask = torch.zeros(targets, dtype=torch.bool)
    weights = torch.zeros(targets, dtype=torch.float32)
    for row, (sample, weight) in enumerate(zip(samples, token_weights, strict=True)):
        prompt_len = len(sample.prompt_token_ids)
        tokens = [*sample.prompt_token_ids, *sample.response_token_ids]
        input_ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        attention_mask[row, : len(tokens)] = 1
        span = slice(prompt_len - 1, prompt_len - 1 + len(sample.response_token_ids))
        values = {
            "behaviour": sample.behaviour_logprobs,
            "old": sample.old_logprobs if sample.old_logprobs is not None else sample.behaviour_logprobs,
            "ref": sample.ref_logprobs,
            "advantages": sample.token_advantages(),
            "returns": sample.returns,
            "old_values": sample.old_values,
            "is_weights": sample.is_weights,
        }
        for name, value in values.items():
            if value is not None:
                per_token[name][row, span] = torch.tensor(value, dtype=torch.float32)
        mask[row, span] = torch.tensor(sample.loss_mask, dtype=torch.bool)
        weights[row, span] = weight * sample.weight
    on = {name: tensor.to(device) for name, tensor in per_token.items()}
    return MicroBatch(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        behaviour_logprobs=on["behaviour"],
        old_logprobs=on["old"],
        ref_logprobs=on["ref"],
        advantages=on["advantages"],
        returns=on["returns"],
        old_values=on["old_values"],
        is_weights=on["is_weights"],
        mask=mask.to(device),
        weights=(weights * mask).to(device),
        tokens=sum(sample.length for sample in samples),
        padded_tokens=rows * width,
    )


def per_response_token(
    samples: Sequence[TrainSample],
    token_budget: int,
    device: torch.device | str,
    forward: Callable[[MicroBatch], torch.Tensor],
) -> list[list[float]]:
    """``forward``'s target-aligned ``[rows, width - 1]`` output, cut to each sample's response
    tokens: samples packed to ``token_budget`` and run a micro-batch at a time."""
    found: dict[int, list[float]] = {}
    for pack in pack_micro_batches([s.length for s in samples], token_budget):
        chunk = [samples[i] for i in pack]
        values = forward(collate(chunk, [0.0] * len(chunk), device)).detach().float().cpu()
        for row, (index, sample) in enumerate(zip(pack, chunk, strict=True)):
            start = len(sample.prompt_token_ids) - 1
            found[index] = values[row, start : start + len(sample.response_token_ids)].tolist()
    return [found[i] for i in range(len(samples))]


def response_matrix(rows: Sequence[Sequence[float]], fill: float = 0.0) -> torch.Tensor:
    """Per-response-token lists as one ``[samples, longest]`` float64 tensor, padded with ``fill``."""
    width = max((len(row) for row in rows), default=0)
    matrix = torch.full((len(rows), width), fill, dtype=torch.float64)
    for index, row in enumerate(rows):
        matrix[index, : len(row)] = torch.tensor(list(row), dtype=torch.float64)
    return matrix


def response_mask(samples: Sequence[TrainSample]) -> torch.Tensor:
    """The loss mask of each sample's response tokens, ``[samples, longest]``, False past the end."""
    width = max((len(s.response_token_ids) for s in samples), default=0)
    mask = torch.zeros((len(samples), width), dtype=torch.bool)
    for index, sample in enumerate(samples):
        mask[index, : len(sample.loss_mask)] = torch.tensor(list(sample.loss_mask), dtype=torch.bool)
    return mask


def unpad(matrix: torch.Tensor, samples: Sequence[TrainSample]) -> list[list[float]]:
    """The rows of a ``[samples, longest]`` response tensor, each cut to its sample's length."""
    return [matrix[i, : len(s.response_token_ids)].tolist() for i, s in enumerate(samples)]


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """log p of each next token, in fp32: ``[batch, tokens - 1]``, aligned with the targets.

    log_softmax of the raw logits (temperature 1), like the engines' behaviour logprobs.
    """
    shifted = logits[:, :-1].float()
    targets = input_ids[:, 1:].unsqueeze(-1)
    return shifted.gather(-1, targets).squeeze(-1) - torch.logsumexp(shifted, dim=-1)
