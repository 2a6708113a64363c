"""The frozen reference model of a job: its base model, for the KL penalty (``algorithm.kl_coef``).

Loaded once per job from ``model.path`` (never from a resumed checkpoint: the penalty
is to the model the job started from), in eval mode, without gradients, on the
trainer's device, in ``model.dtype``. Its logprobs are computed a micro-batch at a
time, packed to ``trainer.micro_batch_tokens`` like the policy's.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from services.common.config import JobSpec
from services.trainer.batching import MicroBatch, TrainSample, per_response_token, token_logprobs
from services.trainer.layout_checks import packing_works, sharing_works
from services.trainer.precision import autocast, keep_head_in_float32

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ReferenceModel:
    """A causal LM that is never trained: log p of response tokens under the base model."""

    def __init__(
        self, model: Any, spec: JobSpec, device: torch.device, packed: bool = True, shared: bool = False
    ) -> None:
        self.model = model
        self.spec = spec
        self.device = device
        self.packed = packed
        self.shared = shared

    @classmethod
    def load(cls, spec: JobSpec, model_dir: Path, device: torch.device) -> ReferenceModel:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            model_dir, trust_remote_code=spec.model.trust_remote_code, dtype=DTYPES[spec.model.dtype]
        )
        model.to(device).eval()
        model.requires_grad_(False)
        if spec.trainer.autocast != "off":
            keep_head_in_float32(model)
        log.info("reference model loaded from %s (%s)", model_dir, spec.model.dtype)
        packed = spec.trainer.packing and packing_works(model, "reference")
        shared = packed and spec.trainer.share_prompts and sharing_works(model, "reference")
        return cls(model, spec, device, packed, shared)

    @torch.no_grad()
    def response_logprobs(self, samples: Sequence[TrainSample]) -> list[list[float]]:
        """log p of each response token of each sample under the reference weights."""
        budget = self.spec.trainer.micro_batch_tokens
        return per_response_token(samples, budget, self.device, self._logprobs, self.packed, self.shared)

    def _logprobs(self, batch: MicroBatch) -> torch.Tensor:
        with autocast(self.spec.trainer.autocast, self.device):
            logits = self.model(**batch.model_inputs()).logits
        return token_logprobs(logits, batch.input_ids)

    def close(self) -> None:
        self.model = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
