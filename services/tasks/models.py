"""The cache of the models verst builds itself (``builtin:<name>``): built once, then reused.

A build lands in ``$VERST_CACHE`` (default ``~/.cache/verst``) under
``models/<name>-<recipe hash>``, a Hugging Face directory (model.safetensors,
config.json, tokenizer files) plus ``verst.json``, the recipe and the build's
results. The directory is built under a temporary name and renamed into place,
with a file lock so that concurrent processes build it once; a changed recipe
has a new hash, hence a new directory.

This module knows nothing of torch or of any task: a ``BaseModel`` pairs a recipe
with the function that builds it (``addition_model.py``, ``multiply_model.py``),
and ``catalog.py`` says which task has which. GGUF files converted to Hugging Face
directories are cached here too (``services/models/gguf.py``: ``models/gguf-<hash>``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Protocol

import filelock

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
"""Part of every recipe hash: raise it when the build code changes what it produces."""
STAMP_FILE = "verst.json"
"""The file in a built model directory that records its recipe and build results."""
LOCK_TIMEOUT_S = 900.0
"""How long a process waits for another one's build of the same model before giving up."""


class ModelPathError(ValueError):
    """A model path names nothing to load: no builtin model, no local directory or GGUF file, no
    hub id in the local Hugging Face cache (services/models/)."""


class Recipe(Protocol):
    """Everything that determines a builtin model's weights; its hash names the cache directory."""

    def digest(self, name: str) -> str: ...


class ModelBuilder(Protocol):
    """Builds model ``name`` from ``recipe`` into ``out_dir`` (created); returns its verst.json."""

    def __call__(self, name: str, recipe: Any, out_dir: Path, *, progress: bool) -> dict[str, Any]: ...


@dataclasses.dataclass(frozen=True)
class BaseModel:
    """A model verst builds for a task: its recipe and the function that builds it."""

    recipe: Recipe
    build: ModelBuilder
    summary: tuple[str, ...] = ()
    """The verst.json fields logged when a build ends (its measured quality)."""


def default_cache_dir() -> Path:
    """``$VERST_CACHE``, else ``~/.cache/verst``."""
    configured = os.environ.get("VERST_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "verst"


def read_stamp(model_dir: Path) -> dict[str, Any] | None:
    """The verst.json of a built model directory, or None when it is missing or unreadable."""
    try:
        stamp = json.loads((model_dir / STAMP_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return stamp if isinstance(stamp, dict) else None


def is_built(model_dir: Path, recipe_hash: str) -> bool:
    """Whether ``model_dir`` holds a finished build of the recipe with this hash."""
    stamp = read_stamp(model_dir)
    return stamp is not None and stamp.get("recipe_hash") == recipe_hash


def cached_model_paths(name: str, recipe: Recipe, cache_dir: Path | None = None) -> tuple[Path, Path]:
    """(model directory, lock file) of a builtin model in the cache."""
    models_dir = (cache_dir if cache_dir is not None else default_cache_dir()) / "models"
    model_dir = models_dir / f"{name}-{recipe.digest(name)}"
    return model_dir, models_dir / f".{model_dir.name}.lock"


def ensure_model(
    name: str,
    model: BaseModel,
    cache_dir: Path | None = None,
    *,
    progress: bool = True,
    lock_timeout_s: float = LOCK_TIMEOUT_S,
) -> Path:
    """The directory of ``model`` in the cache, building it first when the cache lacks it.

    Safe to call from several processes at once: one builds, the others wait on the
    lock (at most ``lock_timeout_s``, then TimeoutError) and reuse the result.
    """
    recipe_hash = model.recipe.digest(name)
    model_dir, lock_path = cached_model_paths(name, model.recipe, cache_dir)
    if is_built(model_dir, recipe_hash):
        return model_dir
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    lock = filelock.FileLock(str(lock_path))
    _acquire_build_lock(lock, model_dir, lock_timeout_s)
    try:
        if not is_built(model_dir, recipe_hash):  # else another process built it while we waited
            build_into_place(name, model, model_dir, progress=progress)
    finally:
        lock.release()
    return model_dir


def _acquire_build_lock(lock: filelock.FileLock, model_dir: Path, timeout_s: float) -> None:
    try:
        lock.acquire(blocking=False)
        return
    except filelock.Timeout:
        log.info("waiting up to %gs for another process building %s", timeout_s, model_dir)
    try:
        lock.acquire(timeout=timeout_s)
    except filelock.Timeout:
        raise TimeoutError(
            f"waited {timeout_s:g}s for another process building {model_dir}; "
            f"if none is running, delete {lock.lock_file}"
        ) from None


def build_into_place(name: str, model: BaseModel, final_dir: Path, *, progress: bool) -> None:
    """Build in a temporary sibling directory, then rename it to ``final_dir`` (atomic on POSIX).

    The caller holds the build lock (``ensure_model``).
    """
    # Holding the lock, so any leftover temporary or incomplete directory is a crashed build's.
    for stale in final_dir.parent.glob(f".{final_dir.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    if final_dir.exists():
        log.warning("removing %s: it has no valid %s for recipe %s", final_dir, STAMP_FILE, final_dir.name)
        shutil.rmtree(final_dir)
    tmp_dir = final_dir.parent / f".{final_dir.name}.tmp-{os.getpid()}"
    log.info("building model %r into %s (a minute or two on a laptop CPU)", name, final_dir)
    try:
        stamp = model.build(name, model.recipe, tmp_dir, progress=progress)
        tmp_dir.rename(final_dir)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    results = ", ".join(f"{field} {stamp[field]:.3f}" for field in model.summary)
    log.info("built %s in %.1fs: %s", final_dir.name, stamp["build_seconds"], results)
