"""A job's saved weights under ``{checkpoint_dir}/{job_id}/``: weights for the engines every
step, durable checkpoints to resume from every few steps.

``weights/v{version:06d}-e{epoch}/`` (weights-only, every step): the policy in the rollout
dtype as an HF-loadable directory (one model.safetensors, config, tokenizer files) and
``handle.json``, its CheckpointHandle. Engines load these; the newest ``KEEP_WEIGHTS`` are
kept, so an engine still loading the previous one finds it. For a LoRA job (``model.lora``)
these hold the adapter alone (adapter_model.safetensors, adapter_config.json), and ``base/``,
written once per job and never pruned, the base model its handles name (``LoraAdapter``).

``v{version:06d}/`` (durable, every ``trainer.checkpoint_every_steps``, at the end, on a stop
and on SIGTERM): the same HF files (hard links to that version's weights-only copy where the
filesystem allows), ``training_state/`` (DeepSpeed's checkpoint of the optimiser and schedule,
one partition file per rank under ZeRO, with ``training_state.json`` saying which world size
and ZeRO stage wrote it), ``critic/`` when the job has one, ``consumed.json`` (the trajectory
ids trained since the previous durable checkpoint, whose version is ``since_version``: bytes
proportional to the interval, never to the run) and ``checkpoint.json`` (its handle, durable).
The newest ``keep_checkpoints`` are kept; their manifests are the trainer's de-duplication
window (collector.TrainedWindow).

The layout's names and a read-only view of it are services/common/checkpoint_layout.py's.

Every directory is written under a temporary name and renamed into place, so one that exists
is complete; that is what a trainer resuming a reclaimed job relies on. With several trainer
ranks every rank writes into the same staging directory (the checkpoint directory must be
shared by them), rank 0 renames it.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import json_format

from services.common.checkpoint_layout import (
    ADAPTER_WEIGHTS_FILE,
    BASE_DIR,
    HANDLE_FILE,
    MANIFEST_FILE,
    OWN_FILES,
    TRAINING_STATE_DIR,
    WEIGHTS_DIR,
    WEIGHTS_FILE,
    WEIGHTS_HANDLE_FILE,
    durable_name,
    durable_versions,
    job_directory,
    read_handle,
    weights_name,
    weights_versions,
)
from services.common.pb import common_pb2

log = logging.getLogger(__name__)

TRAINING_STATE_TAG = "state"
"""The DeepSpeed checkpoint tag (its sub-directory) inside TRAINING_STATE_DIR."""
TRAINING_STATE_FILE = "training_state.json"
"""Inside TRAINING_STATE_DIR: the world size and ZeRO stage that wrote it."""
KEEP_WEIGHTS = 3
"""Weights-only directories kept: the newest, and two an engine may still be loading."""
RESCAN_EVERY = 100
"""``prune`` lists the directories again after this many prunes (else it goes by what this
store wrote and deleted): a safety net for directories written by another trainer."""


@dataclass(frozen=True, slots=True)
class PublishedWeights:
    handle: common_pb2.CheckpointHandle
    directory: Path
    bytes_written: int


@dataclass(frozen=True, slots=True)
class BaseWeights:
    """The base model of a LoRA job (``base/``): what its adapters apply to."""

    directory: Path
    sha256: str
    """Of its model.safetensors."""
    size_bytes: int

    def to_proto(self) -> common_pb2.LoraAdapter:
        return common_pb2.LoraAdapter(
            base_uri=self.directory.as_uri(), base_sha256=self.sha256, base_size_bytes=self.size_bytes
        )


@dataclass(frozen=True, slots=True)
class SavedCheckpoint:
    """A durable checkpoint."""

    handle: common_pb2.CheckpointHandle
    directory: Path
    consumed: frozenset[str]
    """The trajectory ids trained since the previous durable checkpoint."""
    since_version: int
    """The version of the previous durable checkpoint (0: the base model)."""
    bytes_written: int = 0
    """Bytes this save wrote (hard-linked weights excluded); 0 for one loaded from disk."""

    @property
    def training_state(self) -> Path | None:
        """The optimiser and schedule state saved with the weights (absent: fresh moments)."""
        state = self.directory / TRAINING_STATE_DIR
        return state if (state / TRAINING_STATE_FILE).is_file() else None


def file_sha256(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def tree_bytes(directory: Path, skip: frozenset[Path] = frozenset()) -> int:
    """The size of the files under ``directory``, less those in ``skip``."""
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file() and p not in skip)


def _link_or_copy(source: Path, target: Path) -> bool:
    """Hard-link ``source`` as ``target`` (True), or copy it where links are refused (False)."""
    try:
        os.link(source, target)
        return True
    except OSError:
        shutil.copy2(source, target)
        return False


def link_files(source: Path, staging: Path, final: Path, skip: frozenset[str]) -> set[Path]:
    """Hard-link (or copy) the top-level files of ``source`` but ``skip`` into ``staging``;
    returns the paths they will have under ``final`` that were linked, not written."""
    linked = set()
    for path in source.iterdir():
        if path.is_file() and path.name not in skip and _link_or_copy(path, staging / path.name):
            linked.add(final / path.name)
    return linked


@dataclass(slots=True)
class _Index:
    """A job directory's complete checkpoints, as ``CheckpointStore.prune`` knows them."""

    durable: list[int]
    """Versions of the durable checkpoints, ascending."""
    weights: list[tuple[int, int]]
    """(epoch, version) of the weights-only directories, ascending."""
    prunes: int = 0
    """Prunes since the directories were last listed."""


