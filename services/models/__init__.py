"""A job's model and tokenizer paths, resolved to local Hugging Face directories: the one place
every service asks (trainer, api checks, the tokenizers of controller and runner).

    from services.models import resolve_model_path
    resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")  # the cached snapshot, offline

``paths.py`` finds what a path names (builtin model, local directory, GGUF file, hub id in the
local Hugging Face cache) without building anything; ``gguf.py`` converts a GGUF file once into
verst's model cache. Importing this package imports neither torch nor transformers.
"""

from __future__ import annotations

from pathlib import Path

from services.models.gguf import converted_dir, ensure_converted
from services.models.paths import (
    BUILTIN_PREFIX,
    GGUF_SUFFIX,
    Kind,
    ModelSource,
    hub_cache_dir,
    is_gguf_file,
    locate,
    readable_problem,
)
from services.tasks.models import ModelPathError


def resolve_model_path(path: str, gguf_file: str | None = None) -> Path:
    """The local Hugging Face directory of ``path`` (``model.path`` or ``model.tokenizer``): a
    builtin model built, a GGUF file converted, when the cache lacks them (blocking; minutes at
    most, once). Raises ``ModelPathError`` saying what is missing."""
    source = locate(path, gguf_file)
    if source.kind is Kind.BUILTIN:
        from services.tasks import ensure_builtin_model

        return ensure_builtin_model(path.removeprefix(BUILTIN_PREFIX))
    if source.kind is Kind.GGUF:
        assert source.gguf is not None
        return ensure_converted(source.gguf)
    assert source.directory is not None
    return source.directory


def prepared_model_path(path: str, gguf_file: str | None = None) -> Path | None:
    """The directory ``resolve_model_path`` would return when it needs no build or conversion
    now, else None. Raises ``ModelPathError`` like it."""
    source = locate(path, gguf_file)
    if source.kind is Kind.BUILTIN:
        from services.tasks import built_model_dir

        return built_model_dir(path.removeprefix(BUILTIN_PREFIX))
    if source.kind is Kind.GGUF:
        assert source.gguf is not None
        return converted_dir(source.gguf)
    return source.directory


__all__ = [
    "BUILTIN_PREFIX",
    "GGUF_SUFFIX",
    "Kind",
    "ModelPathError",
    "ModelSource",
    "converted_dir",
    "ensure_converted",
    "hub_cache_dir",
    "is_gguf_file",
    "locate",
    "prepared_model_path",
    "readable_problem",
    "resolve_model_path",
]
