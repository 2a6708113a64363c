"""Many jobs at once on one stack: 32 tiny jobs submitted together to a stack of 16 trainers all
succeed, at most 16 train at a time (each trainer holds one), the trainers take them in the order
they were submitted (first come, first served) and no Redis connection pool runs dry on the way.

"Training" is a trainer holding the job's submission on ``verst:jobs`` (claimed, not yet acked:
the trainer acks when the job ends for it), watched with XPENDING every ``POLL_S``. The job
record's RUNNING state is not that: it begins when the controller sees v0 and lasts through the
controller's final evaluation, after the trainer has taken the next job, so more than 16 jobs
may be RUNNING in the store at once (20 were, in one run).

16 trainer processes (each imports torch, about 420 MiB resident idle, 7.3 GiB for the stack)
share the machine's cores, so each job is one step of the addition task with groups of two."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import yaml

from services.common.bus import DATA_FIELD
from services.common.pb import common_pb2
from services.common.streams import JOBS as JOBS_STREAM
from services.common.streams import TRAINERS_GROUP
from services.stack import Stack, StackConfig

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
TRAINERS = 16
JOBS = 32
DEADLINE_S = 420.0
POLL_S = 0.2
MOST_AT_ONCE_AT_LEAST = 12
"""Sixteen trainers hold sixteen jobs at once only if none frees up before the last of the first
wave is claimed; jobs of one step end within seconds on two cores, so a little less is allowed."""
TERMINAL = {"JOB_STATE_SUCCEEDED", "JOB_STATE_FAILED", "JOB_STATE_CANCELLED"}
POOL_ERRORS = ("Too many connections", "MaxConnectionsError", "pool exhausted", "No connection available")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    from services.models import resolve_model_path

    resolve_model_path("builtin:addition")
    logs = tmp_path_factory.mktemp("many-jobs-logs")
    names = ("api", "router", "engine", "reward", "trainer", "runner", "engine_metrics", "controller",
             "controller_metrics")  # fmt: skip
    ports = {f"{name}_port": 0 for name in names}
    with Stack(StackConfig(log_dir=logs, trainers=TRAINERS, **ports)) as running:
        yield running


def tiny_spec(index: int, runs: Path) -> dict[str, Any]:
    spec = yaml.safe_load((ROOT / "examples" / "addition.yaml").read_text())
    spec["name"] = f"many-{index:02d}"
    spec["algorithm"] |= {"group_size": 2}
    spec["rollout"] |= {"prompts_per_step": 2, "max_new_tokens": 4}
    spec["trainer"] |= {"steps": 1, "checkpoint_dir": str(runs / f"job-{index}")}
    spec["eval"] |= {"at_start": False, "every_steps": 0, "num_prompts": 2}
    return spec


class Claims:
    """Which submissions the trainers hold, polled: the most held at once, and the poll at which
    each job was first seen held."""

    def __init__(self, redis_url: str, job_ids: list[str]) -> None:
        self.redis = redis.Redis.from_url(redis_url)
        entries = self.redis.xrange(JOBS_STREAM)
        submissions = [common_pb2.JobSubmission.FromString(fields[DATA_FIELD]) for _, fields in entries]
        self.job_of = {entry_id: s.job_id for (entry_id, _), s in zip(entries, submissions, strict=True)}
        assert set(self.job_of.values()) == set(job_ids), "every job's submission is on the stream"
        self.first_seen: dict[str, int] = {}
        self.most_at_once = 0
        self.polls = 0

    def poll(self) -> None:
        held = self.redis.xpending_range(JOBS_STREAM, TRAINERS_GROUP, "-", "+", 1000)
        self.most_at_once = max(self.most_at_once, len(held))
        for row in held:
            self.first_seen.setdefault(self.job_of[row["message_id"]], self.polls)
        self.polls += 1


def test_32_jobs_on_16_trainers_run_16_at_a_time_in_order(stack: Stack, tmp_path: Path) -> None:
    started = time.monotonic()
    job_ids = []
    for index in range(JOBS):
        reply = httpx.post(f"{stack.api_url}/v1/jobs", json=tiny_spec(index, tmp_path), timeout=30)
        assert reply.status_code == 201, reply.text
        job_ids.append(reply.json()["job_id"])
    claims = Claims(stack.redis_url, job_ids)
    states: dict[str, str] = {}
    most_running = 0
    while time.monotonic() - started < DEADLINE_S:
        claims.poll()
        if claims.polls % 5 == 0:  # the job list once a second
            stack.check_alive()
            listed = httpx.get(f"{stack.api_url}/v1/jobs", params={"limit": 100}, timeout=30).json()
            states = {job["job_id"]: job["state"] for job in listed["jobs"] if job["job_id"] in job_ids}
            most_running = max(most_running, sum(state == "JOB_STATE_RUNNING" for state in states.values()))
            if len(states) == JOBS and set(states.values()) <= TERMINAL:
                break
        time.sleep(POLL_S)
    wall_s = time.monotonic() - started
    print(f"\n{JOBS} jobs on {TRAINERS} trainers: {wall_s:.0f}s from submission to the last end; at most "
          f"{claims.most_at_once} held by trainers at once, {most_running} RUNNING in the store")  # fmt: skip
    assert states and set(states.values()) == {"JOB_STATE_SUCCEEDED"}, (wall_s, states)
    assert claims.most_at_once <= TRAINERS, "a trainer held two jobs"
    assert claims.most_at_once >= MOST_AT_ONCE_AT_LEAST, f"only {claims.most_at_once} trained at once"
    assert set(claims.first_seen) == set(job_ids), "every job was seen held by a trainer"
    seen = [claims.first_seen[job_id] for job_id in job_ids]
    assert seen == sorted(seen), f"claimed out of submission order (first poll each was seen at): {seen}"
    assert seen[TRAINERS] > seen[0], "the jobs past the trainers' count waited for a free trainer"
    for child in stack.children:
        text = stack.log_tail(child.name, lines=100_000)
        assert not any(error in text for error in POOL_ERRORS), f"{child.name}: {text[-2000:]}"
