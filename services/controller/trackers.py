"""The experiment trackers a JobSpec chooses in ``tracking.trackers``, each registered by its
``type`` in ``TRACKERS``; the controller's ``JobTracking`` (tracking.py) feeds them.

The contract of a tracker, a class registered here::

    tracker = TRACKERS.get(config.type).fn(config, run)  # open the job's run (again, after a restart)
    tracker.write(step, {tag: value}, wall_time)          # one metric row, every value finite
    tracker.close()                                       # flush and end the run

Tags are ``{source}/{name}`` (``trainer/reward_mean``, ``eval/accuracy``), as in the job record;
the step is the row's. A tracker opened on a run a previous controller wrote reads back the
highest step of each tag there (``Watermarks``) and skips rows at or below it: a restarted
controller that replays the job's history duplicates nothing. Opening and writing block (files,
W&B's service): the controller calls them in a thread.
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from services.common.registry import Entry, Registry
from services.common.tracking_config import (
    MLFLOW_DIR,
    TENSORBOARD_DIR,
    WANDB_DIR,
    MlflowTracker,
    TensorBoardTracker,
    WandbTracker,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TrackedRun:
    """The job a tracker records."""

    job_id: str
    name: str
    """The JobSpec's name."""
    root: Path
    """The job's tracking root (tracking_config.tracking_root): each tracker writes in a folder of it."""


class Tracker(Protocol):
    """An open run of one job; its class is called with the tracker's config and the TrackedRun."""

    def write(self, step: int, values: Mapping[str, float], wall_time: float) -> None:
        """Record one row's values (tag -> finite value) at ``step``, stamped ``wall_time``."""
        ...

    def close(self) -> None:
        """Flush and end the run; nothing is written after."""
        ...


TRACKERS: Registry[Entry[Callable[[Any, TrackedRun], Tracker]]] = Registry(
    Entry, kind="experiment tracker", field="tracking.trackers.type", owner="controller"
)


class Watermarks:
    """The highest step of each tag that a run held when it was opened."""

    def __init__(self, steps: Mapping[str, int]) -> None:
        self.steps = dict(steps)

    def fresh(self, step: int, values: Mapping[str, float]) -> dict[str, float]:
        """The values of ``values`` not recorded before (their tag's step is past the mark)."""
        if not self.steps:
            return dict(values)
        return {tag: value for tag, value in values.items() if step > self.steps.get(tag, -1)}


# -- TensorBoard ---------------------------------------------------------------------------------


def event_records(path: Path) -> Iterator[bytes]:
    """The records of a TFRecord file (an event file): length, its CRC, data, its CRC. A record
    cut short (a writer killed mid-write) ends the file."""
    data = path.read_bytes()
    pos = 0
    while pos + 12 <= len(data):
        (length,) = struct.unpack("<Q", data[pos : pos + 8])
        end = pos + 12 + length
        if end + 4 > len(data):
            return
        yield data[pos + 12 : end]
        pos = end + 4


def scalar_events(directory: Path) -> Iterator[tuple[str, int, float, float]]:
    """(tag, step, value, wall_time) of every scalar in the event files of ``directory``."""
    from tensorboardX.proto.event_pb2 import Event

    for path in sorted(directory.glob("events.out.tfevents.*")):
        for record in event_records(path):
            event = Event.FromString(record)
            for value in event.summary.value:
                if value.WhichOneof("value") == "simple_value":
                    yield value.tag, event.step, value.simple_value, event.wall_time


@TRACKERS.register("tensorboard")
class TensorBoard:
    """Event files in the run's ``tensorboard/``; a restart adds a file beside the earlier ones.
    Values are float32 (TensorBoard's scalars)."""

    def __init__(self, config: TensorBoardTracker, run: TrackedRun) -> None:
        from tensorboardX import FileWriter
        from tensorboardX.proto.summary_pb2 import Summary

        self.directory = run.root / TENSORBOARD_DIR
        steps: dict[str, int] = {}
        if self.directory.is_dir():
            for tag, step, _, _ in scalar_events(self.directory):
                steps[tag] = max(step, steps.get(tag, step))
        self.marks = Watermarks(steps)
        # The file is named by the second and the host and opened "wb": a writer reopened within
        # the same second would truncate the earlier file without a suffix of its own.
        suffix = f".{uuid.uuid4().hex[:8]}"
        self.writer = FileWriter(
            str(self.directory), flush_secs=config.flush_s, max_queue=1000, filename_suffix=suffix
        )
        self.summary = Summary

    def write(self, step: int, values: Mapping[str, float], wall_time: float) -> None:
        """One event a row, its scalars together (an event for each scalar, as ``add_scalar``
        writes them, cost the controller more than the rest of a step's metrics)."""
        fresh = self.marks.fresh(step, values)
        if fresh:
            scalars = [self.summary.Value(tag=tag, simple_value=value) for tag, value in fresh.items()]
            self.writer.add_summary(self.summary(value=scalars), step, wall_time)

    def close(self) -> None:
        self.writer.close()


