"""The policy being trained: a Hugging Face causal LM inside a DeepSpeed engine.

All methods block (run them in a thread). One optimiser step packs its samples
into micro-batches by ``trainer.micro_batch_tokens``, runs forward/backward on
each with DeepSpeed's accumulation boundary set on the last one, then steps.
The token weights normalise over the whole step, so the accumulated gradient is
the full-batch gradient however the samples were packed.
"""

from __future__ import annotations

import copy
import gc
import logging
import os
import random
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from services.common.config import JobSpec, TrainerConfig
from services.trainer.batching import TrainSample, collate, pack_micro_batches, token_logprobs
from services.trainer.losses import PolicyLossInputs, get_policy_loss, sample_token_weights

log = logging.getLogger(__name__)

RESERVED_DEEPSPEED_KEYS = frozenset(
    {
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "optimizer",
        "scheduler",
    }
)
"""Set by the trainer itself: batch sizes follow from the token budget, and the optimiser and
schedule from the trainer section."""

DISTRIBUTED_TIMEOUT = timedelta(seconds=60)
"""Deadline of collective operations of the one-process group."""

SCHEDULES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}
"""trainer.scheduler -> the transformers schedule of that shape (all with linear warm-up)."""


@dataclass(frozen=True, slots=True)
class StepStats:
    """What one rollout batch's optimisation did (means over its optimiser steps)."""

    loss: float
    clip_fraction: float
    approx_kl: float
    grad_norm: float
    learning_rate: float
    optimizer_steps: int
    tokens: int
    """Tokens run through forward and backward, prompts included, over all passes."""


def select_device(setting: str) -> torch.device:
    """``auto``: cuda when available, else cpu."""
    if setting == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("the trainer is set to run on cuda, but torch sees no CUDA device")
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(setting)


def init_distributed(device: torch.device) -> None:
    """A one-process torch.distributed group, which DeepSpeed requires; once per process.

    Its store is in memory: one process needs no rendezvous port, so none can be taken or
    shared by mistake, and no MASTER_* variables leak to child processes.
    """
    if device.type == "cpu" and torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported
    import deepspeed

    backend = "nccl" if device.type == "cuda" else "gloo"
    if not torch.distributed.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) != 1:
            raise RuntimeError("the trainer runs as one process; WORLD_SIZE must be 1 or unset")
        os.environ.setdefault("LOCAL_RANK", "0")  # the DeepSpeed engine reads it
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.distributed.init_process_group(
            backend, store=torch.distributed.HashStore(), rank=0, world_size=1, timeout=DISTRIBUTED_TIMEOUT
        )
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)


