"""Where ``model.path`` (and ``model.tokenizer``) point: found without building or converting.

A model path is, tried in this order:

- ``builtin:<name>``: a base model verst builds for a toy task (``services.tasks``);
- a local directory: any Hugging Face directory ``from_pretrained`` loads;
- a local ``.gguf`` file, or ``model.gguf_file`` naming one inside a directory or hub id:
  converted once to a Hugging Face directory (``gguf.py``);
- a hub id (``org/name``): its snapshot in the local Hugging Face cache (``HF_HUB_CACHE``, else
  ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``, as the process saw them when it started),
  found the way ``from_pretrained`` finds it with ``HF_HUB_OFFLINE=1``: verst never downloads.

An existing local path wins over a hub id of the same spelling, as in ``from_pretrained``.
Importing this module imports neither torch nor transformers.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from pathlib import Path

from services.tasks import BUILTIN_PREFIX, builtin_model
from services.tasks.models import ModelPathError

GGUF_SUFFIX = ".gguf"
"""The suffix of a GGUF file (any case)."""


class Kind(enum.Enum):
    BUILTIN = "builtin"
    DIRECTORY = "directory"
    HUB = "hub"
    GGUF = "gguf"


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """What a model path names, found on this machine (nothing built, converted or loaded)."""

    kind: Kind
    path: str
    """The path as the spec wrote it."""
    directory: Path | None = None
    """The Hugging Face directory (a local one, or a hub id's cached snapshot); None for
    builtin models and for a GGUF file."""
    gguf: Path | None = None
    """The GGUF file to convert (kind GGUF)."""


def is_gguf_file(value: str) -> bool:
    """Whether ``value`` names a GGUF file by its suffix."""
    return value.lower().endswith(GGUF_SUFFIX)


def is_hub_id(value: str) -> bool:
    """Whether ``value`` is spelled as a Hugging Face hub repo id (``org/name`` or ``name``)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(value)
    except HFValidationError:
        return False
    return True


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache this process reads (``huggingface_hub.constants.HF_HUB_CACHE``)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def locate(path: str, gguf_file: str | None = None) -> ModelSource:
    """What ``path`` (with ``gguf_file`` inside it, if given) names on this machine; raises
    ``ModelPathError`` saying what is missing. Reads only the filesystem."""
    if path.startswith(BUILTIN_PREFIX):
        if gguf_file is not None:
            raise ModelPathError(f"a builtin model has no GGUF file (gguf_file {gguf_file!r})")
        builtin_model(path.removeprefix(BUILTIN_PREFIX))  # names the known ones when unknown
        return ModelSource(Kind.BUILTIN, path)
    local = Path(path).expanduser()
    if local.exists():
        return _local(path, local, gguf_file)
    if not is_hub_id(path):
        raise ModelPathError(f"{path!r} does not exist (and is not spelled as a Hugging Face hub id)")
    snapshot = _hub_snapshot(path)
    if gguf_file is not None:
        return _gguf_inside(path, snapshot, gguf_file)
    return ModelSource(Kind.HUB, path, directory=snapshot)


def _local(path: str, local: Path, gguf_file: str | None) -> ModelSource:
    if local.is_file():
        if not is_gguf_file(path):
            raise ModelPathError(f"{path!r} is a file: a model path is a directory or a {GGUF_SUFFIX} file")
        if gguf_file is not None:
            raise ModelPathError(f"{path!r} is a GGUF file already; gguf_file names one inside a directory")
        return ModelSource(Kind.GGUF, path, gguf=local.resolve())
    if not local.is_dir():
        raise ModelPathError(f"{path!r} is neither a directory nor a file")
    if gguf_file is not None:
        return _gguf_inside(path, local.resolve(), gguf_file)
    return ModelSource(Kind.DIRECTORY, path, directory=local.resolve())


def _gguf_inside(path: str, directory: Path, gguf_file: str) -> ModelSource:
    file = directory / gguf_file
    if not file.is_file():
        raise ModelPathError(f"{path!r} has no GGUF file {gguf_file!r} (looked in {directory})")
    return ModelSource(Kind.GGUF, path, gguf=file.resolve())


def _hub_snapshot(repo_id: str) -> Path:
    """The cached snapshot of ``repo_id`` at ``refs/main``, offline (``local_files_only``)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError):
        raise ModelPathError(
            f"{repo_id!r} is not a local path, and the hub id is not in the local Hugging Face cache "
            f"({hub_cache_dir()}): download it there first (`hf download {repo_id}`); verst never downloads"
        ) from None


def readable_problem(source: ModelSource, need: str | None = "config.json") -> str | None:
    """Why the located model cannot be read, or None: a GGUF file that is unreadable or no GGUF,
    a directory without a readable ``need`` (None: a directory that cannot be listed)."""
    if source.kind is Kind.GGUF:
        assert source.gguf is not None
        if not os.access(source.gguf, os.R_OK):
            return f"{str(source.gguf)!r:.200} is not readable"
        with source.gguf.open("rb") as file:
            if file.read(4) != b"GGUF":
                return f"{str(source.gguf)!r:.200} is not a GGUF file (it lacks the GGUF magic)"
        return None
    directory = source.directory
    if directory is None:
        return None  # a builtin model: built where it is needed
    if need is None:
        return None if os.access(directory, os.R_OK | os.X_OK) else f"{str(directory)!r:.200} is not readable"
    return None if os.access(directory / need, os.R_OK) else f"{str(directory)!r:.200} has no readable {need}"
