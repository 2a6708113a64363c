"""Padding-free packing: several samples end to end in one row, each with its own position ids,
and shared prompts: the samples of one prompt computing it once.

The plan (which samples share a row, which rows a micro-batch), the collated tensors of a
packed row, and the models: a packed or shared forward must give every sample what it gets
alone, and the same gradient.
"""

from __future__ import annotations

import collections
import logging
import random
from typing import Any

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedModel

from services.trainer.batching import (
    SHARED_SAMPLE_TOKENS,
    TrainSample,
    collate,
    collate_pack,
    padding_waste,
    per_response_token,
    plan_micro_batches,
    plan_samples,
    sharing_pays,
    token_logprobs,
)
from services.trainer.layout_checks import packing_works, packs_exactly, shares_exactly, sharing_works
from tests.unit.test_decoder import build as decoder_model


def build(kind: str) -> PreTrainedModel:
    if kind != "gpt2":  # the slot decoder's tiny test models
        return decoder_model(kind)
    torch.manual_seed(5)
    return GPT2LMHeadModel(GPT2Config(vocab_size=90, n_embd=64, n_layer=2, n_head=4, n_positions=512)).eval()


def sample(prompt: list[int], response: list[int], advantage: float = 1.0) -> TrainSample:
    logprobs = [-0.1 * (i + 1) for i in range(len(response))]
    return TrainSample(prompt, response, [True] * len(response), logprobs, advantage)


def random_samples(rng: random.Random, count: int, vocab: int = 90) -> list[TrainSample]:
    return [
        sample(
            [rng.randrange(vocab) for _ in range(rng.randint(1, 9))],
            [rng.randrange(vocab) for _ in range(rng.randint(1, 30))],
            rng.uniform(-1, 1),
        )
        for _ in range(count)
    ]


@pytest.mark.parametrize("seed", range(6))
def test_the_plan_places_every_sample_once_within_the_budget(seed: int) -> None:
    rng = random.Random(seed)
    budget = rng.choice([32, 100, 1024])
    lengths = [rng.randint(2, 60) for _ in range(rng.randint(1, 80))]
    packs = plan_micro_batches(lengths, budget)
    assert sorted(i for pack in packs for row in pack for i in row) == list(range(len(lengths)))
    for pack in packs:
        fills = [sum(lengths[i] for i in row) for row in pack]
        # Rows are 1 to 2 times as wide as the longest sample, and no wider than the budget.
        assert max(fills) <= max(max(lengths), min(2 * max(lengths), budget))
        assert len(pack) == 1 or len(pack) * max(fills) <= budget
    unpacked = plan_micro_batches(lengths, budget, packed=False)
    assert all(len(row) == 1 for pack in unpacked for row in pack)


@pytest.mark.parametrize(("samples", "budget"), [(64, 2048), (128, 4096), (256, 8192), (1024, 8192)])
def test_packing_all_but_removes_padding_on_long_tailed_lengths(samples: int, budget: int) -> None:
    rng = random.Random(samples)
    lengths = [40 + min(round(rng.lognormvariate(3.5, 0.8)), 256) for _ in range(samples)]
    packed, unpacked = plan_micro_batches(lengths, budget), plan_micro_batches(lengths, budget, packed=False)
    assert padding_waste(lengths, packed) < 0.05 < padding_waste(lengths, unpacked)


def test_rows_widen_only_where_that_saves_more_padding_than_attention_costs() -> None:
    # Three samples of 10 and three of 6: rows of 10 hold one each (waste 20%); rows of 16
    # hold one 10 and one 6 (no waste), and that pays for attention over wider rows.
    assert plan_micro_batches([10, 10, 10, 6, 6, 6], 1024) == [[[0, 3], [1, 4], [2, 5]]]
    # Equal lengths fill rows of the longest exactly: no reason to widen them.
    assert all(len(row) == 1 for pack in plan_micro_batches([8] * 5, 64) for row in pack)


