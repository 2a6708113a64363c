"""`verst tensorboard <job>` against a real api process on a real Redis: where the job's event
files are (its checkpoint directory's tensorboard/ when seen here, else the tracking directory)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from services.cli import main
from tests.integration.test_cli import ROOT, api  # noqa: F401  (fixture)


def submitted(api_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], **changes: object) -> str:
    spec = yaml.safe_load((ROOT / "examples" / "addition.yaml").read_text()) | changes
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert main(["submit", str(path), "--api", api_url]) == 0
    return capsys.readouterr().out.strip()


def test_tensorboard_prints_the_event_files_and_the_command(
    api: str,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    runs = tmp_path / "runs"
    job = submitted(api, tmp_path, capsys, trainer={"steps": 2, "checkpoint_dir": str(runs)})
    fallback = tmp_path / "tracking"
    assert main(["tensorboard", job, "--api", api, "--tracking-dir", str(fallback), "--json"]) == 0
    unseen = json.loads(capsys.readouterr().out)
    assert unseen == {
        "job_id": job,
        "logdir": str(fallback / job / "tensorboard"),
        "exists": False,
        "command": f"tensorboard --logdir {fallback / job / 'tensorboard'}",
    }, "no checkpoint directory here: the controller writes in its tracking directory"

    (runs / job / "tensorboard").mkdir(parents=True)
    assert main(["tensorboard", job, "--api", api]) == 0
    logdir = runs / job / "tensorboard"
    assert capsys.readouterr().out == f"event files  {logdir}\nopen with    tensorboard --logdir {logdir}\n"


def test_a_job_without_tensorboard_is_one_line_and_a_failure(
    api: str,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    job = submitted(api, tmp_path, capsys, tracking={"trackers": []})
    assert main(["tensorboard", job, "--api", api]) == 1
    assert (
        capsys.readouterr().err == f"verst tensorboard: job {job} has no TensorBoard tracker (chosen: none)\n"
    )
    assert main(["tensorboard", "nope-00000000", "--api", api]) == 1
    assert "nope-00000000" in capsys.readouterr().err