# -- Weights & Biases, offline -------------------------------------------------------------------

WANDB_STEPS_FILE = "verst_steps.json"
"""In the run's ``wandb/``: the highest step written of each tag (an offline run is not read back)."""
WANDB_STEP = "step"
"""The metric every chart of the run is plotted against: the row's step (W&B's own ``_step``
counts logs, and a late evaluation row may carry an earlier step than the trainer's last)."""


@TRACKERS.register("wandb")
class Wandb:
    """An offline W&B run with the job's id, in the run's ``wandb/``; a restart resumes it."""

    def __init__(self, config: WandbTracker, run: TrackedRun) -> None:
        import wandb

        (run.root / WANDB_DIR).mkdir(parents=True, exist_ok=True)
        self.steps_file = run.root / WANDB_DIR / WANDB_STEPS_FILE
        self.steps: dict[str, int] = (
            json.loads(self.steps_file.read_text()) if self.steps_file.exists() else {}
        )
        self.marks = Watermarks(self.steps)
        self.run = wandb.init(
            project=config.project,
            group=config.group,
            name=run.name,
            id=re.sub(r"[^A-Za-z0-9_-]", "-", run.job_id)[-64:],
            dir=str(run.root),  # W&B adds the wandb/ folder itself
            mode="offline",  # nothing leaves the host: `wandb sync` uploads the run
            resume="allow",
            reinit="create_new",  # one run per job, several jobs at once in one controller
            settings=wandb.Settings(silent=True, console="off", x_disable_stats=True, save_code=False),
        )
        self.run.define_metric(WANDB_STEP, hidden=True)
        self.run.define_metric("*", step_metric=WANDB_STEP)

    def write(self, step: int, values: Mapping[str, float], wall_time: float) -> None:
        fresh = self.marks.fresh(step, values)
        if not fresh:
            return
        self.run.log({**fresh, WANDB_STEP: step})
        self.steps.update({tag: max(step, self.steps.get(tag, step)) for tag in fresh})
        partial = self.steps_file.with_suffix(".tmp")
        partial.write_text(json.dumps(self.steps))
        partial.replace(self.steps_file)

    def close(self) -> None:
        self.run.finish()


# -- MLflow, a local file store ------------------------------------------------------------------

JOB_TAG = "verst.job_id"
"""The MLflow run tag holding the job's id: a restart finds the job's run by it."""


def mlflow_key(tag: str) -> str:
    """``tag`` as an MLflow metric key (letters, digits, ``_-. /``): ``eval/pass@4`` is ``eval/pass_at_4``."""
    return re.sub(r"[^\w\-. /]", "_", tag.replace("@", "_at_"))


@TRACKERS.register("mlflow")
class Mlflow:
    """The job's run in the file store ``mlruns/`` of the run's root; a restart continues it."""

    def __init__(self, config: MlflowTracker, run: TrackedRun) -> None:
        # MLflow 3 keeps the file store in maintenance mode behind this switch; it is the one
        # local store that needs no database packages.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=(run.root / MLFLOW_DIR).absolute().as_uri())
        experiment = self.client.get_experiment_by_name(config.experiment)
        experiment_id = (
            experiment.experiment_id if experiment else self.client.create_experiment(config.experiment)
        )
        found = self.client.search_runs(
            [experiment_id], filter_string=f"tags.`{JOB_TAG}` = '{run.job_id}'", max_results=1
        )
        if found:
            self.run_id = found[0].info.run_id
            self.marks = Watermarks(self._steps(found[0].data.metrics))
        else:
            created = self.client.create_run(experiment_id, run_name=run.name, tags={JOB_TAG: run.job_id})
            self.run_id = created.info.run_id
            self.marks = Watermarks({})

    def _steps(self, keys: Mapping[str, float]) -> dict[str, int]:
        steps = {}
        for key in keys:
            history = self.client.get_metric_history(self.run_id, key)
            steps[key] = max(metric.step for metric in history)
        return steps

    def write(self, step: int, values: Mapping[str, float], wall_time: float) -> None:
        from mlflow.entities import Metric

        fresh = self.marks.fresh(step, {mlflow_key(tag): value for tag, value in values.items()})
        if fresh:
            at = int(wall_time * 1000)
            metrics = [Metric(key, value, at, step) for key, value in fresh.items()]
            self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