def test_a_packed_row_restarts_positions_and_keeps_targets_apart() -> None:
    first, second, third = sample([1, 5], [6, 7], 0.5), sample([1], [4], -1.0), sample([3, 3, 3], [8])
    batch = collate([first, second, third], [0.25, 0.5, 1.0], "cpu", rows=[[0, 1], [2]])
    assert batch.attention_mask is None  # the position ids mark the samples
    assert batch.input_ids.tolist() == [[1, 5, 6, 7, 1, 4], [3, 3, 3, 8, 0, 0]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 0, 1]]
    assert batch.placements == ((0, 0), (0, 4), (1, 0))
    # Column t scores token t + 1; column 3 would score the second sample's first token: off.
    assert batch.mask.tolist() == [[False, True, True, False, True], [False, False, True, False, False]]
    assert batch.advantages[0].tolist() == [0.0, 0.5, 0.5, 0.0, -1.0]
    assert batch.weights[0].tolist() == [0.0, 0.25, 0.25, 0.0, 0.5]
    assert (batch.tokens, batch.padded_tokens) == (10, 12)
    inputs = batch.model_inputs()
    assert "attention_mask" not in inputs and inputs["position_ids"] is batch.position_ids
    with pytest.raises(ValueError, match="exactly once"):
        collate([first, second], [1.0, 1.0], "cpu", rows=[[0, 0]])


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "gpt2"])
def test_packed_rows_give_each_sample_its_own_logprobs(kind: str) -> None:
    model = build(kind)
    samples = random_samples(random.Random(1), 12)

    def logprobs(batch: Any) -> torch.Tensor:
        return token_logprobs(model(**batch.model_inputs()).logits, batch.input_ids)

    with torch.no_grad():
        alone = [per_response_token([s], 10_000, "cpu", logprobs, packed=False)[0] for s in samples]
        packed = per_response_token(samples, 128, "cpu", logprobs, packed=True)
    plan = plan_micro_batches([s.length for s in samples], 128)
    assert any(len(row) > 1 for pack in plan for row in pack)  # some rows really are shared
    assert packs_exactly(model, 90)
    for mine, reference in zip(packed, alone, strict=True):
        assert mine == pytest.approx(reference, abs=1e-5)


@pytest.mark.parametrize("shared", [False, True])
def test_packed_or_shared_and_padded_micro_batches_give_the_same_gradient(shared: bool) -> None:
    samples = groups_of(random.Random(4), 3, 4)
    weights = [1.0 / sum(s.loss_tokens for s in samples)] * len(samples)

    def gradient(packed: bool) -> list[torch.Tensor]:
        model = build("llama").train()
        for pack in plan_samples(samples, 96, packed, shared):
            batch = collate_pack(samples, weights, pack, "cpu", shared and packed)
            logprobs = token_logprobs(model(**batch.model_inputs()).logits, batch.input_ids)
            (-(logprobs * batch.advantages * batch.weights).sum()).backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    for a, b in zip(gradient(True), gradient(False), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


class CumulativeLM(torch.nn.Module):
    """Mixes every earlier token of its row into each position and ignores position ids: a
    model that packing would corrupt."""

    def __init__(self) -> None:
        super().__init__()
        self.config = type("Config", (), {"vocab_size": 30})()
        self.embed = torch.nn.Embedding(30, 8)
        self.head = torch.nn.Linear(8, 30)

    def forward(self, input_ids: torch.Tensor, **_: Any) -> tuple[torch.Tensor]:
        hidden = self.embed(input_ids).cumsum(dim=1)
        return (self.head(hidden),)


@pytest.mark.parametrize(
    ("exact", "works", "warning"),
    [(packs_exactly, packing_works, "one sample per row"), (shares_exactly, sharing_works, "its own prompt")],
)
def test_a_model_that_mixes_samples_is_trained_without_that_layout(
    exact: Any, works: Any, warning: str, caplog: pytest.LogCaptureFixture
) -> None:
    model = CumulativeLM()  # neither packing nor a shared prompt's mask keeps its samples apart
    assert not exact(model, 30)
    with caplog.at_level(logging.WARNING):
        assert not works(model, "policy")
    assert warning in caplog.text
    assert works(build("llama"), "policy")


def groups_of(rng: random.Random, prompts: int, size: int, vocab: int = 90) -> list[TrainSample]:
    """GRPO-like samples: ``prompts`` prompts x ``size`` responses each, groups interleaved."""
    heads = [[rng.randrange(vocab) for _ in range(rng.randint(1, 9))] for _ in range(prompts)]
    samples = [
        sample(head, [rng.randrange(vocab) for _ in range(rng.randint(1, 12))], rng.uniform(-1, 1))
        for head in heads
        for _ in range(size)
    ]
    rng.shuffle(samples)
    return samples


def test_a_shared_prompt_is_laid_out_once_with_each_response_in_its_own_span() -> None:
    first = sample([1, 2, 3], [4, 5], advantage=0.5)
    second = sample([1, 2, 3], [6], advantage=-1.0)
    batch = collate([first, second], [0.25, 0.5], "cpu", rows=[[0, 1]], shared=True)
    # prefix [1, 2], then [3, 4, 5] and [3, 6]: the prompt's last token starts each span
    assert batch.input_ids[0].tolist() == [1, 2, 3, 4, 5, 3, 6]
    assert batch.position_ids[0].tolist() == [0, 1, 2, 3, 4, 2, 3]
    assert batch.placements == ((0, 0), (0, 3)), "column + prompt length - 1: the first target"
    assert batch.mask[0].tolist() == [False, False, True, True, False, True]
    assert batch.advantages[0].tolist() == [0.0, 0.0, 0.5, 0.5, 0.0, -1.0]
    assert batch.weights[0].tolist() == [0.0, 0.0, 0.25, 0.25, 0.0, 0.5]
    assert (batch.tokens, batch.padded_tokens) == (7, 7)
    allowed = batch.model_inputs()["attention_mask"]
    assert isinstance(allowed, torch.Tensor) and allowed.shape == (1, 1, 7, 7)
    seen = [[int(v) for v in row] for row in allowed[0, 0].tolist()]
    assert seen == [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0],
        [1, 1, 0, 0, 0, 1, 0],  # the second span sees the prefix and itself, not the first span
        [1, 1, 0, 0, 0, 1, 1],
    ]
    other = sample([7, 8], [9])  # another prompt: a unit of its own, its own prefix
    batch = collate([first, other], [1.0, 1.0], "cpu", rows=[[0, 1]], shared=True)
    assert batch.input_ids[0].tolist() == [1, 2, 3, 4, 5, 7, 8, 9]
    assert batch.model_inputs()["attention_mask"][0, 0, 6].tolist() == [False] * 5 + [True, True, False]


