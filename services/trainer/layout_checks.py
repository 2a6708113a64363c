"""Checks, at load, that a model keeps the samples of a micro-batch apart as ``batching``
lays them out: packed end to end (position ids restart) and with a shared prompt (a 4D
attention mask). A model that fails one is trained without that layout, with a warning."""

from __future__ import annotations

import logging
from typing import Any

import torch

from services.trainer.batching import TrainSample, collate

log = logging.getLogger(__name__)


@torch.no_grad()
def packs_exactly(model: torch.nn.Module, vocab_size: int, tolerance: float = 1e-3) -> bool:
    """Whether ``model`` keeps two samples laid end to end in one row apart, given restarting
    position ids and no attention mask: its outputs for them, packed, equal those of each alone
    (to ``tolerance`` of their scale). Models that ignore packed position ids fail."""
    generator = torch.Generator().manual_seed(0)
    parts = [torch.randint(0, vocab_size, (n,), generator=generator) for n in (6, 5)]
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        alone = [model(input_ids=p[None].to(device), use_cache=False)[0][0].float() for p in parts]
        packed = model(
            input_ids=torch.cat(parts)[None].to(device),
            position_ids=torch.cat([torch.arange(len(p)) for p in parts])[None].to(device),
            use_cache=False,
        )[0][0].float()
    finally:
        model.train(was_training)
    expected = torch.cat(alone)
    scale = float(expected.abs().max()) + 1.0
    return float((packed - expected).abs().max()) <= tolerance * scale


def packing_works(model: Any, role: str) -> bool:
    """Whether ``model`` keeps packed samples apart (batching.packs_exactly); logs when it does not."""
    if packs_exactly(model, int(model.config.vocab_size)):
        return True
    log.warning(
        "the %s model (%s) mixes samples packed in one row: trained one sample per row instead",
        role,
        type(model).__name__,
    )
    return False


@torch.no_grad()
def shares_exactly(model: torch.nn.Module, vocab_size: int, tolerance: float = 1e-3) -> bool:
    """Whether ``model`` gives two samples of one prompt, laid out with the prompt shared
    (``collate(shared=True)``), the outputs each gets alone at its response's positions (to
    ``tolerance`` of their scale)."""
    generator = torch.Generator().manual_seed(1)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, vocab_size, (n,), generator=generator).tolist()

    prompt = tokens(5)
    samples = [TrainSample(prompt, tokens(n), [True] * n, [0.0] * n, 0.0) for n in (4, 3)]
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        together = collate(samples, [1.0, 1.0], device, rows=[[0, 1]], shared=True)
        shared = model(**together.model_inputs())[0][0].float()
        alone = [model(**collate([s], [1.0], device).model_inputs())[0][0].float() for s in samples]
    finally:
        model.train(was_training)
    mine, expected = [], []
    for sample, (_, column), single in zip(samples, together.placements, alone, strict=True):
        first, count = column + len(prompt) - 1, 1 + len(sample.response_token_ids)
        mine.append(shared[first : first + count])
        expected.append(single[len(prompt) - 1 : len(prompt) - 1 + count])
    reference = torch.cat(expected)
    scale = float(reference.abs().max()) + 1.0
    return float((torch.cat(mine) - reference).abs().max()) <= tolerance * scale


def sharing_works(model: Any, role: str) -> bool:
    """Whether ``model`` honours shared prompts (``shares_exactly``); logs when it does not."""
    if shares_exactly(model, int(model.config.vocab_size)):
        return True
    log.warning(
        "the %s model (%s) does not keep samples apart under a shared prompt's attention mask: "
        "each sample carries its own prompt instead",
        role,
        type(model).__name__,
    )
    return False
