"""LoRA adapters of the policy (``model.lora``), with peft: wrap the base model so that only the
adapter trains, start it from a saved adapter, and write what each version publishes.

An adapter directory is what peft's ``save_pretrained`` writes (adapter_model.safetensors,
adapter_config.json), so ``PeftModel.from_pretrained`` loads every version the trainer
publishes, and ``model.lora.init_from`` takes what peft (or ``verst export --adapter``) saved.
The base model the engines apply it to is written once per job from the same frozen weights
(``base_state``), under the names of the unwrapped model.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from services.common.checkpoint_layout import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE
from services.common.config import LoraConfig

INIT_FIELD = "model.lora.init_from"
_BASE_LAYER = ".base_layer."
_UNSUPPORTED = {"use_dora": False, "use_rslora": False, "lora_bias": False, "bias": "none"}
"""Options of a saved adapter this trainer does not train with, and the value it needs."""


def peft_config(section: LoraConfig) -> Any:
    """The peft LoraConfig of the JobSpec's ``model.lora``."""
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=section.rank,
        lora_alpha=section.alpha,
        lora_dropout=section.dropout,
        target_modules=section.target_modules,
        bias="none",
        task_type="CAUSAL_LM",
    )


def wrap(model: torch.nn.Module, section: LoraConfig, start_from: Path | None) -> Any:
    """``model`` with LoRA layers on ``section.target_modules``: its own weights frozen, the
    adapter's trainable, and loaded from ``start_from`` (a saved adapter) when given."""
    from peft import get_peft_model

    try:
        wrapped = get_peft_model(model, peft_config(section))
    except ValueError as err:  # no module matched the targets, or one peft cannot adapt
        raise ValueError(f"model.lora.target_modules: {err}") from err
    if start_from is not None:
        load_adapter(wrapped, section, start_from)
    return wrapped


def load_adapter(model: Any, section: LoraConfig, directory: Path) -> None:
    """Copy the adapter saved in ``directory`` into ``model``'s LoRA layers; it must have the
    JobSpec's rank, alpha and targets (ValueError naming model.lora.init_from otherwise)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    config_file, weights_file = directory / ADAPTER_CONFIG_FILE, directory / ADAPTER_WEIGHTS_FILE
    try:
        saved = json.loads(config_file.read_text())
        state = load_file(str(weights_file))
    except (OSError, ValueError) as err:
        raise ValueError(f"{INIT_FIELD}: {directory} holds no readable LoRA adapter: {err}") from err
    check_saved_config(saved, section, directory)
    ours = {key for key in model.state_dict() if ".lora_" in key}
    try:
        result = set_peft_model_state_dict(model, state)
    except RuntimeError as err:  # a shape mismatch: another base model or rank
        raise ValueError(f"{INIT_FIELD}: the adapter in {directory} does not fit the model: {err}") from err
    missing = sorted(key for key in result.missing_keys if key in ours)
    unexpected = sorted(result.unexpected_keys)
    if missing or unexpected:
        raise ValueError(
            f"{INIT_FIELD}: the adapter in {directory} adapts other modules than model.lora.target_modules"
            f" (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )


def check_saved_config(saved: dict[str, Any], section: LoraConfig, directory: Path) -> None:
    """A saved adapter's config against the JobSpec's (rank, alpha, and no option it lacks)."""
    if saved.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{INIT_FIELD}: {directory} holds a {saved.get('peft_type')} adapter, not LoRA")
    if saved.get("r") != section.rank or float(saved.get("lora_alpha", -1)) != section.alpha:
        raise ValueError(
            f"{INIT_FIELD}: the adapter in {directory} has rank {saved.get('r')} and alpha "
            f"{saved.get('lora_alpha')}; model.lora says rank {section.rank}, alpha {section.alpha}"
        )
    for option, needed in _UNSUPPORTED.items():
        if saved.get(option, needed) != needed:
            raise ValueError(
                f"{INIT_FIELD}: the adapter in {directory} sets {option}; verst trains plain LoRA"
            )
    for option in ("modules_to_save", "rank_pattern", "alpha_pattern"):
        if saved.get(option):
            raise ValueError(
                f"{INIT_FIELD}: the adapter in {directory} sets {option}; verst trains plain LoRA"
            )


def adapter_state(model: Any, *, snapshot: bool = False) -> dict[str, torch.Tensor]:
    """The tensors adapter_model.safetensors holds, named as peft saves them; with ``snapshot``,
    CPU copies that later steps do not change."""
    from peft import get_peft_model_state_dict

    state = {name: tensor.detach() for name, tensor in get_peft_model_state_dict(model).items()}
    if snapshot:
        return {name: tensor.to("cpu", copy=True).contiguous() for name, tensor in state.items()}
    return {name: tensor.contiguous() for name, tensor in state.items()}


def write_adapter_file(state: dict[str, torch.Tensor], directory: Path) -> None:
    """``directory``/adapter_model.safetensors of ``state`` (``adapter_state``)."""
    from safetensors.torch import save_file

    save_file(state, str(directory / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})


def write_adapter_config(model: Any, directory: Path) -> None:
    """``directory``/adapter_config.json (the same for every version of the job)."""
    model.peft_config["default"].save_pretrained(str(directory))


@contextlib.contextmanager
def trainable_state_only(model: torch.nn.Module) -> Iterator[None]:
    """Within: ``model.state_dict()`` holds the trainable tensors alone, for DeepSpeed's checkpoint
    of the training state. Its ``exclude_frozen_parameters`` drops the frozen parameters that
    ``named_parameters()`` lists, which names a tied weight once: a tied LM head, a frozen tensor
    as big as the embeddings, would go into every checkpoint."""
    trainable = {name for name, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}

    def keep_trainable(module: torch.nn.Module, state: dict[str, Any], prefix: str, metadata: Any) -> None:
        for key in [key for key in state if key.removeprefix(prefix) not in trainable]:
            del state[key]

    handle = model.register_state_dict_post_hook(keep_trainable)
    try:
        yield
    finally:
        handle.remove()


def base_model(model: Any) -> torch.nn.Module:
    """The transformers model inside the peft wrapper (its linear layers carry the LoRA layers)."""
    return model.get_base_model()


def base_name(name: str) -> str | None:
    """The unwrapped model's name of a wrapped model's tensor; None for the adapter's own."""
    if ".lora_" in name:
        return None
    return name.replace(_BASE_LAYER, ".")
