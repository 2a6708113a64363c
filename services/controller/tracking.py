"""A job's experiment tracking: every metric row the controller merges into the job record, also
written to the trackers its JobSpec chooses (``tracking.trackers``; the trackers are trackers.py's).

The job store's merge is the one place every row passes (the trainer's, the engines', the
evaluations', the controller's own), so the driver hands each merged batch to ``JobTracking.write``
right after the merge. The trackers are opened at the first rows (by then the trainer has made
the job's checkpoint directory, where their files go when the controller sees it), and closed
when the driver stops. A tracker that fails to open or to write is dropped with a warning
(``problems``): tracking never fails a job. A non-finite value is skipped with a warning.

Opening and writing block: the driver calls ``write`` and ``close`` in a thread, one at a time.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Sequence

from services.common.config import JobSpec
from services.common.jobs import MetricRow
from services.common.tracking_config import tracking_root
from services.controller.trackers import TRACKERS, TrackedRun, Tracker

log = logging.getLogger(__name__)


class JobTracking:
    """The trackers of one job; ``tracking_dir`` is where files go when the controller cannot see
    the job's checkpoint directory (ControllerSettings.tracking_dir)."""

    def __init__(self, job_id: str, spec: JobSpec, tracking_dir: str) -> None:
        self.job_id = job_id
        self.spec = spec
        self.tracking_dir = tracking_dir
        self.trackers: dict[str, Tracker] | None = None
        """By type, once opened."""
        self.problems: list[str] = []
        """Warnings not yet told on the job's event log (the driver takes them)."""
        self._non_finite: set[str] = set()
        self._lock = threading.Lock()  # a write still running in its thread when close comes

    def write(self, rows: Sequence[MetricRow]) -> None:
        """Each row's finite values to every open tracker, tagged ``{source}/{name}``."""
        if not rows or not self.spec.tracking.trackers:
            return
        with self._lock:
            if self.trackers is None:
                self.trackers = self._open()
            for row in rows:
                values = self._finite(row)
                for kind, tracker in list(self.trackers.items()) if values else []:
                    try:
                        tracker.write(row.step, values, row.time)
                    except Exception as err:  # a tracker's own failure: the job goes on without it
                        self._drop(kind, f"tracker {kind} stopped: cannot write step {row.step}: {err}")

    def close(self) -> None:
        """Flush and end every tracker's run."""
        with self._lock:
            for kind, tracker in list((self.trackers or {}).items()):
                try:
                    tracker.close()
                except Exception as err:
                    self._warn(f"tracker {kind}: closing failed: {err}")
            self.trackers = {}

    def take_problems(self) -> list[str]:
        """The warnings since the last call."""
        problems, self.problems = self.problems, []
        return problems

    def _open(self) -> dict[str, Tracker]:
        root = tracking_root(self.spec.trainer.checkpoint_dir, self.job_id, self.tracking_dir)
        run = TrackedRun(self.job_id, self.spec.name, root)
        opened: dict[str, Tracker] = {}
        for config in self.spec.tracking.trackers:
            try:
                opened[config.type] = TRACKERS.get(config.type).fn(config, run)
            except Exception as err:  # ImportError (not installed here), a store it cannot open
                self._warn(f"tracker {config.type} not started: {type(err).__name__}: {err}")
            else:
                log.info("%s: tracking with %s in %s", self.job_id, config.type, root)
        return opened

    def _finite(self, row: MetricRow) -> dict[str, float]:
        values = {}
        for name, value in row.values.items():
            tag = f"{row.source}/{name}"
            if math.isfinite(value):
                values[tag] = value
            elif tag not in self._non_finite:  # told once per tag
                self._non_finite.add(tag)
                self._warn(f"tracking skips {tag}: {value} at step {row.step} is not finite")
        return values

    def _drop(self, kind: str, text: str) -> None:
        assert self.trackers is not None
        tracker = self.trackers.pop(kind)
        self._warn(text)
        try:
            tracker.close()
        except Exception as err:
            log.debug("%s: closing the failed tracker %s: %s", self.job_id, kind, err)

    def _warn(self, text: str) -> None:
        log.warning("%s: %s", self.job_id, text)
        self.problems.append(text)
