"""The layout of a job's checkpoint directory, ``{trainer.checkpoint_dir}/{job_id}/``, and a
read-only view of what it holds.

The trainer writes it (services/trainer/checkpoints.py); the export (services/common/export.py),
run by the cli or the api, and the api's listing and archives (services/api/artefacts.py) read it
through ``SavedVersions`` here, never the trainer's modules.

    base/                        LoRA jobs: the base model the adapters apply to (written once)
    weights/v{version:06d}-e{epoch}/   weights-only, every step: a model (model.safetensors,
                                 config, tokenizer) or a LoRA adapter (adapter_model.safetensors,
                                 adapter_config.json), and handle.json, its CheckpointHandle
    v{version:06d}/              durable: the same files, training_state/, critic/, consumed.json,
                                 checkpoint.json (its handle)

Every directory is written under a temporary name and renamed: one that exists is complete.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import unquote, urlparse

from google.protobuf import json_format

from services.common.pb import common_pb2

log = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
"""A whole model's weights (one file, whatever the size: engines verify its sha256)."""
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
"""A LoRA adapter's weights, as peft names them."""
ADAPTER_CONFIG_FILE = "adapter_config.json"
"""A LoRA adapter's config, as peft names it."""
WEIGHTS_DIR = "weights"
"""Inside the job directory: the weights-only directories."""
BASE_DIR = "base"
"""Inside the job directory of a LoRA job: the base model."""
WEIGHTS_HANDLE_FILE = "handle.json"
"""Inside a weights-only directory (and base/): its CheckpointHandle as JSON."""
HANDLE_FILE = "checkpoint.json"
"""Inside a durable checkpoint: its CheckpointHandle as JSON."""
MANIFEST_FILE = "consumed.json"
"""Inside a durable checkpoint: ``{"since_version": int, "ids": [...]}``."""
TRAINING_STATE_DIR = "training_state"
"""DeepSpeed's save_checkpoint directory inside a durable checkpoint."""
OWN_FILES = frozenset({WEIGHTS_HANDLE_FILE, HANDLE_FILE, MANIFEST_FILE})
"""Files of a checkpoint directory that describe it, never carried over to another."""
VERSION_DIR = re.compile(r"^v(\d{6,})$")
WEIGHTS_VERSION_DIR = re.compile(r"^v(\d{6,})-e(\d+)$")
ENTRY_REF = re.compile(r"^(\d{1,18}|base|v\d{6,18}(-e\d{1,9})?)$")
"""How a reader names one saved directory: a policy version number, or an entry's ``name``."""


def job_directory(root: Path, job_id: str) -> Path:
    return (root / job_id).resolve()


def durable_name(version: int) -> str:
    return f"v{version:06d}"


def weights_name(version: int, epoch: int) -> str:
    return f"v{version:06d}-e{epoch}"


def durable_versions(job_dir: Path) -> list[int]:
    """Versions of the complete durable checkpoints, ascending."""
    if not job_dir.is_dir():
        return []
    found = (VERSION_DIR.match(entry.name) for entry in job_dir.iterdir() if entry.is_dir())
    return sorted(int(match.group(1)) for match in found if match)


def weights_versions(job_dir: Path) -> list[tuple[int, int]]:
    """(epoch, version) of the complete weights-only directories, oldest lineage first."""
    root = job_dir / WEIGHTS_DIR
    if not root.is_dir():
        return []
    found = (WEIGHTS_VERSION_DIR.match(entry.name) for entry in root.iterdir())
    return sorted((int(match.group(2)), int(match.group(1))) for match in found if match)


def read_handle(path: Path) -> common_pb2.CheckpointHandle:
    """The CheckpointHandle saved as JSON at ``path`` (OSError, json_format.ParseError)."""
    return json_format.Parse(path.read_text(), common_pb2.CheckpointHandle())


@dataclass(frozen=True, slots=True)
class SavedVersion:
    """One version of a job's weights on disk."""

    handle: common_pb2.CheckpointHandle
    directory: Path

    @property
    def key(self) -> tuple[int, int]:
        """(epoch, version): a later lineage is newer than every version of an earlier one."""
        return int(self.handle.epoch), int(self.handle.version)

    @property
    def is_adapter(self) -> bool:
        return self.handle.HasField("adapter")

    def describe(self) -> str:
        kind = "durable" if self.handle.durable else "weights-only"
        return f"v{self.handle.version} (epoch {self.handle.epoch}, {kind})"


EntryKind = Literal["durable", "weights", "base"]


@dataclass(frozen=True, slots=True)
class SavedEntry:
    """One complete directory of a job's checkpoint directory, as the api lists and archives it."""

    name: str
    """``v000003`` (durable), ``v000003-e1`` (weights-only, lineage 1) or ``base`` (a LoRA job's base)."""
    kind: EntryKind
    handle: common_pb2.CheckpointHandle
    directory: Path

    def files(self) -> list[Path]:
        """Its regular files, relative to it, sorted; symbolic links (which could lead out of the
        directory) are left out, and so is anything that does not resolve inside it."""
        root = self.directory.resolve()
        found = []
        for folder, _, names in os.walk(root, followlinks=False):
            for name in names:
                path = Path(folder, name)
                if not path.is_symlink() and path.is_file() and path.resolve().is_relative_to(root):
                    found.append(path.relative_to(root))
        return sorted(found)

    def size_bytes(self) -> int:
        """What its files hold, in bytes (hard links counted in full)."""
        return sum((self.directory / path).stat().st_size for path in self.files())


