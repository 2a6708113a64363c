"""A user's plug-in at every plug-in point of the loop, in one real job of the whole stack.

The job reads its prompts through a user's data source (examples.plugins.data_source:tsv_rows),
samples them with a user's rollout strategy (retry_with_hint), shapes the verifier's rewards with
a user's function (format_bonus) and filters groups with a user's filter (spread_at_least). The
stack runs the controller as its own process (`python -m services.controller`). Each plug-in
leaves its mark where a user would look: the prompts' ids, the trajectories' provenance and
rewards, the trainer's per-filter counts, and the job succeeds.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import yaml

from services.common.bus import DATA_FIELD
from services.common.pb import common_pb2
from services.common.streams import JobStreams
from services.demo import job_history
from services.stack import Stack, StackConfig
from services.tasks import get_task
from tests.e2e.test_grpo_learns import published_trajectories, wait_for_end

ROOT = Path(__file__).resolve().parents[2]
FILTER = "examples.plugins.group_filter:spread_at_least"
STRATEGY = "examples.plugins.rollout_strategy:retry_with_hint"

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]


def write_tsv(path: Path, rows: list[tuple[str, str]]) -> Path:
    path.write_text("question\tsolution\n" + "".join(f"{q}\t{a}\n" for q, a in rows))
    return path


def plugin_job(tmp_path: Path) -> dict[str, Any]:
    """The demo's job for 6 steps, every plug-in point given a user's function."""
    task = get_task("addition")
    train = [(e.text, e.answer) for e in itertools.islice(task.train(7), 3000)]
    held_out = [(e.text, e.answer) for e in task.eval()[:64]]
    spec = yaml.safe_load((ROOT / "examples" / "addition.yaml").read_text())
    spec["name"] = "e2e-plugins"
    spec["data"] = {
        "source": "examples.plugins.data_source:tsv_rows",
        "train": str(write_tsv(tmp_path / "train.tsv", train)),
        "eval": str(write_tsv(tmp_path / "eval.tsv", held_out)),
        "prompt_field": "question",
        "answer_field": "solution",
    }
    spec["rollout"] |= {"strategy": STRATEGY, "max_turns": 2, "max_new_tokens": 16}
    spec["reward"] = {
        "verifier": "addition",
        "shaping": [{"type": "examples.plugins.reward_shaping:format_bonus", "bonus": 0.1}],
    }
    spec["algorithm"]["filters"] = [{"type": FILTER, "min_spread": 0.5}]
    spec["trainer"] |= {"steps": 6, "checkpoint_dir": str(tmp_path / "runs")}
    spec["eval"] = {"every_steps": 3, "num_prompts": 64}
    return spec


def issued_source_ids(redis_url: str, job_id: str) -> list[str]:
    """The data source's own id of each issued prompt (the feed keeps it in the task's metadata)."""
    client = redis.Redis.from_url(redis_url)
    try:
        entries = client.xrange(JobStreams(job_id).prompts)
    finally:
        client.close()
    tasks = [common_pb2.PromptTask.FromString(fields[DATA_FIELD]) for _, fields in entries]
    return [task.metadata["source_prompt_id"] for task in tasks]


def test_a_job_runs_a_users_plugin_at_every_plugin_point(tmp_path: Path) -> None:
    from services.models import resolve_model_path

    resolve_model_path("builtin:addition")  # built once and cached, outside the job's clock
    config = StackConfig(log_dir=tmp_path / "logs", api_port=0, router_port=0, engine_port=0,
                         reward_port=0, trainer_port=0, runner_port=0, engine_metrics_port=0,
                         separate_controller=True, controller_port=0, controller_metrics_port=0,
                         extra_env={"VERST_CONTROLLER_HOUSEKEEPING_S": "0"})  # fmt: skip
    with Stack(config) as stack:
        assert "controller" in [child.name for child in stack.children]
        response = httpx.post(f"{stack.api_url}/v1/jobs", json=plugin_job(tmp_path), timeout=30)
        assert response.status_code == 201, response.text
        job_id = response.json()["job_id"]
        started = time.monotonic()
        job = wait_for_end(stack.api_url, job_id, stack)
        history = job_history(stack.api_url, job_id)
        trajectories = published_trajectories(stack.redis_url, job_id)
        prompt_ids = issued_source_ids(stack.redis_url, job_id)
        peaks = stack.peak_memory()
        names = {child.name for child in stack.children}
    assert set(peaks) == names and min(peaks.values()) > 10 * 2**20
    assert job["state"] == "JOB_STATE_SUCCEEDED", (job, time.monotonic() - started)
    assert job["policy_version"] == 6

    # data source: every prompt came from the user's TSV file, by its own ids
    assert prompt_ids and all(pid.startswith("train.tsv:") for pid in prompt_ids), prompt_ids[:5]
    evaluations = [row for row in history if row["source"] == "eval"]
    assert evaluations and all("accuracy" in row["values"] for row in evaluations)

    # rollout strategy: every trajectory says the user's strategy made it
    assert trajectories
    assert {t.metadata["rollout_strategy"] for t in trajectories} == {STRATEGY}

    # reward shaping: bare-integer answers got the bonus on top of the verifier's reward
    shaped = [t for t in trajectories if abs(t.reward - t.verifier_reward - 0.1) < 1e-9]
    assert shaped, [(t.reward, t.verifier_reward) for t in trajectories[:8]]
    assert all(t.reward in (t.verifier_reward, t.verifier_reward + 0.1) for t in trajectories)

    # group filter: counted under its name at every step, and it dropped some groups
    trainer_rows = [row for row in history if row["source"] == "trainer"]
    counts = [row["values"].get(f"groups_filtered/{FILTER}") for row in trainer_rows]
    assert counts and None not in counts, trainer_rows[:1]
    assert sum(counts) > 0, counts
