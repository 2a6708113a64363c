"""A job's tokenizer: the spec's ``model.tokenizer``, else the one saved with a checkpoint."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from services.common.config import JobSpec
from services.common.long_lived import freeze_long_lived_objects
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

        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=spec.model.trust_remote_code)
        freeze_long_lived_objects()  # transformers' modules stay; a full collection would walk them
        return tokenizer


def decode_texts(tokenizer: Any, sequences: Sequence[Sequence[int]]) -> list[str]:
    """Each token id sequence as text without special tokens, as ``tokenizer.decode`` gives it.

    A fast tokenizer whose decode adds no clean-up decodes through its Rust backend directly:
    ``decode`` first checks every id in Python, which cost more than the decoding (and the
    backend's ``decode_batch`` costs more than one call per sequence, in its thread pool).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not _decodes_plainly(tokenizer) or _cleans_up(tokenizer, backend):
        return [str(tokenizer.decode(list(ids), skip_special_tokens=True)) for ids in sequences]
    return [backend.decode(list(ids), skip_special_tokens=True) for ids in sequences]


def _decodes_plainly(tokenizer: Any) -> bool:
    """Whether ``tokenizer``'s class decodes as transformers' fast tokenizer does (a subclass
    may add its own steps)."""
    from transformers import PreTrainedTokenizerFast

    return getattr(type(tokenizer), "_decode", None) is PreTrainedTokenizerFast._decode


def _cleans_up(tokenizer: Any, backend: Any) -> bool:
    """Whether ``tokenizer.decode`` post-processes the backend's text (transformers skips the
    clean-up for BPE models unless forced)."""
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    forced = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
    return type(backend.model).__name__ != "BPE" or bool(getattr(tokenizer, forced, False))
