"""A GGUF model converted once into a Hugging Face directory, shared by every service.

transformers reads a GGUF file (with the ``gguf`` package) and dequantizes it to float32; the
model and its tokenizer (chat template included, from the file's metadata) are saved as a plain
safetensors directory in verst's model cache (``$VERST_CACHE/models``, services/tasks/models.py)
under ``gguf-<hash>``, the hash of the file's sha256 and ``FORMAT_VERSION``. The cache's lock
makes processes that convert one file at once do one conversion, and its stamp (verst.json,
with the file's name and sha256) marks a finished one; a changed file is a new directory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path
from typing import Any

from services.tasks.models import (
    LOCK_TIMEOUT_S,
    STAMP_FILE,
    BaseModel,
    cached_model_paths,
    ensure_model,
    is_built,
)

FORMAT_VERSION = 1
"""Part of every conversion's hash: raise it when the conversion changes what it writes."""
NAME = "gguf"
"""The cache directories' prefix: ``models/gguf-<hash>``."""
_CHUNK = 1 << 20


def file_sha256(path: Path) -> str:
    """The sha256 of a file, read a MiB at a time."""
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@dataclasses.dataclass(frozen=True)
class GgufRecipe:
    """One GGUF file's conversion: its content names the cache directory."""

    file: Path
    sha256: str

    def digest(self, name: str) -> str:
        payload = {"format": FORMAT_VERSION, "name": name, "sha256": self.sha256}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def _build(name: str, recipe: Any, out_dir: Path, *, progress: bool) -> dict[str, Any]:
    started = time.monotonic()
    convert_gguf(recipe.file, out_dir)
    stamp = {
        "recipe_hash": recipe.digest(name),
        "source": str(recipe.file),
        "sha256": recipe.sha256,
        "format": FORMAT_VERSION,
        "build_seconds": time.monotonic() - started,
    }
    (out_dir / STAMP_FILE).write_text(json.dumps(stamp, indent=2) + "\n")
    return stamp


def gguf_model(file: Path) -> BaseModel:
    """The cache entry of ``file``'s conversion (hashes the file: ~0.1 s per 100 MB)."""
    return BaseModel(GgufRecipe(file, file_sha256(file)), _build)


def converted_dir(file: Path, cache_dir: Path | None = None) -> Path | None:
    """The converted directory of ``file`` when the cache holds it, else None; never converts."""
    model = gguf_model(file)
    directory, _ = cached_model_paths(NAME, model.recipe, cache_dir)
    return directory if is_built(directory, model.recipe.digest(NAME)) else None


def ensure_converted(
    file: Path, cache_dir: Path | None = None, *, lock_timeout_s: float = LOCK_TIMEOUT_S
) -> Path:
    """The Hugging Face directory of GGUF ``file``, converting it first when the cache lacks it
    (safe from several processes at once: one converts, the others wait and reuse it)."""
    return ensure_model(NAME, gguf_model(file), cache_dir, progress=False, lock_timeout_s=lock_timeout_s)


def convert_gguf(file: Path, out_dir: Path) -> None:
    """Dequantize GGUF ``file`` to float32 and save the model and its tokenizer in ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    quantized = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32)
    # A model loaded from GGUF refuses save_pretrained (it carries a GGUF quantizer): rebuild it
    # from the same config without the quantization entry and copy the weights across.
    config_dict = quantized.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = type(quantized.config).from_dict(config_dict)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.generation_config = quantized.generation_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
