"""The whole stack as real processes on a real Redis: a short GRPO job makes the model learn."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import yaml

from services.common.bus import DATA_FIELD
from services.common.pb import common_pb2
from services.common.streams import JobStreams
from services.demo import job_history, series
from services.stack import Stack, StackConfig

ROOT = Path(__file__).resolve().parents[2]
JOB_TIMEOUT_S = 900.0

# The first run builds the base model (about a minute on 2 idle cores, several under load).
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]


def short_job(checkpoint_dir: Path) -> dict[str, Any]:
    spec = yaml.safe_load((ROOT / "examples" / "addition.yaml").read_text())
    spec["name"] = "e2e-grpo"
    spec["trainer"] |= {
        "steps": 8,
        "checkpoint_dir": str(checkpoint_dir),
        "keep_checkpoints": 100,
        "checkpoint_every_steps": 4,
    }
    spec["eval"] |= {"every_steps": 4, "num_prompts": 100}
    return spec


def wait_for_end(api: str, job_id: str, stack: Stack) -> dict[str, Any]:
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while time.monotonic() < deadline:
        stack.check_alive()
        job = httpx.get(f"{api}/v1/jobs/{job_id}", timeout=10).json()
        if job["state"] in {"JOB_STATE_SUCCEEDED", "JOB_STATE_FAILED", "JOB_STATE_CANCELLED"}:
            return job
        time.sleep(1.0)
    pytest.fail(f"job {job_id} did not end within {JOB_TIMEOUT_S}s")


def published_trajectories(redis_url: str, job_id: str) -> list[common_pb2.Trajectory]:
    client = redis.Redis.from_url(redis_url)
    try:
        entries = client.xrange(JobStreams(job_id).trajectories)
    finally:
        client.close()
    return [common_pb2.Trajectory.FromString(fields[DATA_FIELD]) for _, fields in entries]


def trained_ids(checkpoint_dir: Path, job_id: str) -> list[list[str]]:
    """Per durable checkpoint, oldest first: the trajectory ids its manifest says it trained."""
    paths = sorted((checkpoint_dir / job_id).glob("v*/consumed.json"))
    return [json.loads(path.read_text())["ids"] for path in paths]


def weight_loads(metrics_url: str) -> dict[str, float]:
    """engine-0's weight loads by transport, from its /metrics."""
    loads: dict[str, float] = {}
    for line in httpx.get(metrics_url, timeout=10).text.splitlines():
        if line.startswith("verst_engine_weight_transport_loads_total{"):
            labels, _, value = line.partition("} ")
            loads[labels.partition('transport="')[2].rstrip('"')] = float(value)
    return loads


@pytest.mark.parametrize("transport", ["filesystem", "distributed"])
def test_grpo_job_learns_end_to_end(tmp_path: Path, transport: str) -> None:
    from services.models import resolve_model_path

    resolve_model_path("builtin:addition")  # built once and cached, outside the job's clock
    checkpoints = tmp_path / "runs"
    # Housekeeping off: the test reads every published trajectory after the job.
    config = StackConfig(log_dir=tmp_path / "logs", api_port=0, router_port=0, engine_port=0,
                         reward_port=0, trainer_port=0, runner_port=0, engine_metrics_port=0,
                         extra_env={"VERST_TRAINER_WEIGHT_TRANSPORT": transport,
                                    "VERST_CONTROLLER_HOUSEKEEPING_S": "0"})  # fmt: skip
    with Stack(config) as stack:
        response = httpx.post(f"{stack.api_url}/v1/jobs", json=short_job(checkpoints), timeout=30)
        assert response.status_code == 201, response.text
        job_id = response.json()["job_id"]
        job = wait_for_end(stack.api_url, job_id, stack)
        history = job_history(stack.api_url, job_id)
        trajectories = published_trajectories(stack.redis_url, job_id)
        loads = weight_loads(f"http://{config.host}:{stack.config.engine_metrics_port}/metrics")

    assert job["state"] == "JOB_STATE_SUCCEEDED", job
    # v0 is a new model (files); a distributed deployment broadcasts the versions after it.
    assert loads.get("filesystem", 0) >= 1, loads
    if transport == "distributed":
        assert loads.get("distributed", 0) >= 4, loads
    else:
        assert loads.get("distributed", 0) == 0, loads
    assert job["policy_version"] == 8

    # Engines served more than one policy version during the job.
    versions = Counter(v for t in trajectories for v in t.policy_versions)
    assert len(versions) > 1, versions

    # Nothing was trained twice: each durable checkpoint (v4, v8) records four full batches of
    # ids, none in both, and everything trained was really published.
    per_checkpoint = trained_ids(checkpoints, job_id)
    batch = 16 * 8  # prompts_per_step x group_size
    assert [len(ids) for ids in per_checkpoint] == [4 * batch, 4 * batch]
    every = [i for ids in per_checkpoint for i in ids]
    assert len(every) == len(set(every)) and set(every) <= {t.id for t in trajectories}

    # Learning, not just motion: held-out greedy accuracy rose by at least 0.2.
    steps, accuracy = series(history, "eval", "accuracy")
    assert steps[0] == 0 and steps[-1] == 8, steps
    assert accuracy[-1] >= accuracy[0] + 0.2, list(zip(steps, accuracy, strict=True))
