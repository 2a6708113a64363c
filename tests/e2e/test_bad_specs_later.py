"""Bad specs that only the running job can find out: each is a 422 at submission or fails its job
within 60 s with a reason that names the problem, on the whole stack (real processes, real
Redis), one after the other on one trainer. None spins: the next case's job gets the trainer."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from services.stack import Stack, StackConfig

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
FAIL_WITHIN_S = 60.0
TERMINAL = {"JOB_STATE_SUCCEEDED", "JOB_STATE_FAILED", "JOB_STATE_CANCELLED"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    from services.models import resolve_model_path

    resolve_model_path("builtin:addition")
    logs = tmp_path_factory.mktemp("bad-spec-logs")
    config = StackConfig(log_dir=logs, api_port=0, router_port=0, engine_port=0, reward_port=0,
                         trainer_port=0, runner_port=0, engine_metrics_port=0)  # fmt: skip
    with Stack(config) as running:
        yield running


def base_spec(tmp_path: Path) -> dict[str, Any]:
    spec = yaml.safe_load((ROOT / "examples" / "addition.yaml").read_text())
    spec["trainer"] |= {"steps": 4, "checkpoint_dir": str(tmp_path / "runs")}
    spec["eval"] |= {"every_steps": 4, "num_prompts": 20}
    return spec


def broken_weights(tmp_path: Path) -> dict[str, Any]:
    """A model directory whose config reads but whose weights file is garbage."""
    from services.models import resolve_model_path

    model = tmp_path / "broken-model"
    shutil.copytree(resolve_model_path("builtin:addition"), model)
    for weights in model.glob("*.safetensors"):
        weights.write_bytes(b"not a safetensors file" * 100)
    return {"model": {"path": str(model)}}


def checkpoint_dir_is_a_file(tmp_path: Path) -> dict[str, Any]:
    taken = tmp_path / "a-file"
    taken.write_text("not a directory")
    return {"trainer": {"checkpoint_dir": str(taken)}}


def deepspeed_rejects(tmp_path: Path) -> dict[str, Any]:
    return {"trainer": {"deepspeed": {"zero_optimization": {"stage": 7}}}}


def plugin_always_raises(tmp_path: Path) -> dict[str, Any]:
    return {"reward": {"plugin": "tests.e2e.failing_reward:score"}}


CASES: list[tuple[str, Callable[[Path], dict[str, Any]], str]] = [
    ("weights that do not load", broken_weights, "cannot load the model from"),
    ("checkpoint_dir is a file", checkpoint_dir_is_a_file, "a-file"),
    ("deepspeed rejects the config", deepspeed_rejects, "stage"),
    ("a reward plugin that always raises", plugin_always_raises, "the reward plugin always fails"),
]


def merged(spec: dict[str, Any], change: dict[str, Any]) -> dict[str, Any]:
    for section, values in change.items():
        spec[section] = {**spec.get(section, {}), **values}
    return spec


@pytest.mark.parametrize(("case", "change", "reason"), CASES, ids=[c[0] for c in CASES])
def test_a_spec_that_fails_later_fails_fast_and_clearly(
    stack: Stack, tmp_path: Path, case: str, change: Callable[[Path], dict[str, Any]], reason: str
) -> None:
    spec = merged(base_spec(tmp_path), change(tmp_path))
    spec["name"] = case.replace(" ", "-")
    reply = httpx.post(f"{stack.api_url}/v1/jobs", json=spec, timeout=30)
    if reply.status_code == 422:  # found out at submission: as good, if it says why
        assert reason in reply.text, reply.text
        return
    assert reply.status_code == 201, reply.text
    job_id = reply.json()["job_id"]
    submitted = time.monotonic()
    while time.monotonic() - submitted < FAIL_WITHIN_S:
        stack.check_alive()
        job = httpx.get(f"{stack.api_url}/v1/jobs/{job_id}", timeout=10).json()
        if job["state"] in TERMINAL:
            break
        time.sleep(0.5)
    else:
        httpx.post(f"{stack.api_url}/v1/jobs/{job_id}/cancel", timeout=10)
        pytest.fail(f"{case}: still {job['state']} after {FAIL_WITHIN_S}s")
    assert job["state"] == "JOB_STATE_FAILED", job
    assert reason in job["reason"], job["reason"]
