"""Export a saved version of a job as a Hugging Face directory: ``verst export`` (services/cli/export.py)
and ``POST /v1/jobs/{id}/export`` (services/api/server.py) both call ``export_version``.

- a full fine-tune: its model files (model.safetensors, config, generation config, tokenizer and
  chat template), which ``AutoModelForCausalLM.from_pretrained`` loads;
- a LoRA job, merged (the default): the base model with the adapter merged in by peft
  (``merge_and_unload``), saved with the base's tokenizer files: ``AutoModelForCausalLM`` loads it;
- a LoRA job, unmerged (``merge=False``): the adapter (adapter_model.safetensors,
  adapter_config.json naming the job's base directory as ``base_model_name_or_path``) and the
  tokenizer files: ``PeftModel.from_pretrained(base, directory)`` (or peft's
  ``AutoPeftModelForCausalLM``) loads it.

The versions are the job's durable checkpoints and its weights-only versions still on disk
(services/common/checkpoint_layout.py); the weights' sha256 is checked against the version's
handle first. The directory is written under a temporary name beside ``out_dir`` and renamed, so
it appears complete or not at all.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from services.common.checkpoint_layout import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    OWN_FILES,
    WEIGHTS_FILE,
    SavedVersion,
    SavedVersions,
    base_directory,
)

MODEL_FILES = frozenset({WEIGHTS_FILE, "config.json", "generation_config.json"})
"""A model directory's own files; the others at its top level are the tokenizer's."""
DTYPES = ("float32", "bfloat16", "float16")

Kind = Literal["full", "merged", "adapter"]


class ExportError(ValueError):
    """An export that cannot be made as asked (the message says why)."""


@dataclass(frozen=True, slots=True)
class Exported:
    """What an export wrote."""

    job_id: str
    version: int
    epoch: int
    kind: Kind
    """``full`` (a full fine-tune's model), ``merged`` (base + adapter), ``adapter`` (unmerged)."""
    directory: Path
    base: Path | None
    """The base model an unmerged adapter applies to (None otherwise)."""


def export_version(
    checkpoint_root: Path,
    job_id: str,
    out_dir: Path,
    *,
    version: int | None = None,
    merge: bool = True,
    trust_remote_code: bool = False,
) -> Exported:
    """Write ``version`` (None: the newest saved) of ``job_id`` (its checkpoints under
    ``checkpoint_root``) to ``out_dir``, which must not exist or be empty. Raises LookupError
    (no such version), ExportError (out_dir in use, an adapter asked of a full fine-tune, weights
    that do not match their handle) or OSError."""
    saved = SavedVersions(checkpoint_root, job_id).find(version)
    out_dir = out_dir.absolute()
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ExportError(f"{out_dir} exists and is not an empty directory")
    if not saved.is_adapter and not merge:
        raise ExportError(f"job {job_id} is a full fine-tune: {saved.describe()} has no adapter to export")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.parent / f".{out_dir.name}.export-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        kind, base = _write(saved, staging, merge, trust_remote_code)
        if out_dir.exists():
            out_dir.rmdir()  # empty: checked above
        os.rename(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    handle = saved.handle
    return Exported(job_id, int(handle.version), int(handle.epoch), kind, out_dir, base)


def _write(
    saved: SavedVersion, staging: Path, merge: bool, trust_remote_code: bool
) -> tuple[Kind, Path | None]:
    handle = saved.handle
    if not saved.is_adapter:
        _check_sha(saved.directory / WEIGHTS_FILE, handle.sha256)
        _copy_files(saved.directory, staging, skip=OWN_FILES)
        return "full", None
    base = base_directory(handle)
    _check_sha(saved.directory / ADAPTER_WEIGHTS_FILE, handle.sha256)
    _check_sha(base / WEIGHTS_FILE, handle.adapter.base_sha256)
    _copy_files(base, staging, skip=OWN_FILES | MODEL_FILES)  # the tokenizer and chat template
    if merge:
        _merge(saved.directory, base, staging, handle.dtype, trust_remote_code)
        return "merged", None
    for name in (ADAPTER_WEIGHTS_FILE, ADAPTER_CONFIG_FILE):
        shutil.copy2(saved.directory / name, staging / name)
    config = json.loads((staging / ADAPTER_CONFIG_FILE).read_text())
    config["base_model_name_or_path"] = str(base)  # what AutoPeftModelForCausalLM loads
    (staging / ADAPTER_CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True))
    return "adapter", base


def _merge(adapter: Path, base: Path, staging: Path, dtype: str, trust_remote_code: bool) -> None:
    """The base model with the adapter merged in by peft, saved as a plain HF model."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype if dtype in DTYPES else "float32")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            base, dtype=torch_dtype, trust_remote_code=trust_remote_code
        )
    except ValueError as err:  # a model whose code must run, where running it is not allowed
        raise ExportError(f"cannot load the base model {base} to merge into: {err}") from err
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    merged.save_pretrained(staging)


def _copy_files(source: Path, target: Path, skip: frozenset[str]) -> None:
    """The top-level files of ``source`` but ``skip`` (sub-directories, such as a durable
    checkpoint's training state, stay behind)."""
    for path in source.iterdir():
        if path.is_file() and path.name not in skip:
            shutil.copy2(path, target / path.name)


def _check_sha(path: Path, expected: str) -> None:
    with path.open("rb") as handle:
        actual = hashlib.file_digest(handle, "sha256").hexdigest()
    if actual != expected.lower():
        raise ExportError(f"{path} does not match its handle's sha256 ({expected}): refusing to export it")
