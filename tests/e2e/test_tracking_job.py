"""A short real job of the whole stack leaves TensorBoard event files in its checkpoint directory
holding the trainer's reward and the evaluation's accuracy of every step, as the job's history."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

from services.common.tracking_config import TENSORBOARD_DIR
from services.demo import job_history, series
from services.stack import Stack, StackConfig
from tests.e2e.test_grpo_learns import wait_for_end

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]


def scalars(directory: Path, tag: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``tag`` as TensorBoard itself reads the event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    acc.Reload()
    events = sorted((e.step, e.value) for e in acc.Scalars(tag))
    return [step for step, _ in events], [value for _, value in events]


def test_a_job_leaves_tensorboard_event_files_with_its_metrics(tmp_path: Path) -> None:
    from services.models import resolve_model_path

    resolve_model_path("builtin:addition")  # built once and cached, outside the job's clock
    runs = tmp_path / "runs"
    spec = yaml.safe_load((ROOT / "examples" / "addition.yaml").read_text())
    spec["name"] = "e2e-tracking"
    spec["trainer"] |= {"steps": 3, "checkpoint_dir": str(runs)}
    spec["eval"] = {"every_steps": 0, "at_start": True, "num_prompts": 32}
    config = StackConfig(log_dir=tmp_path / "logs", api_port=0, router_port=0, engine_port=0,
                         reward_port=0, trainer_port=0, runner_port=0, engine_metrics_port=0)  # fmt: skip
    with Stack(config) as stack:
        response = httpx.post(f"{stack.api_url}/v1/jobs", json=spec, timeout=30)
        assert response.status_code == 201, response.text
        job_id = response.json()["job_id"]
        job = wait_for_end(stack.api_url, job_id, stack)
        history = job_history(stack.api_url, job_id)
    assert job["state"] == "JOB_STATE_SUCCEEDED", job

    directory = runs / job_id / TENSORBOARD_DIR  # the api's controller sees the checkpoint directory
    for source, name, steps in (("trainer", "reward_mean", [1, 2, 3]), ("eval", "accuracy", [0, 3])):
        recorded, values = series(history, source, name)
        assert recorded == steps, (source, name, recorded)
        assert scalars(directory, f"{source}/{name}") == (steps, [float(np.float32(v)) for v in values])
