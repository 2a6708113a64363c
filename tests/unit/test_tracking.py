"""Experiment tracking (services/controller/tracking.py, trackers.py): the `tracking` section of
the JobSpec, and each tracker's files read back with an independent reader: TensorBoard's own
EventAccumulator, W&B's offline run records, MLflow's client on the file store."""

from __future__ import annotations

import json
import math
import struct
import sys
import typing
from pathlib import Path

import numpy as np
import pytest

from services.common.config import JobSpec, JobSpecError, parse_job_spec
from services.common.jobs import MetricRow
from services.common.tracking_config import TENSORBOARD_DIR, TrackerConfig, WandbTracker, tracker_problems
from services.controller.trackers import TRACKERS, mlflow_key, scalar_events
from services.controller.tracking import JobTracking

JOB = "addition-0123abcd"


def spec_with(tmp_path: Path, *trackers: dict[str, object]) -> JobSpec:
    (tmp_path / "runs").mkdir(exist_ok=True)
    return JobSpec.model_validate(
        {"trainer": {"checkpoint_dir": str(tmp_path / "runs")}, "tracking": {"trackers": list(trackers)}}
    )


def rows(steps: range, source: str = "trainer") -> list[MetricRow]:
    """Rows whose values differ per step and name; time is 1000 + step."""
    return [
        MetricRow(step, step, source, {"reward_mean": 0.1 * step + 0.03, "loss": -1.5 / step}, 1000.0 + step)
        for step in steps
    ]


def tracked(spec: JobSpec, tmp_path: Path, *batches: list[MetricRow]) -> list[str]:
    """Each batch written by one JobTracking, closed after it (a controller restart in between)."""
    problems = []
    for batch in batches:
        tracking = JobTracking(JOB, spec, str(tmp_path / "fallback"))
        tracking.write(batch)
        tracking.close()
        problems += tracking.take_problems()
    return problems


# -- the JobSpec's section ------------------------------------------------------------------------


def test_tensorboard_is_on_by_default_and_each_type_is_a_registered_tracker() -> None:
    assert [t.type for t in JobSpec().tracking.trackers] == ["tensorboard"]
    union = typing.get_args(typing.get_args(TrackerConfig)[0])
    types = {typing.get_args(model.model_fields["type"].annotation)[0] for model in union}
    assert types == set(TRACKERS.names()) == {"tensorboard", "wandb", "mlflow"}


@pytest.mark.parametrize(
    ("trackers", "field", "message"),
    [
        ([{"type": "comet"}], "tracking.trackers.0", "does not match any of the expected tags"),
        ([{"type": "tensorboard"}, {"type": "tensorboard"}], "tracking.trackers", "tensorboard twice"),
        ([{"type": "tensorboard", "flush_s": 0}], "tracking.trackers.0.tensorboard.flush_s", "greater"),
        ([{"type": "wandb", "project": "a/b"}], "tracking.trackers.0.wandb.project", "pattern"),
        ([{"type": "mlflow", "experiment": ""}], "tracking.trackers.0.mlflow.experiment", "pattern"),
        ([{"type": "mlflow", "uri": "x"}], "tracking.trackers.0.mlflow.uri", "Extra inputs"),
    ],
)
def test_a_bad_tracker_names_its_field(trackers: list[dict[str, object]], field: str, message: str) -> None:
    with pytest.raises(JobSpecError) as raised:
        parse_job_spec({"tracking": {"trackers": trackers}})
    assert message in dict(raised.value.errors).get(field, ""), raised.value.errors


