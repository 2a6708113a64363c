"""LoRA adapters on the torch engine: a handle with a ``LoraAdapter`` names an adapter directory
(what peft saves) and the base model it applies to.

The engine serves the base model with the adapter merged into its weights, so the fast decoder
runs a plain model. Each version is merged from the pristine base, never from the weights served:
``W = W_base + (alpha / r) · B·A`` for every adapted matrix, computed in float32 off the worker
(``read_adapter_update``) from a CPU copy of the base's adapted matrices (``LoadedModel.pristine``,
kept from the first adapter on), then copied into the live model between decode steps like a
checkpoint's state dict. Matrices an earlier adapter touched and this one does not go back to
the base's. A new base (another sha256) is a new model, loaded as one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors_bytes

from services.rollout.torch.model import load_model
from services.rollout.torch.requests import LoadedModel, WeightUpdate
from services.rollout.weights import (
    CheckpointError,
    copy_into_model,
    read_config,
    read_verified_state_dict,
    sha256_bytes,
    verify_weights,
)

ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"
_PREFIX = "base_model.model."
"""What peft puts before a module's name in an adapter file."""
_PLAIN = {"use_dora": False, "lora_bias": False, "bias": "none"}
"""Options an adapter must leave at these values: the merge here is plain LoRA's."""


def adapter_dir(path: Path) -> Path:
    """``path`` when it holds an adapter's weights and config (CheckpointError otherwise)."""
    for name in (ADAPTER_WEIGHTS_FILE, ADAPTER_CONFIG_FILE):
        if not (path / name).is_file():
            raise CheckpointError(f"adapter {path} has no {name}")
    return path


def read_adapter(path: Path, sha256: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The adapter's config and tensors, the tensors' bytes verified against ``sha256`` (read
    once: the bytes hashed are the bytes decoded)."""
    data = (adapter_dir(path) / ADAPTER_WEIGHTS_FILE).read_bytes()
    if not sha256:
        raise CheckpointError(f"adapter handle for {path} has no sha256; refusing unverified weights")
    if sha256_bytes(data) != sha256.lower():
        raise CheckpointError(f"sha256 mismatch for {path / ADAPTER_WEIGHTS_FILE}: the handle says {sha256}")
    try:
        config = json.loads((path / ADAPTER_CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"unreadable {path / ADAPTER_CONFIG_FILE}: {err}") from err
    return config, load_safetensors_bytes(data)


def lora_deltas(config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each adapted weight's update (alpha / r) · B·A in float32, by the base model's name of
    the weight (CheckpointError for an adapter this merge does not cover)."""
    if config.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"a {config.get('peft_type')} adapter is not LoRA")
    odd = [key for key, plain in _PLAIN.items() if config.get(key, plain) != plain]
    odd += [key for key in ("modules_to_save", "rank_pattern", "alpha_pattern") if config.get(key)]
    if odd:
        raise CheckpointError(f"the adapter sets {odd[0]}: the torch engine merges plain LoRA only")
    rank, alpha = int(config.get("r", 0)), float(config.get("lora_alpha", 0))
    if rank < 1:
        raise CheckpointError(f"the adapter's config has rank {config.get('r')!r}")
    scale = alpha / rank**0.5 if config.get("use_rslora") else alpha / rank
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, _, part = key.removeprefix(_PREFIX).rpartition(".lora_")
        if part not in ("A.weight", "B.weight") or not module:
            raise CheckpointError(f"the adapter has a tensor the torch engine cannot merge: {key}")
        pairs.setdefault(module, {})[part[0]] = tensor
    deltas = {}
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise CheckpointError(f"the adapter has lora_A or lora_B of {module} alone")
        delta = (pair["B"].float() @ pair["A"].float()) * scale
        deltas[f"{module}.weight"] = delta.T if config.get("fan_in_fan_out") else delta
    return deltas


def read_adapter_update(
    update: WeightUpdate,
    sha256: str,
    base: Path,
    base_sha256: str,
    *,
    current: LoadedModel | None,
    device: torch.device,
    dtype: torch.dtype | None,
) -> None:
    """Stage ``update`` (an adapter of ``base``): the merged weights to copy into ``current`` when
    it serves that base, else a new model of the base with them merged in. Raises CheckpointError."""
    config, tensors = read_adapter(update.path, sha256)
    deltas = lora_deltas(config, tensors)
    target = current if current is not None and current.base_sha256 == base_sha256.lower() else None
    if target is None:
        target = _load_base(base, base_sha256, device=device, dtype=dtype)
        update.model = target
    _keep_pristine(target, base, base_sha256, deltas)
    merged = {}
    for name, pristine in target.pristine.items():
        delta = deltas.get(name)
        weight = pristine.float() if delta is None else pristine.float() + delta
        merged[name] = weight.to(pristine.dtype if dtype is None else dtype)  # None: the base's
    if update.model is not None:  # not served yet: merged here
        copy_into_model(update.model.model, merged, partial=True)
    else:
        update.state_dict, update.partial = merged, True


def _load_base(base: Path, sha256: str, *, device: torch.device, dtype: torch.dtype | None) -> LoadedModel:
    verify_weights(base, sha256)
    try:
        loaded = load_model(base, device=device, dtype=dtype)
    except (OSError, ValueError, RuntimeError, NotImplementedError) as err:
        raise CheckpointError(f"cannot load the base model {base}: {err}") from err
    loaded.config = read_config(base)
    loaded.base_sha256 = sha256.lower()
    return loaded


def _keep_pristine(target: LoadedModel, base: Path, sha256: str, deltas: dict[str, torch.Tensor]) -> None:
    """Add to ``target.pristine`` the base's copy of each weight ``deltas`` adapts, read from the
    base's verified file (once per weight for the life of the model)."""
    missing = [name for name in deltas if name not in target.pristine]
    if not missing:
        return
    state = read_verified_state_dict(base, sha256)
    for name in missing:
        weight = state.get(name)
        if weight is None:
            raise CheckpointError(f"the adapter adapts {name}, which the base model {base} lacks")
        if tuple(weight.shape) != tuple(deltas[name].shape):
            shapes = f"{tuple(deltas[name].shape)}, the base's is {tuple(weight.shape)}"
            raise CheckpointError(f"the adapter's update of {name} has shape {shapes}")
        target.pristine[name] = weight.clone()