def deepspeed_config(trainer: TrainerConfig, dtype: str) -> dict[str, Any]:
    """The DeepSpeed config derived from the trainer section, with ``trainer.deepspeed`` merged over it."""
    overrides = trainer.deepspeed or {}
    reserved = sorted(RESERVED_DEEPSPEED_KEYS & set(overrides))
    if reserved:
        raise ValueError(f"trainer.deepspeed may not set {', '.join(reserved)}: the trainer sets them")
    derived: dict[str, Any] = {
        # One backward call per micro-batch. Their number per step varies with the packing, so
        # the trainer marks the accumulation boundary itself and DeepSpeed's counter stays at 1.
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": trainer.max_grad_norm or 0.0,
        "zero_optimization": {"stage": trainer.zero_stage},
        "bf16": {"enabled": dtype == "bfloat16"},
        "fp16": {"enabled": dtype == "float16"},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    return _merge(derived, overrides)


def _merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def learning_rate_schedule(
    optimizer: torch.optim.Optimizer, trainer: TrainerConfig, completed_versions: int
) -> torch.optim.lr_scheduler.LRScheduler:
    """Warm-up then trainer.scheduler's shape, advanced past ``completed_versions`` rollout batches."""
    from transformers import get_scheduler

    steps_per_version = trainer.ppo_epochs * trainer.mini_batches
    schedule = get_scheduler(
        SCHEDULES[trainer.scheduler],
        optimizer,
        num_warmup_steps=trainer.warmup_steps,
        num_training_steps=trainer.steps * steps_per_version,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # stepping before optimizer.step() is the point
        for _ in range(completed_versions * steps_per_version):
            schedule.step()
    return schedule


class Policy:
    """A DeepSpeed-wrapped causal LM with its tokenizer."""

    def __init__(self, engine: Any, tokenizer: Any, spec: JobSpec) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.spec = spec
        self.device = torch.device(engine.device)
        self.loss_fn = get_policy_loss(spec.algorithm.policy_loss)

    @classmethod
    def load(
        cls,
        spec: JobSpec,
        model_dir: Path,
        tokenizer_dir: Path,
        device: torch.device,
        completed_versions: int = 0,
    ) -> Policy:
        """Load weights and tokenizer, and build the optimiser, schedule and DeepSpeed engine.

        ``completed_versions``: rollout batches already trained into these weights (when a job
        resumes), so the learning-rate schedule carries on where it was. The optimiser's
        moments start afresh: checkpoints hold weights only.
        """
        import deepspeed
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # one bar per save is noise in a service's log
        if spec.model.dtype == "float16" and device.type != "cuda":
            raise ValueError("model.dtype float16 needs a GPU; use float32 or bfloat16 on CPU")
        trust = spec.model.trust_remote_code
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=trust)
        torch.manual_seed(spec.seed)
        # fp32 master weights; DeepSpeed casts the module itself when bf16 or fp16 is on.
        model = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=trust).float()
        trainer = spec.trainer
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=trainer.learning_rate, weight_decay=trainer.weight_decay
        )
        engine, _, _, _ = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            lr_scheduler=learning_rate_schedule(optimizer, trainer, completed_versions),
            config=deepspeed_config(trainer, spec.model.dtype),
        )
        return cls(engine, tokenizer, spec)

    def optimise(self, samples: Sequence[TrainSample], seed: int) -> StepStats:
        """``ppo_epochs`` passes over the samples, each split into ``mini_batches`` optimiser steps."""
        if not samples:
            raise ValueError("no samples to optimise on")
        trainer = self.spec.trainer
        rng = random.Random(seed)
        results: list[tuple[float, float, float, float, int, int]] = []
        for _ in range(trainer.ppo_epochs):
            order = list(range(len(samples)))
            if trainer.mini_batches > 1:
                rng.shuffle(order)
            for part in range(trainer.mini_batches):
                chunk = [samples[i] for i in order[part :: trainer.mini_batches]]
                if chunk:
                    results.append(self._optimiser_step(chunk))
        loss_tokens = sum(r[4] for r in results) or 1
        return StepStats(
            loss=sum(r[0] for r in results) / len(results),
            clip_fraction=sum(r[1] * r[4] for r in results) / loss_tokens,
            approx_kl=sum(r[2] * r[4] for r in results) / loss_tokens,
            grad_norm=sum(r[3] for r in results) / len(results),
            learning_rate=float(self.engine.get_lr()[0]),
            optimizer_steps=len(results),
            tokens=sum(r[5] for r in results),
        )

    def _optimiser_step(self, samples: Sequence[TrainSample]) -> tuple[float, float, float, float, int, int]:
        """One optimiser step; returns loss, clip fraction, approx KL, grad norm, loss tokens, tokens."""
        algorithm = self.spec.algorithm
        weights = sample_token_weights(
            [s.loss_tokens for s in samples], algorithm.loss_aggregation, self.spec.rollout.max_new_tokens
        )
        packs = pack_micro_batches([s.length for s in samples], self.spec.trainer.micro_batch_tokens)
        self.engine.train()
        loss = clipped = kl = 0.0
        loss_tokens = tokens = 0
        for index, pack in enumerate(packs):
            batch = collate([samples[i] for i in pack], [weights[i] for i in pack], self.device)
            self.engine.set_gradient_accumulation_boundary(index == len(packs) - 1)
            logits = self.engine(
                input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False
            ).logits
            inputs = PolicyLossInputs(
                logprobs=token_logprobs(logits, batch.input_ids),
                behaviour_logprobs=batch.behaviour_logprobs,
                advantages=batch.advantages,
                mask=batch.mask,
                weights=batch.weights,
            )
            result = self.loss_fn(inputs, algorithm)
            self.engine.backward(result.loss, scale_wrt_gas=False)
            loss += float(result.loss.detach())
            clipped += result.clip_fraction * result.tokens
            kl += result.approx_kl * result.tokens
            loss_tokens += result.tokens
            tokens += batch.tokens
        own_norm = self._gradient_norm() if self.spec.trainer.zero_stage == 0 else None
        self.engine.step()
        reported = self.engine.get_global_grad_norm()
        grad_norm = float(reported) if reported is not None else float(own_norm or 0.0)
        per_token = max(loss_tokens, 1)
        return loss, clipped / per_token, kl / per_token, grad_norm, loss_tokens, tokens

    def _gradient_norm(self) -> float:
        """The gradient norm before clipping, for ZeRO stage 0 (whose engine does not report it)."""
        norms = [
            p.grad.detach().float().norm() for p in self.engine.module.parameters() if p.grad is not None
        ]
        return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0

    @torch.no_grad()
    def response_logprobs(self, samples: Sequence[TrainSample]) -> list[list[float]]:
        """log p of each response token of each sample under the current weights."""
        self.engine.eval()
        found: dict[int, list[float]] = {}
        packs = pack_micro_batches([s.length for s in samples], self.spec.trainer.micro_batch_tokens)
        for pack in packs:
            chunk = [samples[i] for i in pack]
            batch = collate(chunk, [0.0] * len(chunk), self.device)
            logits = self.engine(
                input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False
            ).logits
            logprobs = token_logprobs(logits, batch.input_ids).cpu()
            for row, (index, sample) in enumerate(zip(pack, chunk, strict=True)):
                start = len(sample.prompt_token_ids) - 1
                found[index] = logprobs[row, start : start + len(sample.response_token_ids)].tolist()
        return [found[i] for i in range(len(samples))]

    def save(self, directory: Path) -> None:
        """An HF-loadable directory: one model.safetensors, config, tokenizer files."""
        import deepspeed

        module = self.engine.module
        gather = self.spec.trainer.zero_stage == 3  # ZeRO-3 holds only shards: gather them to save
        with deepspeed.zero.GatheredParameters(list(module.parameters()), enabled=gather):
            # One file whatever the size: engines verify the sha256 of model.safetensors.
            module.save_pretrained(directory, max_shard_size="100000GB")
        self.tokenizer.save_pretrained(directory)

    def close(self) -> None:
        """Release the engine's memory before the next job."""
        destroy = getattr(self.engine, "destroy", None)
        if callable(destroy):
            destroy()
        self.engine = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