class SavedVersions:
    """What one job's checkpoint directory holds: its durable checkpoints and weights-only versions."""

    def __init__(self, root: Path, job_id: str) -> None:
        self.job_id = job_id
        self.job_dir = job_directory(root, job_id)

    def all(self) -> list[SavedVersion]:
        """Every readable version, oldest first by (epoch, version); a version both durable and
        weights-only of one lineage appears once, as the durable checkpoint (the same weights)."""
        found: dict[tuple[int, int], SavedVersion] = {}
        for epoch, version in weights_versions(self.job_dir):
            directory = self.job_dir / WEIGHTS_DIR / weights_name(version, epoch)
            self._add(found, directory / WEIGHTS_HANDLE_FILE, directory)
        for version in durable_versions(self.job_dir):
            directory = self.job_dir / durable_name(version)
            self._add(found, directory / HANDLE_FILE, directory)
        return [found[key] for key in sorted(found)]

    @staticmethod
    def _add(found: dict[tuple[int, int], SavedVersion], handle_file: Path, directory: Path) -> None:
        try:
            saved = SavedVersion(read_handle(handle_file), directory)
        except (OSError, json_format.ParseError) as err:
            log.warning("%s is unreadable (%s); skipping it", directory, err)
            return
        found[saved.key] = saved

    def entries(self) -> list[SavedEntry]:
        """Every readable directory, durable and weights-only alike (a version may be both), and
        a LoRA job's base: the base first, then by (epoch, version), weights-only before durable."""
        found: list[SavedEntry] = []
        base = self.job_dir / BASE_DIR
        self._add_entry(found, BASE_DIR, "base", base / WEIGHTS_HANDLE_FILE, base)
        for epoch, version in weights_versions(self.job_dir):
            directory = self.job_dir / WEIGHTS_DIR / weights_name(version, epoch)
            self._add_entry(found, directory.name, "weights", directory / WEIGHTS_HANDLE_FILE, directory)
        for version in durable_versions(self.job_dir):
            directory = self.job_dir / durable_name(version)
            self._add_entry(found, directory.name, "durable", directory / HANDLE_FILE, directory)
        order = {"base": 0, "weights": 1, "durable": 2}
        return sorted(
            found, key=lambda e: (e.kind != "base", e.handle.epoch, e.handle.version, order[e.kind])
        )

    @staticmethod
    def _add_entry(
        found: list[SavedEntry], name: str, kind: EntryKind, handle_file: Path, directory: Path
    ) -> None:
        if directory.is_symlink() or not handle_file.is_file():  # a link could lead anywhere
            return
        try:
            found.append(SavedEntry(name, kind, read_handle(handle_file), directory))
        except (OSError, json_format.ParseError) as err:
            log.warning("%s is unreadable (%s); skipping it", directory, err)

    def entry(self, ref: str) -> SavedEntry:
        """The entry ``ref`` names (ENTRY_REF): its ``name``, or a version number as ``find``
        takes it. Raises LookupError naming the entries there are."""
        if not ENTRY_REF.match(ref):
            raise LookupError(
                f"{ref!r:.60} names no checkpoint: a version number, base, v000003 or v000003-e1"
            )
        entries = self.entries()
        name = ref
        if ref.isdigit():
            saved = self.find(int(ref))
            name = saved.directory.name
        for entry in entries:
            if entry.name == name:
                return entry
        there = ", ".join(entry.name for entry in entries) or "none"
        raise LookupError(f"job {self.job_id} has no checkpoint {ref} (saved: {there})")

    def find(self, version: int | None = None) -> SavedVersion:
        """``version`` of the newest lineage that has it (None: the newest version saved).
        Raises LookupError naming the versions there are."""
        saved = self.all()
        if version is not None:
            saved = [entry for entry in saved if entry.handle.version == version]
        if not saved:
            there = ", ".join(entry.describe() for entry in self.all()) or "none"
            wanted = "any version" if version is None else f"v{version}"
            raise LookupError(f"job {self.job_id} has no saved {wanted} in {self.job_dir} (saved: {there})")
        return saved[-1]


def file_uri_path(uri: str) -> Path:
    """The local path of a ``file:///abs/path`` uri (ValueError for any other)."""
    parsed = urlparse(uri)
    if parsed.scheme != "file" or parsed.netloc not in ("", "localhost"):
        raise ValueError(f"unsupported checkpoint uri {uri!r}: a file:///abs/path is needed")
    return Path(unquote(parsed.path))


def base_directory(handle: common_pb2.CheckpointHandle) -> Path:
    """The base model directory of an adapter handle (ValueError for a whole model's)."""
    if not handle.HasField("adapter"):
        raise ValueError(f"v{handle.version} of {handle.job_id} is a whole model, not an adapter")
    return file_uri_path(handle.adapter.base_uri)