@pytest.mark.parametrize("seed", range(4))
def test_the_shared_plan_keeps_a_prompts_samples_together_within_the_budget(seed: int) -> None:
    rng = random.Random(seed)
    samples = groups_of(rng, rng.randint(1, 12), rng.choice([1, 4, 8]))
    budget = rng.choice([64, 256, 1024])
    packs = plan_samples(samples, budget, shared=True)
    assert sorted(i for pack in packs for row in pack for i in row) == list(range(len(samples)))
    for pack in packs:
        batch = collate_pack(samples, [1.0] * len(samples), pack, "cpu", shared=True)
        assert batch.padded_tokens <= max(budget, max(s.length for s in samples) * 8)
    plain = sum(s.length for s in samples)
    laid_out = sum(collate_pack(samples, [1.0] * len(samples), p, "cpu", shared=True).tokens for p in packs)
    counts = collections.Counter(tuple(s.prompt_token_ids) for s in samples)
    shareable = any(count > 1 and len(prompt) > 1 for prompt, count in counts.items())
    assert laid_out < plain if shareable else laid_out == plain


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "gpt2"])
def test_shared_prompts_give_each_sample_its_own_logprobs(kind: str) -> None:
    model = build(kind)
    samples = groups_of(random.Random(3), 4, 4)

    def logprobs(batch: Any) -> torch.Tensor:
        return token_logprobs(model(**batch.model_inputs()).logits, batch.input_ids)

    with torch.no_grad():
        alone = [per_response_token([s], 10_000, "cpu", logprobs, packed=False)[0] for s in samples]
        shared = per_response_token(samples, 128, "cpu", logprobs, packed=True, shared=True)
    assert shares_exactly(model, 90)
    packs = plan_samples(samples, 128, shared=True)
    laid_out = sum(collate_pack(samples, [0.0] * len(samples), p, "cpu", shared=True).tokens for p in packs)
    assert laid_out < sum(s.length for s in samples), "the prompts really are shared"
    for mine, reference in zip(shared, alone, strict=True):
        assert mine == pytest.approx(reference, abs=1e-5)


def test_steps_of_long_samples_do_not_share_their_prompts() -> None:
    """Past SHARED_SAMPLE_TOKENS a piece of a group is one sample, and its rows would need
    width x width masks: such a step is packed as usual."""
    short = groups_of(random.Random(5), 2, 4)
    assert sharing_pays(short, True) and not sharing_pays(short, False)
    long = [sample([1, 2, 3], [5] * SHARED_SAMPLE_TOKENS), sample([1, 2, 3], [6] * 9)]
    assert not sharing_pays(long, True)
    masks = []

    def forward(batch: Any) -> torch.Tensor:
        masks.append(batch.attention_mask)
        return torch.zeros(batch.input_ids.shape[0], batch.input_ids.shape[1] - 1)

    per_response_token(long, 4096, "cpu", forward, packed=True, shared=True)
    assert masks == [None], "packed by position ids, no 4D mask"
