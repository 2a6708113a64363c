"""The torch side of the engine: load an HF causal LM and decode one batch with a KV cache."""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch

from services.rollout.torch.decoder import unsupported_reason
from services.rollout.torch.requests import LoadedModel, Row, WeightUpdate, record_tokens
from services.rollout.torch.sampler import BatchSampler
from services.rollout.weights import (
    WEIGHTS_FILE,
    CheckpointError,
    read_config,
    read_verified_state_dict,
    verify_weights,
)

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
"""safetensors' names of the floating-point dtypes."""
_FROM_PRETRAINED_LOCK = threading.Lock()
"""from_pretrained switches process-wide state (meta-device init): one load at a time."""


def resolve_device(name: str) -> torch.device:
    """``auto``: the first CUDA device when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device


def _token_ids(value: object) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}  # type: ignore[union-attr]


@contextlib.contextmanager
def serial_torch() -> Iterator[None]:
    """Run this thread's torch ops on one core: for torch work off the engine's worker thread.

    Under OpenMP (torch's CPU backend), every thread that runs a parallel op gets a team of
    threads of its own. Once the teams' threads outnumber the cores, libgomp stops spinning
    between parallel regions and puts idle threads to sleep, for good, so every kernel of the
    worker's decode step waits for a wake-up: a demo decode run took 2.3x as long after one
    512x512 torch.mm on another thread. Loading weights on one thread leaves the worker's team
    the only one. (The thread count is per thread under OpenMP; the worker sets its own.)
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def checkpoint_dtype(path: Path) -> torch.dtype:
    """The dtype of a checkpoint's floating-point weights, read from its safetensors header (the
    trainer writes them in the job's model.dtype); float32 when it holds none."""
    from safetensors import safe_open

    with safe_open(str(path / WEIGHTS_FILE), framework="pt") as weights:
        for name in weights.keys():  # noqa: SIM118 (a safetensors handle is no dict)
            dtype = SAFETENSORS_DTYPES.get(weights.get_slice(name).get_dtype())
            if dtype is not None:
                return dtype
    return torch.float32


def decode_path(model: torch.nn.Module) -> tuple[str, str]:
    """("fast", "") when the slot decoder runs ``model``, else ("general", why not): transformers'
    forward in static batches, which runs any causal LM (EngineInfo.decode_path)."""
    reason = unsupported_reason(model)
    return ("fast", "") if reason is None else ("general", reason)


def load_model(path: Path, *, device: torch.device, dtype: torch.dtype | None) -> LoadedModel:
    """Load an HF causal LM directory (and its tokenizer, if it has one) for inference, in
    ``dtype`` (None: the dtype its weights were saved in)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if dtype is None:
        dtype = checkpoint_dtype(path)
    with _FROM_PRETRAINED_LOCK:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError, KeyError):
            tokenizer = None  # stop strings need one; token-in/token-out does not
    config = model.config
    reason = unsupported_reason(model)
    if reason is not None:
        log.warning(
            "loaded %s (%s, %s): the general decode path, transformers' forward in static batches, "
            "because the fast path does not support it: %s",
            path, config.model_type, dtype, reason,
        )  # fmt: skip
    else:
        log.info("loaded %s (%s, %s): the fast decode path (slot decoder)", path, config.model_type, dtype)
    eos = _token_ids(config.eos_token_id)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        eos |= _token_ids(generation_config.eos_token_id)
    parameters = inspect.signature(model.forward).parameters
    pad = config.pad_token_id if getattr(config, "pad_token_id", None) is not None else 0
    return LoadedModel(
        model=model,
        vocab_size=int(model.get_input_embeddings().num_embeddings),
        max_positions=int(getattr(config, "max_position_embeddings", 0) or 0),
        eos_token_ids=frozenset(eos),
        pad_token_id=int(pad),
        tokenizer=tokenizer,
        cache_argument="cache" if "cache" in parameters else "past_key_values",
        keeps_last_logits="logits_to_keep" in parameters,
    )


def read_update(
    update: WeightUpdate,
    sha256: str,
    *,
    current: LoadedModel | None,
    device: torch.device,
    dtype: torch.dtype | None,
) -> None:
    """Read and verify ``update``'s checkpoint for the worker to install: the state dict to copy
    into ``current`` when the architecture is the same, else a new model. Raises CheckpointError."""
    path = update.path
    config = read_config(path)
    # A model serving a LoRA base has adapter weights merged into it: never a copy's target.
    if current is not None and current.config == config and not current.base_sha256:
        update.state_dict = read_verified_state_dict(path, sha256)
        return
    verify_weights(path, sha256)
    try:
        update.model = load_model(path, device=device, dtype=dtype)
    except (OSError, ValueError, RuntimeError, NotImplementedError) as err:
        raise CheckpointError(f"cannot load a model from {path}: {err}") from err
    update.model.config = config


class DecodeHooks(Protocol):
    """What the decode loop asks of its engine between steps."""

    def current_version(self) -> int: ...

    def finish(self, row: Row, reason: int, error: str = "") -> None: ...

    def after_step(self, live: list[Row]) -> None: ...

    def sampled(self, count: int) -> None: ...


def _left_pad(rows: list[Row], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B, L] and attention mask [B, L] with prompts right-aligned."""
    width = max(len(row.request.prompt) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        prompt = row.request.prompt
        ids[i, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[i, width - len(prompt) :] = 1
    return ids.to(device), mask.to(device)


def _forward(loaded: LoadedModel, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any):
    kwargs: dict[str, Any] = {loaded.cache_argument: cache, "use_cache": True}
    if loaded.keeps_last_logits:
        kwargs["logits_to_keep"] = 1
    out = loaded.model(input_ids=ids, attention_mask=mask, position_ids=positions, **kwargs)
    return out.logits[:, -1, :].float()


@torch.inference_mode()
def decode_batch(loaded: LoadedModel, rows: list[Row], *, device: torch.device, hooks: DecodeHooks) -> None:
    """Generate every row to completion (or abort), reporting each finished row to ``hooks``.

    Finished rows stop contributing tokens; once at most half of the rows in the batch are
    still running, the finished ones are dropped from the cache so they stop costing compute.
    """
    from transformers import DynamicCache

    ids, mask = _left_pad(rows, loaded.pad_token_id, device)
    positions = (mask.cumsum(dim=-1) - 1).clamp(min=0)
    sampler = BatchSampler([row.request.config for row in rows], [row.seed for row in rows], device)
    cache = DynamicCache(config=loaded.model.config)
    logits = _forward(loaded, ids, mask, positions, cache)
    live = list(rows)
    while True:
        active = [row.finish is None for row in live]
        tokens, logprobs = sampler.sample(logits, active)
        version = hooks.current_version()
        hooks.sampled(
            record_tokens(live, tokens, logprobs, version=version, tokenizer=loaded.tokenizer, hooks=hooks)
        )
        hooks.after_step(live)
        keep = [i for i, row in enumerate(live) if row.finish is None]
        if not keep:
            return
        if len(keep) <= len(live) // 2:
            index = torch.tensor(keep, device=device)
            cache.batch_select_indices(index)
            mask, positions, tokens = mask[index], positions[index], tokens[index]
            sampler.select(index)
            live = [live[i] for i in keep]
        mask = torch.cat([mask, mask.new_ones((len(live), 1))], dim=1)
        positions = positions[:, -1:] + 1
        logits = _forward(loaded, tokens.unsqueeze(1), mask, positions, cache)