class CheckpointStore:
    """Writes, finds and prunes one job's weights-only and durable checkpoints."""

    def __init__(self, root: Path, job_id: str, keep: int) -> None:
        if keep < 1:
            raise ValueError("keep must be >= 1")
        self.job_id = job_id
        self.job_dir = job_directory(root, job_id)
        self.weights_root = self.job_dir / WEIGHTS_DIR
        self.base_dir = self.job_dir / BASE_DIR
        self.keep = keep
        self._index: _Index | None = None
        """What ``prune`` goes by: the directories on disk as last listed, plus what this store
        wrote since (None: list them at the next prune)."""

    def directory(self, version: int) -> Path:
        """The durable checkpoint of ``version``."""
        return self.job_dir / durable_name(version)

    def weights_directory(self, version: int, epoch: int) -> Path:
        return self.weights_root / weights_name(version, epoch)

    # -- writing -------------------------------------------------------------------------

    def _stage(self, final: Path, fill: Callable[[Path], None]) -> None:
        """Write ``final`` through ``fill(staging)`` and rename it into place."""
        if final.exists():
            raise FileExistsError(f"checkpoint {final} already exists")
        staging = final.parent / f".{final.name}.tmp-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        try:
            fill(staging)
            os.rename(staging, final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise

    def publish_weights(
        self,
        version: int,
        epoch: int,
        dtype: str,
        write_model: Callable[[Path], None],
        like: Path | None = None,
        base: BaseWeights | None = None,
    ) -> PublishedWeights:
        """Write weights-only ``version`` of lineage ``epoch``: ``write_model(dir)`` writes the HF
        files, or with ``like`` (an earlier checkpoint of the model) only model.safetensors, the
        config and tokenizer files being linked from there. With ``base`` the files are a LoRA
        adapter of it (adapter_model.safetensors, whose sha256 the handle gives, and its config)."""
        final = self.weights_directory(version, epoch)
        handle = common_pb2.CheckpointHandle(
            job_id=self.job_id, version=version, uri=final.as_uri(), format="safetensors", step=version
        )
        handle.epoch, handle.dtype = epoch, dtype
        if base is not None:
            handle.adapter.CopyFrom(base.to_proto())
        name = WEIGHTS_FILE if base is None else ADAPTER_WEIGHTS_FILE
        linked: set[Path] = set()

        def fill(staging: Path) -> None:
            if like is not None:
                linked.update(link_files(like, staging, final, OWN_FILES | {name}))
            write_model(staging)
            weights = staging / name
            if not weights.is_file():
                raise FileNotFoundError(f"the model was saved without a single {name}")
            handle.sha256, handle.size_bytes = file_sha256(weights), weights.stat().st_size
            handle.created_at.GetCurrentTime()
            (staging / WEIGHTS_HANDLE_FILE).write_text(json_format.MessageToJson(handle))

        self._stage(final, fill)
        if self._index is not None:
            bisect.insort(self._index.weights, (epoch, version))
        return PublishedWeights(handle, final, tree_bytes(final, frozenset(linked)))

    def ensure_base(self, dtype: str, write_model: Callable[[Path], None]) -> BaseWeights:
        """The job's base model directory for its LoRA adapters: written once (``write_model``
        writes the HF files) and kept for the life of the job directory, never pruned."""
        handle_file = self.base_dir / WEIGHTS_HANDLE_FILE
        if not self.base_dir.exists():

            def fill(staging: Path) -> None:
                write_model(staging)
                weights = staging / WEIGHTS_FILE
                if not weights.is_file():
                    raise FileNotFoundError(f"the base model was saved without a single {WEIGHTS_FILE}")
                handle = common_pb2.CheckpointHandle(
                    job_id=self.job_id, uri=self.base_dir.as_uri(), format="safetensors", dtype=dtype
                )
                handle.sha256, handle.size_bytes = file_sha256(weights), weights.stat().st_size
                handle.created_at.GetCurrentTime()
                (staging / WEIGHTS_HANDLE_FILE).write_text(json_format.MessageToJson(handle))

            self._stage(self.base_dir, fill)
        handle = read_handle(handle_file)
        return BaseWeights(self.base_dir, handle.sha256, handle.size_bytes)

    def save_durable(
        self,
        weights: PublishedWeights,
        write_state: Callable[[Path], None],
        consumed: Sequence[str],
        since_version: int,
    ) -> SavedCheckpoint:
        """Durable checkpoint of ``weights``' version: its HF files (linked), ``write_state(dir)``'s
        training state, and the manifest of ``consumed`` ids (trained since ``since_version``)."""
        final = self.directory(weights.handle.version)
        handle = common_pb2.CheckpointHandle()
        handle.CopyFrom(weights.handle)
        handle.uri, handle.durable = final.as_uri(), True
        linked: set[Path] = set()

        def fill(staging: Path) -> None:
            linked.update(link_files(weights.directory, staging, final, OWN_FILES))
            write_state(staging)
            manifest = {"since_version": since_version, "ids": sorted(set(consumed))}
            (staging / MANIFEST_FILE).write_text(json.dumps(manifest))
            handle.created_at.GetCurrentTime()
            (staging / HANDLE_FILE).write_text(json_format.MessageToJson(handle))

        self._stage(final, fill)
        if self._index is not None:
            bisect.insort(self._index.durable, int(weights.handle.version))
        ids = frozenset(consumed)
        return SavedCheckpoint(handle, final, ids, since_version, tree_bytes(final, frozenset(linked)))

    # -- reading -------------------------------------------------------------------------

    def versions(self) -> list[int]:
        """Versions of the complete durable checkpoints, ascending."""
        return durable_versions(self.job_dir)

    def weights(self) -> list[tuple[int, int]]:
        """(epoch, version) of the complete weights-only directories, oldest lineage first."""
        return weights_versions(self.job_dir)

    def load(self, version: int) -> SavedCheckpoint:
        """A durable checkpoint written earlier (by this or another trainer)."""
        directory = self.directory(version)
        handle = read_handle(directory / HANDLE_FILE)
        manifest = json.loads((directory / MANIFEST_FILE).read_text())
        return SavedCheckpoint(handle, directory, frozenset(manifest["ids"]), int(manifest["since_version"]))

    def durable_checkpoints(self) -> list[SavedCheckpoint]:
        """The readable durable checkpoints, oldest first (an unreadable one is skipped)."""
        found = []
        for version in self.versions():
            try:
                found.append(self.load(version))
            except (OSError, ValueError, KeyError, json_format.ParseError) as err:
                log.warning("checkpoint %s is unreadable (%s); skipping it", version, err)
        return found

    def latest(self) -> SavedCheckpoint | None:
        """The newest readable durable checkpoint, or None when the job has none."""
        found = self.durable_checkpoints()
        return found[-1] if found else None

    # -- pruning -------------------------------------------------------------------------

    def prune(self) -> list[Path]:
        """Delete all but the newest ``keep`` durable checkpoints and the newest ``KEEP_WEIGHTS``
        weights-only directories (by lineage, then version); returns what was deleted. Runs
        every step: it goes by an index of the directories (listed once every ``RESCAN_EVERY``
        prunes, and kept up to date by this store's writes), not by listing them each time."""
        index = self._index
        if index is None or index.prunes >= RESCAN_EVERY:
            index = self._index = _Index(self.versions(), self.weights())
        index.prunes += 1
        old_durable, index.durable = index.durable[: -self.keep], index.durable[-self.keep :]
        old_weights, index.weights = index.weights[:-KEEP_WEIGHTS], index.weights[-KEEP_WEIGHTS:]
        durable = [self.directory(v) for v in old_durable]
        weights = [self.weights_directory(v, e) for e, v in old_weights]
        for directory in durable + weights:
            shutil.rmtree(directory, ignore_errors=True)
        return durable + weights

    def remove_partial(self) -> None:
        """Delete staging directories left by a trainer that died while saving."""
        for parent in (self.job_dir, self.weights_root):
            if parent.is_dir():
                for pattern in (".v*.tmp-*", f".{BASE_DIR}.tmp-*"):
                    for entry in parent.glob(pattern):
                        shutil.rmtree(entry, ignore_errors=True)
