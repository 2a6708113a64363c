"""The trainer's mixed precision (``trainer.autocast``): which dtype the forward passes compute
their matmuls in, while the weights, the optimiser and the LM head stay in float32.

Keeping the head in float32 keeps the logits, and so the logprobs that PPO's ratio and the
importance weights compare, at float32's precision: bfloat16 logits of magnitude ~10 are off by
~0.04, as much as a typical policy update moves a logprob. On CPUs with AMX (and every recent
GPU) the body's bfloat16 matmuls run several times faster than float32's.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

log = logging.getLogger(__name__)

AUTOCAST_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_bfloat16_matmuls() -> bool:
    """Whether oneDNN runs this CPU's bfloat16 matmuls natively (AVX-512 or AMX on x86). Without,
    torch falls back to a one-thread reference loop: on an AVX2-only AMD EPYC a bfloat16 linear
    of SmolLM2's MLP ([2048, 576] x [576, 1536]) took 500 ms against float32's 60-120 ms."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def check_autocast(setting: str, device: torch.device) -> None:
    """Refuse what cannot run (float16 autocast needs a GPU) and warn of what runs slowly
    (bfloat16 on a CPU without bfloat16 matmuls)."""
    if setting == "float16" and device.type != "cuda":
        raise ValueError("trainer.autocast float16 needs a GPU; use bfloat16 or off on a CPU")
    if setting == "bfloat16" and device.type == "cpu" and not cpu_has_bfloat16_matmuls():
        log.warning(
            "trainer.autocast bfloat16 on a CPU without bfloat16 matmuls (no AVX-512 or AMX): "
            "torch runs them on a slow one-thread fallback, several times slower than float32; "
            "set trainer.autocast: off on this host"
        )


@contextlib.contextmanager
def autocast(setting: str, device: torch.device) -> Iterator[None]:
    """The forward's autocast region for ``trainer.autocast`` (a no-op when it is off)."""
    dtype = AUTOCAST_DTYPES.get(setting)
    with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
        yield


def keep_head_in_float32(model: Any) -> None:
    """Run ``model``'s output embeddings (the LM head) outside autocast, on float32 hidden states.

    The module's parameters and state-dict keys do not change (its ``forward`` is wrapped on
    the instance), so saving, loading and tied embeddings work as before.
    """
    head = model.get_output_embeddings()
    if head is None:
        return
    inner = head.forward

    def forward(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        with torch.autocast(hidden.device.type, enabled=False):
            return inner(hidden.float(), *args, **kwargs)

    head.forward = forward
