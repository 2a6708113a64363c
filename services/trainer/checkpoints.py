"""A job's checkpoint directories: ``{checkpoint_dir}/{job_id}/v{version:06d}/``.

Each is an HF-loadable directory (model.safetensors, config, tokenizer files)
plus ``trained_ids.json`` (every trajectory id trained into these weights),
``checkpoint.json`` (its CheckpointHandle, whose ``step`` is the version) and,
from v1 on, ``training_state/``: DeepSpeed's checkpoint of the optimiser (moments
and step counts, one partition file per rank under ZeRO) and of the learning-rate
schedule, with ``training_state.json`` saying which world size and ZeRO stage
wrote it. A directory is written under a temporary name and renamed into place,
so one that exists is complete; that is what a trainer resuming a reclaimed job
relies on. With several trainer ranks every rank writes into the same staging
directory (the checkpoint directory must be shared by them), rank 0 renames it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import json_format

from services.common.pb import common_pb2

log = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
TRAINED_IDS_FILE = "trained_ids.json"
HANDLE_FILE = "checkpoint.json"
TRAINING_STATE_DIR = "training_state"
"""DeepSpeed's save_checkpoint directory inside a checkpoint."""
TRAINING_STATE_TAG = "state"
"""The DeepSpeed checkpoint tag (its sub-directory) inside TRAINING_STATE_DIR."""
TRAINING_STATE_FILE = "training_state.json"
"""Inside TRAINING_STATE_DIR: the world size and ZeRO stage that wrote it."""
_VERSION_DIR = re.compile(r"^v(\d{6,})$")


@dataclass(frozen=True, slots=True)
class SavedCheckpoint:
    handle: common_pb2.CheckpointHandle
    directory: Path
    trained_ids: frozenset[str]

    @property
    def training_state(self) -> Path | None:
        """The optimiser and schedule state saved with the weights; None in v0."""
        state = self.directory / TRAINING_STATE_DIR
        return state if (state / TRAINING_STATE_FILE).is_file() else None


def file_sha256(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


class CheckpointStore:
    """Writes, finds and prunes one job's checkpoints."""

    def __init__(self, root: Path, job_id: str, keep: int) -> None:
        if keep < 1:
            raise ValueError("keep must be >= 1")
        self.job_id = job_id
        self.job_dir = (root / job_id).resolve()
        self.keep = keep

    def directory(self, version: int) -> Path:
        return self.job_dir / f"v{version:06d}"

    def save(
        self,
        version: int,
        step: int,
        write_model: Callable[[Path], None],
        trained_ids: Iterable[str],
    ) -> SavedCheckpoint:
        """Write checkpoint ``version``: ``write_model(dir)`` writes the HF files."""
        final = self.directory(version)
        if final.exists():
            raise FileExistsError(f"checkpoint {final} already exists")
        staging = self.job_dir / f".{final.name}.tmp-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        try:
            write_model(staging)
            weights = staging / WEIGHTS_FILE
            if not weights.is_file():
                raise FileNotFoundError(f"the model was saved without a single {WEIGHTS_FILE}")
            ids = sorted(set(trained_ids))
            (staging / TRAINED_IDS_FILE).write_text(json.dumps(ids))
            handle = common_pb2.CheckpointHandle(
                job_id=self.job_id,
                version=version,
                uri=final.as_uri(),
                format="safetensors",
                sha256=file_sha256(weights),
                step=step,
                size_bytes=weights.stat().st_size,
            )
            handle.created_at.GetCurrentTime()
            (staging / HANDLE_FILE).write_text(json_format.MessageToJson(handle))
            os.rename(staging, final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return SavedCheckpoint(handle, final, frozenset(ids))

    def versions(self) -> list[int]:
        """Versions of the complete checkpoints, ascending."""
        if not self.job_dir.is_dir():
            return []
        found = (_VERSION_DIR.match(entry.name) for entry in self.job_dir.iterdir() if entry.is_dir())
        return sorted(int(match.group(1)) for match in found if match)

    def load(self, version: int) -> SavedCheckpoint:
        """A checkpoint written earlier (by this or another trainer)."""
        directory = self.directory(version)
        handle = json_format.Parse((directory / HANDLE_FILE).read_text(), common_pb2.CheckpointHandle())
        ids = json.loads((directory / TRAINED_IDS_FILE).read_text())
        return SavedCheckpoint(handle, directory, frozenset(ids))

    def latest(self) -> SavedCheckpoint | None:
        """The newest readable checkpoint, or None when the job has none."""
        for version in reversed(self.versions()):
            try:
                return self.load(version)
            except (OSError, ValueError, json_format.ParseError) as err:
                log.warning("checkpoint %s is unreadable (%s); trying an older one", version, err)
        return None

    def prune(self) -> list[int]:
        """Delete all but the newest ``keep`` checkpoints and v0; returns the deleted versions."""
        versions = self.versions()
        kept = set(versions[-self.keep :]) | {0}
        deleted = [version for version in versions if version not in kept]
        for version in deleted:
            shutil.rmtree(self.directory(version), ignore_errors=True)
        return deleted

    def remove_partial(self) -> None:
        """Delete staging directories left by a trainer that died while saving."""
        if self.job_dir.is_dir():
            for entry in self.job_dir.glob(".v*.tmp-*"):
                shutil.rmtree(entry, ignore_errors=True)
