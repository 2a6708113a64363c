"""The JobSpec's `tracking` section: the experiment trackers that also record a job's metrics, and
where their files go.

The controller writes every metric row it merges into the job record to each tracker
(services/controller/tracking.py); a tracker is chosen by its ``type``. Files go in the job's
directory, ``{trainer.checkpoint_dir}/{job_id}/``, when the controller sees that directory (a local
stack), else in ``{VERST_CONTROLLER_TRACKING_DIR}/{job_id}/`` (``tracking_root``); TensorBoard's in
its ``tensorboard/``, W&B's offline runs in its ``wandb/``, MLflow's file store in its ``mlruns/``.

This module imports nothing heavy: the JobSpec's module uses it, and the api checks with
``tracker_problems`` that each chosen tracker's package is installed (the controller runs there).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Annotated, ClassVar, Literal

from pydantic import Field, field_validator

from services.common.section import Section

DEFAULT_TRACKING_DIR = ".verst/tracking"
"""Where tracker files go when the controller cannot see the job's checkpoint directory (the
default of VERST_CONTROLLER_TRACKING_DIR, relative to the controller's working directory)."""
TENSORBOARD_DIR = "tensorboard"
"""Inside a job's tracking root: TensorBoard's event files."""
WANDB_DIR = "wandb"
"""Inside a job's tracking root: W&B's offline runs (`wandb sync` uploads them)."""
MLFLOW_DIR = "mlruns"
"""Inside a job's tracking root: MLflow's file store."""
RUN_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"
"""The form of a W&B project or group, and of an MLflow experiment."""


class TensorBoardTracker(Section):
    """TensorBoard event files (written with tensorboardX): each metric a scalar, `{source}/{name}`."""

    package: ClassVar[str] = "tensorboardX"
    """The module the controller needs to write it."""
    extra: ClassVar[str] = "verst"
    """What to pip install for it."""

    type: Literal["tensorboard"]
    """Chooses TensorBoard."""
    flush_s: int = Field(10, ge=1, le=3600)
    """Most seconds a written scalar waits in memory before it reaches the event file."""


class WandbTracker(Section):
    """A Weights & Biases run in offline mode (nothing leaves the host; `wandb sync` uploads it)."""

    package: ClassVar[str] = "wandb"
    extra: ClassVar[str] = "verst[wandb]"

    type: Literal["wandb"]
    """Chooses W&B."""
    project: str = Field("verst", pattern=RUN_NAME)
    """Project the run belongs to once synced."""
    group: str | None = Field(None, pattern=RUN_NAME)
    """Group of runs it is shown in; null: none."""


class MlflowTracker(Section):
    """An MLflow run in a local file store (`mlflow ui --backend-store-uri <its mlruns/>` shows it)."""

    package: ClassVar[str] = "mlflow"
    extra: ClassVar[str] = "verst[mlflow]"

    type: Literal["mlflow"]
    """Chooses MLflow."""
    experiment: str = Field("verst", pattern=RUN_NAME)
    """Experiment the job's run is recorded under."""


TrackerConfig = Annotated[TensorBoardTracker | WandbTracker | MlflowTracker, Field(discriminator="type")]
"""One tracker, chosen by its `type`."""


class TrackingConfig(Section):
    """Experiment trackers that record the job's metrics besides its record (docs/controller.md)."""

    trackers: list[TrackerConfig] = Field(
        default_factory=lambda: [TensorBoardTracker(type="tensorboard")], max_length=3
    )
    """Each of `{type: tensorboard}` (the default), `{type: wandb}` (offline), `{type: mlflow}` (a
    local file store), at most once; `[]` tracks nothing."""

    @field_validator("trackers")
    @classmethod
    def _each_type_once(cls, value: list[TrackerConfig]) -> list[TrackerConfig]:
        types = [tracker.type for tracker in value]
        twice = sorted({name for name in types if types.count(name) > 1})
        if twice:
            raise ValueError(f"names {', '.join(twice)} twice (one of each type)")
        return value


def tracker_problems(tracking: TrackingConfig) -> list[tuple[tuple[str, ...], str]]:
    """(field path, message) for each chosen tracker whose package is not installed here."""
    return [
        (
            ("tracking", "trackers", str(index), "type"),
            f"{tracker.type} is chosen but its package {tracker.package!r} is not installed where the"
            f" controller runs (pip install '{tracker.extra}'), or leave it out of tracking.trackers",
        )
        for index, tracker in enumerate(tracking.trackers)
        if importlib.util.find_spec(tracker.package) is None
    ]


def tracking_root(checkpoint_dir: str | Path, job_id: str, fallback: str | Path) -> Path:
    """Where a job's tracker files go: its checkpoint directory when ``checkpoint_dir`` is a
    directory here, else ``fallback/{job_id}``."""
    root = Path(checkpoint_dir)
    base = root if root.is_dir() else Path(fallback)
    return (base / job_id).absolute()