def test_a_tracker_whose_package_is_missing_is_a_problem_naming_its_field(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tracking = parse_job_spec(
        {"tracking": {"trackers": [{"type": "tensorboard"}, {"type": "wandb"}]}}
    ).tracking
    assert tracker_problems(tracking) == []  # both installed here
    monkeypatch.setattr(WandbTracker, "package", "verst_no_such_package")
    ((field, message),) = tracker_problems(tracking)
    assert field == ("tracking", "trackers", "1", "type")
    assert "wandb is chosen but its package 'verst_no_such_package' is not installed" in message
    assert "pip install 'verst[wandb]'" in message


# -- TensorBoard ----------------------------------------------------------------------------------


def accumulated(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """(step, value) per tag, as TensorBoard itself reads the event files (in step order: each
    reopened writer adds a file)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: sorted((e.step, e.value) for e in acc.Scalars(tag)) for tag in acc.Tags()["scalars"]}


def expected(steps: range) -> dict[str, list[tuple[int, float]]]:
    """What ``rows(steps)`` holds, as float32 (TensorBoard's scalars)."""
    return {
        f"trainer/{name}": [(r.step, float(np.float32(r.values[name]))) for r in rows(steps)]
        for name in ("reward_mean", "loss")
    }


def test_tensorboard_scalars_read_back_exactly_in_the_checkpoint_directory(tmp_path: Path) -> None:
    spec = spec_with(tmp_path, {"type": "tensorboard"})
    assert tracked(spec, tmp_path, rows(range(1, 6))) == []
    directory = tmp_path / "runs" / JOB / TENSORBOARD_DIR
    assert accumulated(directory) == expected(range(1, 6))
    ours = sorted((tag, step, value) for tag, step, value, _ in scalar_events(directory))
    assert ours == sorted((tag, s, v) for tag, points in expected(range(1, 6)).items() for s, v in points)
    assert {wall for *_, wall in scalar_events(directory)} == {1000.0 + s for s in range(1, 6)}


def test_tensorboard_writes_a_row_as_one_event(tmp_path: Path) -> None:
    """A row's scalars share one event (a record, two checksums and a trip through tensorboardX's
    queue each), which TensorBoard reads as the same scalars (above)."""
    from tensorboardX.proto.event_pb2 import Event

    from services.controller.trackers import event_records

    spec = spec_with(tmp_path, {"type": "tensorboard"})
    assert tracked(spec, tmp_path, rows(range(1, 4))) == []
    files = list((tmp_path / "runs" / JOB / TENSORBOARD_DIR).glob("events.out.tfevents.*"))
    events = [Event.FromString(record) for path in files for record in event_records(path)]
    summaries = [event for event in events if event.HasField("summary")]
    assert [(e.step, len(e.summary.value)) for e in summaries] == [(1, 2), (2, 2), (3, 2)]


def test_tensorboard_records_are_checksummed_in_c() -> None:
    """tensorboardX checksums each record with the ``crc32c`` package when it is installed (a
    dependency), else in Python (~47 us a 200-byte record, two checksums a scalar). The event
    files read back above whichever it is."""
    import tensorboardX.crc32c

    assert tensorboardX.crc32c._crc32c_native is not None


def test_a_restart_replaying_the_history_duplicates_no_step(tmp_path: Path) -> None:
    spec = spec_with(tmp_path, {"type": "tensorboard"})
    assert tracked(spec, tmp_path, rows(range(1, 4)), rows(range(1, 7))) == []
    directory = tmp_path / "runs" / JOB / TENSORBOARD_DIR
    assert len(list(directory.glob("events.out.tfevents.*"))) == 2
    assert accumulated(directory) == expected(range(1, 7))


def test_non_finite_values_are_skipped_with_one_warning_per_tag(tmp_path: Path) -> None:
    spec = spec_with(tmp_path, {"type": "tensorboard"})
    bad = [MetricRow(s, s, "trainer", {"kl": math.nan, "reward_mean": 0.5}, 1.0) for s in (1, 2)]
    bad.append(MetricRow(3, 3, "trainer", {"kl": math.inf}, 1.0))
    problems = tracked(spec, tmp_path, bad)
    assert problems == ["tracking skips trainer/kl: nan at step 1 is not finite"]
    assert accumulated(tmp_path / "runs" / JOB / TENSORBOARD_DIR) == {
        "trainer/reward_mean": [(1, 0.5), (2, 0.5)]
    }


def test_an_unseen_checkpoint_directory_falls_back_to_the_tracking_directory(tmp_path: Path) -> None:
    spec = JobSpec.model_validate({"trainer": {"checkpoint_dir": str(tmp_path / "elsewhere")}})
    assert tracked(spec, tmp_path, rows(range(1, 3))) == []
    assert accumulated(tmp_path / "fallback" / JOB / TENSORBOARD_DIR) == expected(range(1, 3))
    assert not (tmp_path / "elsewhere").exists()


def test_a_failing_tracker_is_dropped_with_a_warning_and_the_rest_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: its import fails
    spec = spec_with(tmp_path, {"type": "wandb"}, {"type": "tensorboard"})
    (problem,) = tracked(spec, tmp_path, rows(range(1, 3)))
    assert problem.startswith("tracker wandb not started: ModuleNotFoundError")
    assert accumulated(tmp_path / "runs" / JOB / TENSORBOARD_DIR) == expected(range(1, 3))

    broken = TRACKERS.get("tensorboard").fn
    monkeypatch.setattr(broken, "write", lambda *_: (_ for _ in ()).throw(OSError("disk full")))
    (problem,) = tracked(spec_with(tmp_path, {"type": "tensorboard"}), tmp_path, rows(range(1, 2)))
    assert problem == "tracker tensorboard stopped: cannot write step 1: disk full"


# -- W&B, offline ---------------------------------------------------------------------------------


def wandb_history(root: Path) -> list[dict[str, float]]:
    """The logged rows of every offline run under ``root``: W&B's run file is a LevelDB-style log
    (a 7-byte header, then records in 32 KiB blocks, each a 7-byte header and a piece)."""
    from wandb.proto import wandb_internal_pb2

    logged = []
    for path in sorted(root.glob("wandb/offline-run-*/run-*.wandb")):
        data, pos, record = path.read_bytes(), 7, b""
        assert data[:4] == b":W&B"
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
                pos += 32768 - pos % 32768
                continue
            _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
            record, pos = record + data[pos + 7 : pos + 7 + length], pos + 7 + length
            if kind in (1, 4):  # a whole record, or its last piece
                message = wandb_internal_pb2.Record.FromString(record)
                if message.WhichOneof("record_type") == "history":
                    items = {
                        i.key or "/".join(i.nested_key): json.loads(i.value_json)  # a/b is nested
                        for i in message.history.item
                    }
                    logged.append({k: v for k, v in items.items() if not k.startswith("_")})
                record = b""
    return logged


@pytest.fixture
def offline_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))


@pytest.mark.usefixtures("offline_wandb")
def test_wandb_offline_rows_read_back_and_a_restart_duplicates_none(tmp_path: Path) -> None:
    spec = spec_with(tmp_path, {"type": "wandb", "project": "tests"})
    assert tracked(spec, tmp_path, rows(range(1, 3)), rows(range(1, 4))) == []
    logged = wandb_history(tmp_path / "runs" / JOB)
    assert logged == [
        {"trainer/reward_mean": r.values["reward_mean"], "trainer/loss": r.values["loss"], "step": r.step}
        for r in rows(range(1, 4))
    ]


# -- MLflow, a local file store -------------------------------------------------------------------


def test_mlflow_file_store_rows_read_back_and_a_restart_duplicates_none(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    spec = spec_with(tmp_path, {"type": "mlflow", "experiment": "tests"})
    evals = [MetricRow(s, s, "eval", {"pass@4": 0.25 * s}, 1000.0 + s) for s in (1, 2)]
    assert tracked(spec, tmp_path, rows(range(1, 3)) + evals[:1], rows(range(1, 4)) + evals) == []
    client = MlflowClient(tracking_uri=(tmp_path / "runs" / JOB / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags["verst.job_id"] == JOB

    def history(key: str) -> list[tuple[int, float, int]]:
        return sorted((m.step, m.value, m.timestamp) for m in client.get_metric_history(run.info.run_id, key))

    assert mlflow_key("eval/pass@4") == "eval/pass_at_4"
    assert history("eval/pass_at_4") == [(1, 0.25, 1_001_000), (2, 0.5, 1_002_000)]
    assert history("trainer/loss") == [
        (r.step, r.values["loss"], int(r.time * 1000)) for r in rows(range(1, 4))
    ]
