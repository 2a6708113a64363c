"""A job's tokenizer: the spec's ``model.tokenizer``, else the one saved with a checkpoint."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from services.common.config import JobSpec
from services.common.pb import common_pb2

_TOKENIZER_LOCK = threading.Lock()


def checkpoint_dir(handle: common_pb2.CheckpointHandle) -> Path:
    """The local directory of a ``file://`` checkpoint handle (raises ValueError otherwise); for
    a LoRA adapter's, its base model's (where the tokenizer is)."""
    uri = urlparse(handle.adapter.base_uri if handle.HasField("adapter") else handle.uri)
    if uri.scheme != "file":
        raise ValueError(f"checkpoint v{handle.version} of {handle.job_id}: unsupported uri {handle.uri!r}")
    return Path(unquote(uri.path))


def load_job_tokenizer(spec: JobSpec, handle: common_pb2.CheckpointHandle) -> Any:
    """The job's tokenizer: ``model.tokenizer`` when set, else the checkpoint directory's.

    Blocking (run it in a thread); raises OSError or ValueError when it cannot be loaded.
    """
    if spec.model.tokenizer is not None:
        from services.models import resolve_model_path  # a hub id or GGUF file: its local directory

        path = str(resolve_model_path(spec.model.tokenizer))
    else:
        path = str(checkpoint_dir(handle))
    # One at a time: transformers' lazy imports are not safe when threads race through them.
    with _TOKENIZER_LOCK:
        from transformers import AutoTokenizer  # a slow import, needed only once a job runs

        return AutoTokenizer.from_pretrained(path, trust_remote_code=spec.model.trust_remote_code)
