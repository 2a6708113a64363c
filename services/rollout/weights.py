"""Checkpoint handling for the engine: locate, verify (sha256) and read HF weight directories."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import torch
from safetensors.torch import load as load_safetensors_bytes

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be served: bad uri, missing files, or a sha256 mismatch."""


def checkpoint_dir(uri: str) -> Path:
    """The local directory named by a ``file:///abs/dir`` uri (or a plain absolute path), with
    its weights and config."""
    path = uri_path(uri)
    for name in (WEIGHTS_FILE, CONFIG_FILE):
        if not (path / name).is_file():
            raise CheckpointError(f"checkpoint {path} has no {name}")
    return path


def uri_path(uri: str) -> Path:
    """The absolute local path of a ``file:///abs/dir`` uri (or a plain absolute path)."""
    parsed = urlparse(uri)
    if parsed.scheme not in ("file", ""):
        raise CheckpointError(f"unsupported checkpoint uri scheme {parsed.scheme!r} in {uri!r}: use file://")
    if parsed.netloc not in ("", "localhost"):
        raise CheckpointError(f"checkpoint uri {uri!r} names a remote host; use file:///abs/path")
    path = Path(unquote(parsed.path))
    if not path.is_absolute():
        raise CheckpointError(f"checkpoint uri {uri!r} is not an absolute path")
    return path


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: Path, chunk_bytes: int = 1 << 20) -> str:
    """The hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def _check_sha(path: Path, actual: str, expected: str) -> None:
    if not expected:
        raise CheckpointError(f"checkpoint handle for {path} has no sha256; refusing unverified weights")
    if actual != expected.lower():
        raise CheckpointError(
            f"sha256 mismatch for {path / WEIGHTS_FILE}: handle says {expected}, file has {actual}"
        )


def verify_weights(path: Path, expected_sha256: str) -> None:
    """Raise CheckpointError unless the directory's weights hash to ``expected_sha256``."""
    _check_sha(path, file_sha256(path / WEIGHTS_FILE), expected_sha256)


def read_verified_state_dict(path: Path, expected_sha256: str) -> dict[str, torch.Tensor]:
    """The weights of a checkpoint directory (on the CPU), verified against its sha256.

    The file is read once and the same bytes are hashed and decoded, so a file replaced
    between the check and the load cannot slip through.
    """
    data = (path / WEIGHTS_FILE).read_bytes()
    _check_sha(path, sha256_bytes(data), expected_sha256)
    return load_safetensors_bytes(data)


def read_config(path: Path) -> dict[str, Any]:
    """The checkpoint's config.json without the fields that differ between saves of one
    model; two checkpoints with equal configs share an architecture."""
    try:
        config = dict(json.loads((path / CONFIG_FILE).read_text()))
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"unreadable {path / CONFIG_FILE}: {err}") from err
    return {k: v for k, v in config.items() if k not in ("transformers_version", "_name_or_path")}


def copy_into_model(
    model: torch.nn.Module, state_dict: dict[str, torch.Tensor], partial: bool = False
) -> None:
    """Copy a full state dict (with ``partial``, some of its tensors) into a model of the same
    architecture, in place.

    Everything is checked before the first tensor is copied, so a bad file never leaves the
    model half updated. Keys missing from a full state dict are accepted only when they alias a
    loaded tensor (tied embeddings: ``lm_head.weight`` is ``model.embed_tokens.weight``).
    """
    current = model.state_dict()
    unexpected = sorted(set(state_dict) - set(current))
    if unexpected:
        raise CheckpointError(f"checkpoint has tensors the model lacks: {unexpected[:5]}")
    misshapen = [k for k, v in state_dict.items() if tuple(v.shape) != tuple(current[k].shape)]
    if misshapen:
        raise CheckpointError(f"checkpoint tensors have other shapes than the model's: {misshapen[:5]}")
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded_ids = {id(param) for name, param in params.items() if name in state_dict}
    untied = [key for key in current if key not in state_dict and id(params.get(key)) not in loaded_ids]
    if untied and not partial:
        raise CheckpointError(f"checkpoint lacks tensors the model needs: {untied[:5]}")
    model.load_state_dict(state_dict, strict=False)
