"""The value model of PPO with GAE (``algorithm.advantage: gae``).

The policy's architecture without its LM head (``AutoModel`` from the same base
model) plus a scalar head: the value of the state before each token is the head
applied to the hidden state of the token before it, so values are target-aligned
like the policy's logprobs. It has its own torch AdamW (``algorithm.gae.critic_learning_rate``,
``trainer.weight_decay``, clipped at ``trainer.max_grad_norm``) and is **not** wrapped
in DeepSpeed: it keeps full fp32 weights and optimiser state on the trainer's device
(with autocast to ``model.dtype`` on CUDA). It trains alongside the policy: one
optimiser step per policy optimiser step, on the same mini-batch, with the clipped
value loss (``losses.value_loss``, ``algorithm.gae.value_clip``). Its weights are saved in
``critic/`` inside each checkpoint, so a resumed job resumes its critic too (weights only:
its AdamW moments start afresh).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from services.common.config import JobSpec
from services.trainer.batching import (
    MicroBatch,
    TrainSample,
    collate_pack,
    per_response_token,
    plan_step,
)
from services.trainer.layout_checks import packing_works, sharing_works
from services.trainer.losses import ValueLossInputs, sample_token_weights, value_loss
from services.trainer.precision import AUTOCAST_DTYPES, autocast

CRITIC_DIR = "critic"
"""The critic's directory inside a checkpoint."""
HEAD_FILE = "value_head.safetensors"


@dataclass(frozen=True, slots=True)
class CriticStats:
    """One critic optimiser step."""

    loss: float
    clip_fraction: float
    """Share of tokens whose clipped value error was the larger."""
    grad_norm: float
    """Before clipping."""
    tokens: int


class Critic:
    """Backbone + scalar head, with its own optimiser."""

    def __init__(
        self,
        backbone: Any,
        head: torch.nn.Linear,
        spec: JobSpec,
        device: torch.device,
        packed: bool = True,
        shared: bool = False,
    ) -> None:
        self.backbone = backbone
        self.head = head
        self.spec = spec
        self.device = device
        self.packed = packed
        self.shared = shared
        self.parameters = [*backbone.parameters(), *head.parameters()]
        self.optimizer = torch.optim.AdamW(
            self.parameters,
            lr=spec.algorithm.gae.critic_learning_rate,
            weight_decay=spec.trainer.weight_decay,
            fused=True,  # one kernel over every tensor, as the policy's (policy.py)
        )

    @classmethod
    def load(cls, spec: JobSpec, model_dir: Path, device: torch.device) -> Critic:
        """From a base model directory, or from a checkpoint's ``critic/`` (which has the head)."""
        from transformers import AutoModel

        backbone = AutoModel.from_pretrained(model_dir, trust_remote_code=spec.model.trust_remote_code)
        backbone = backbone.float().to(device)
        hidden = int(backbone.config.hidden_size)
        generator = torch.Generator().manual_seed(spec.seed)
        head = torch.nn.Linear(hidden, 1)
        with torch.no_grad():
            # Small initial values: the first advantages are then close to the returns.
            head.weight.normal_(0.0, 1.0 / (hidden + 1), generator=generator)
            head.bias.zero_()
        if (model_dir / HEAD_FILE).is_file():
            head.load_state_dict(load_file(str(model_dir / HEAD_FILE)))
        packed = spec.trainer.packing and packing_works(backbone, "critic")
        shared = packed and spec.trainer.share_prompts and sharing_works(backbone, "critic")
        return cls(backbone, head.to(device), spec, device, packed, shared)

    def save(self, directory: Path) -> None:
        """An HF directory of the backbone plus the head's safetensors."""
        directory.mkdir(parents=True, exist_ok=True)
        self.backbone.save_pretrained(directory)
        save_file({k: v.detach().cpu().contiguous() for k, v in self.head.state_dict().items()},
                  str(directory / HEAD_FILE))  # fmt: skip

    @contextlib.contextmanager
    def _autocast(self) -> Iterator[None]:
        # trainer.autocast where it is set; else, on a GPU, the compute of a bf16/fp16 model.dtype
        setting = self.spec.trainer.autocast
        if setting == "off" and self.device.type == "cuda" and self.spec.model.dtype in AUTOCAST_DTYPES:
            setting = self.spec.model.dtype
        with autocast(setting, self.device):
            yield

    def _values(self, batch: MicroBatch) -> torch.Tensor:
        """``[rows, width - 1]``: column t is the value of the state before token t + 1."""
        with self._autocast():
            hidden = self.backbone(**batch.model_inputs()).last_hidden_state
            values = self.head(hidden).squeeze(-1)
        return values[:, :-1].float()

    @torch.no_grad()
    def values(self, samples: Sequence[TrainSample]) -> list[list[float]]:
        """The value before each response token of each sample, under the current weights."""
        self.backbone.eval()
        budget = self.spec.trainer.micro_batch_tokens
        return per_response_token(samples, budget, self.device, self._values, self.packed, self.shared)

    def optimiser_step(self, samples: Sequence[TrainSample]) -> CriticStats:
        """One step on the clipped value loss, gradients accumulated over packed micro-batches.

        The samples need ``returns`` and ``old_values`` (services/trainer/prepare.py sets them)."""
        if any(s.returns is None or s.old_values is None for s in samples):
            raise ValueError("the critic trains on samples with returns and old values")
        algorithm = self.spec.algorithm
        weights = sample_token_weights(
            [s.loss_tokens for s in samples], algorithm.loss_aggregation, self.spec.rollout.max_new_tokens
        )
        self.backbone.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss = clipped = 0.0
        tokens = 0
        budget = self.spec.trainer.micro_batch_tokens
        packs, shared = plan_step(samples, budget, self.packed, self.shared)
        for pack in packs:
            batch = collate_pack(samples, weights, pack, self.device, shared)
            result = value_loss(
                ValueLossInputs(
                    self._values(batch), batch.old_values, batch.returns, batch.mask, batch.weights
                ),
                algorithm.gae.value_clip,
            )
            result.loss.backward()
            loss += float(result.loss.detach())
            clipped += result.clip_fraction * result.tokens
            tokens += result.tokens
        self._average_gradients()
        max_norm = self.spec.trainer.max_grad_norm
        norm = torch.nn.utils.clip_grad_norm_(self.parameters, max_norm if max_norm else float("inf"))
        self.optimizer.step()
        return CriticStats(loss, clipped / max(tokens, 1), float(norm), tokens)

    def _average_gradients(self) -> None:
        """With several trainer processes, average the gradients like DeepSpeed does the policy's."""
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
            return
        world = dist.get_world_size()
        for parameter in self.parameters:
            if parameter.grad is not None:
                dist.all_reduce(parameter.grad)  # SUM: gloo has no AVG
                parameter.grad.div_(world)

    def close(self) -> None:
        self.backbone = self.head = self.optimizer = None  # type: ignore[assignment]
        self.parameters = []
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
