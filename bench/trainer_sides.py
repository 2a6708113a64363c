"""The RL batch and the sides of bench/trainer.py: verst's ``Policy.optimise`` (DeepSpeed) and a
plain torch forward/backward/AdamW loop over the same micro-batches, or over naive ones.

The batch is built the way the trainer builds one: ``Trajectory`` groups (one prompt per group,
responses of long-tailed lengths, the model's own behaviour logprobs, 0/1 rewards) go through
``services.trainer.prepare.prepare``, which sets the old logprobs and the GRPO advantages.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import deepspeed
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.common.config import JobSpec, parse_job_spec
from services.common.pb import common_pb2
from services.trainer.batching import (
    MicroBatch,
    Pack,
    TrainSample,
    collate_pack,
    per_response_token,
    token_logprobs,
)
from services.trainer.losses import PolicyLossInputs, ppo_clip, sample_token_weights
from services.trainer.policy import Policy, init_distributed
from services.trainer.prepare import prepare

CPU = torch.device("cpu")
LENGTH_SIGMA = 0.8
"""Spread of the log-normal response lengths (about 4% reach max_new_tokens at a median of a quarter)."""


@dataclass(frozen=True, slots=True)
class Shape:
    """What one model trains on: ``groups`` prompts x ``group_size`` responses of up to
    ``max_new_tokens`` tokens."""

    groups: int
    group_size: int
    max_new_tokens: int

    @property
    def samples(self) -> int:
        return self.groups * self.group_size


@dataclass(frozen=True, slots=True)
class StepResult:
    """One timed optimiser step of a side."""

    seconds: float
    tokens: int
    """Real (unpadded) tokens, prompts included."""
    padded_tokens: int
    """Tokens the forward passes computed: rows x the longest row, summed over micro-batches."""
    loss: float
    grad_norm: float
    """Before clipping."""


def job_spec(model_dir: Path, shape: Shape, micro_batch_tokens: int, learning_rate: float) -> JobSpec:
    """A GRPO job on ``model_dir``: ppo_clip, token-mean aggregation, ZeRO-1, clipping at 1.0
    (the defaults), one optimiser step per rollout batch; prompts not shared, so that both sides
    run the very same micro-batches (what sharing saves, bench/loop_stages.py shows)."""
    return parse_job_spec(
        {
            "name": "bench-trainer",
            "model": {"path": str(model_dir)},
            "algorithm": {"advantage": "grpo", "group_size": shape.group_size, "max_staleness": 0},
            "rollout": {"prompts_per_step": shape.groups, "max_new_tokens": shape.max_new_tokens},
            "trainer": {
                "micro_batch_tokens": micro_batch_tokens,
                "learning_rate": learning_rate,
                "share_prompts": False,
            },
        }
    )


def response_lengths(shape: Shape, rng: random.Random) -> list[int]:
    """Long-tailed lengths in 5..max_new_tokens: log-normal around a quarter of the budget, the
    tail cut at the budget (a response that ran out of tokens)."""
    low = min(5, shape.max_new_tokens)
    median = max(shape.max_new_tokens / 4, low)
    return [
        min(max(round(math.exp(rng.gauss(math.log(median), LENGTH_SIGMA))), low), shape.max_new_tokens)
        for _ in range(shape.samples)
    ]


class PlainModel:
    """A model directory loaded with plain transformers, fp32, with a torch AdamW on it."""

    def __init__(self, model_dir: Path, spec: JobSpec) -> None:
        torch.manual_seed(spec.seed)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).float().to(CPU)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=spec.trainer.learning_rate, weight_decay=spec.trainer.weight_decay
        )

    @torch.no_grad()
    def response_logprobs(self, samples: Sequence[TrainSample]) -> list[list[float]]:
        """log p of every response token (prepare's LogprobSource); micro-batches of 2048 tokens."""
        self.model.eval()
        return per_response_token(samples, 2048, CPU, self._token_logprobs)

    def _token_logprobs(self, batch: MicroBatch) -> torch.Tensor:
        return token_logprobs(self.model(**batch.model_inputs()).logits, batch.input_ids)


def rl_batch(
    model: PlainModel,
    prompts: Sequence[list[int]],
    shape: Shape,
    spec: JobSpec,
    tokenizer_dir: Path,
    seed: int,
    lengths: Sequence[int] | None = None,
) -> list[TrainSample]:
    """``shape.groups`` groups of ``group_size`` sampled-looking responses to ``prompts``, prepared
    by the trainer's own ``prepare`` (old logprobs, GRPO advantages) at version 0; response
    lengths ``lengths`` (one per sample) or else ``response_lengths``'s long tail."""
    if len(prompts) < shape.groups:
        raise ValueError(f"{shape.groups} groups need as many prompts; there are {len(prompts)}")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    eos, vocab = tokenizer.eos_token_id, len(tokenizer)
    specials = set(tokenizer.all_special_ids)
    ordinary = [i for i in range(vocab) if i not in specials]
    rng = random.Random(seed)
    if lengths is not None and len(lengths) != shape.samples:
        raise ValueError(f"{len(lengths)} response lengths for {shape.samples} samples")
    remaining = iter(lengths if lengths is not None else response_lengths(shape, rng))
    drafts = []
    for g in range(shape.groups):
        for _ in range(shape.group_size):
            length = next(remaining)
            response = [rng.choice(ordinary) for _ in range(length)]
            if length < shape.max_new_tokens:  # it stopped by itself; else it ran out of budget
                response[-1] = eos
            drafts.append(TrainSample(list(prompts[g]), response, [True] * length, [0.0] * length, 0.0))
    behaviour = model.response_logprobs(drafts)
    groups = []
    for g in range(shape.groups):
        first = g * shape.group_size
        groups.append(
            [
                common_pb2.Trajectory(
                    id=f"g{g}:{i}",
                    group_id=f"g{g}",
                    sample_index=i,
                    prompt_token_ids=drafts[first + i].prompt_token_ids,
                    response_token_ids=drafts[first + i].response_token_ids,
                    behaviour_logprobs=behaviour[first + i],
                    loss_mask=drafts[first + i].loss_mask,
                    policy_versions=[0] * len(drafts[first + i].response_token_ids),
                    reward=float(rng.random() < 0.5),
                )
                for i in range(shape.group_size)
            ]
        )
    return prepare(groups, spec, version=0, policy=model).samples


def naive_packs(count: int, rows: int) -> list[Pack]:
    """Fixed-size micro-batches of ``rows`` samples in arrival order, one sample per row (no
    sorting, no budget, no packing)."""
    return [[[i] for i in range(start, min(start + rows, count))] for start in range(0, count, rows)]


class VerstSide:
    """verst's trainer: ``Policy.load`` (DeepSpeed engine, ZeRO per the spec) and ``Policy.optimise``."""

    def __init__(self, model_dir: Path, spec: JobSpec) -> None:
        init_distributed(CPU)
        self.policy = Policy.load(spec, model_dir, model_dir, CPU)

    def step(self, samples: Sequence[TrainSample], seed: int) -> StepResult:
        start = time.perf_counter()
        stats = self.policy.optimise(samples, seed=seed)
        seconds = time.perf_counter() - start
        return StepResult(seconds, stats.tokens, stats.padded_tokens, stats.loss, stats.grad_norm)

    def close(self) -> None:
        self.policy.close()


class PlainSide:
    """A plain torch loop: per micro-batch forward, token logprobs, ``ppo_clip`` and backward;
    then gradient clipping (the trainer's max_grad_norm), ``AdamW.step`` and ``zero_grad``."""

    def __init__(self, model: PlainModel, spec: JobSpec) -> None:
        self.model = model.model
        self.optimizer = model.optimizer
        self.spec = spec

    def step(self, samples: Sequence[TrainSample], packs: Sequence[Pack]) -> StepResult:
        """One optimiser step over ``packs`` (rows of indices into ``samples``), collated each step."""
        algorithm, trainer = self.spec.algorithm, self.spec.trainer
        start = time.perf_counter()
        weights = sample_token_weights(
            [s.loss_tokens for s in samples], algorithm.loss_aggregation, self.spec.rollout.max_new_tokens
        )
        self.model.train()
        loss, tokens, padded = 0.0, 0, 0
        for pack in packs:
            batch = collate_pack(samples, weights, pack, CPU)
            logits = self.model(**batch.model_inputs()).logits
            logprobs = token_logprobs(logits, batch.input_ids)
            inputs = PolicyLossInputs(
                logprobs, batch.old_logprobs, batch.advantages, batch.mask, batch.weights * batch.is_weights
            )
            out = ppo_clip(inputs, algorithm)
            out.loss.backward()
            loss += float(out.loss.detach())
            tokens += batch.tokens
            padded += batch.padded_tokens
        clip = trainer.max_grad_norm or math.inf
        norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(time.perf_counter() - start, tokens, padded, loss, norm)


def describe(model: PlainModel) -> str:
    """Parameters and shape of the model."""
    config: Any = model.model.config
    count = sum(p.numel() for p in model.model.parameters())
    return (
        f"{count:,} parameters ({config.num_hidden_layers} layers, hidden {config.hidden_size},"
        f" vocab {config.vocab_size})"
    )


def versions() -> str:
    return f"deepspeed {deepspeed.__version__}"
