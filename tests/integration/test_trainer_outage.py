"""A real trainer process through Redis outages: Redis (with its append-only file) is SIGKILLed
mid-job and started again on its port. After 20 s of downtime (within VERST_REDIS_OUTAGE_S, and
past every trainer timeout it could run down) the job carries on in the same epoch where it stood
and succeeds, every trajectory trained exactly once; with a 5 s bound, a 15 s outage fails the job
with a reason that says so."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.common.bus import Bus, connect
from services.common.pb import common_pb2
from services.common.redis_server import EmbeddedRedis
from services.common.streams import JOBS, JobStreams
from services.trainer.job import JOB_GROUP, TRAJECTORY_GROUP
from tests.helpers import lineage_trained_ids
from tests.integration.test_trainer_resume import (  # noqa: F401  (model_dir: a fixture)
    TOKENIZER,
    group,
    model_dir,
    start_trainer,
    submit,
    trainer_env,
    wait_for_checkpoint,
    wait_for_status,
)

pytestmark = pytest.mark.slow

STEPS = 6
PROMPTS_PER_STEP = 2
DOWN_S = 20.0
"""Longer than every clock the trainer keeps that Redis's absence runs down: its reclaim bounds
(1 s in ``trainer_env``), the retries' 2 s backoff cap and the clients' 15 s health-check interval
(services/common/redis_client.py); well within the 120 s VERST_REDIS_OUTAGE_S. Redis is killed,
not hung, so calls fail at once and the 30 s socket timeout does not come into it."""


@dataclass
class Harness:
    """Redis with its append-only file, the test's client of it, a model, and trainer processes."""

    server: EmbeddedRedis
    bus: Bus
    model_dir: Path
    runs: Path
    python: str
    env: dict[str, str]
    output: str = ""
    """What the last trainer printed, once it has stopped."""

    @contextlib.asynccontextmanager
    async def trainer(self, **env: str) -> AsyncIterator[None]:
        process = start_trainer(self.python, self.env | trainer_env(self.server.url) | env)
        try:
            yield
        finally:
            self.output = await asyncio.to_thread(finish, process)

    async def produce(self, job_id: str, first: int, steps: int) -> list[str]:
        """Publish the groups of ``steps`` more steps, from group ``first`` on; their ids."""
        ids = [f"g{index}" for index in range(first, first + steps * PROMPTS_PER_STEP)]
        for group_id in ids:
            await self.bus.publish_many(JobStreams(job_id).trajectories, group(job_id, group_id, 0))
        return ids

    async def outage(self, seconds: float) -> float:
        """SIGKILL Redis, wait, start it again on its port with its append-only file; the downtime."""
        killed = time.monotonic()
        self.server.kill()
        await asyncio.sleep(seconds)
        await asyncio.to_thread(self.server.start)
        return time.monotonic() - killed


@pytest.fixture
async def harness(
    tmp_path: Path,
    model_dir: Path,  # noqa: F811  (the imported fixture)
    python: str,
    python_env: dict[str, str],
) -> AsyncIterator[Harness]:
    with EmbeddedRedis(tmp_path / "redis", appendfsync="always") as server:  # SIGKILLed
        bus = Bus(connect(server.url, outage_s=120.0))  # the test's own calls ride through too
        yield Harness(server, bus, model_dir, tmp_path / "runs", python, python_env)
        await bus.close()


def finish(trainer: subprocess.Popen[str]) -> str:
    trainer.terminate()
    output, _ = trainer.communicate(timeout=60)
    return output


def outage_log(output: str) -> list[str]:
    return [line for line in output.splitlines() if "services.common.outage" in line]


async def test_a_job_survives_a_long_redis_outage_with_nothing_lost(harness: Harness) -> None:
    bus, job_id, runs = harness.bus, "outage-long", harness.runs
    async with harness.trainer():
        await submit(bus, job_id, harness.model_dir, runs, steps=STEPS, checkpoint_every_steps=3)
        produced = await harness.produce(job_id, 0, 4)  # the trainer has steps 3 and 4 to do when...
        before = await wait_for_checkpoint(bus, job_id, 2)
        down_s = await harness.outage(DOWN_S)  # ...Redis goes away
        produced += await harness.produce(job_id, len(produced), STEPS - 4)
        status = await wait_for_status(bus, job_id)
        after = await bus.latest(JobStreams(job_id).checkpoints, common_pb2.CheckpointHandle)
    assert down_s >= DOWN_S
    assert (status.state, status.policy_version) == (common_pb2.JOB_STATE_SUCCEEDED, STEPS), harness.output
    assert after is not None and after.epoch == before.epoch, "the same epoch went on: not resumed"
    trained = lineage_trained_ids(runs / job_id)
    assert sorted(trained) == sorted(f"{g}:{i}" for g in produced for i in range(2)), "lost or twice"
    assert await bus.pending_count(JobStreams(job_id).trajectories, TRAJECTORY_GROUP) == 0
    assert await bus.pending_count(JOBS, JOB_GROUP) == 0
    lines = outage_log(harness.output)
    assert len(lines) == 2 and "WARNING" in lines[0] and "answers again" in lines[1], lines


async def test_an_outage_beyond_the_bound_fails_the_job_saying_so(harness: Harness) -> None:
    bus, job_id = harness.bus, "outage-15"
    async with harness.trainer(VERST_REDIS_OUTAGE_S="5"):
        await submit(bus, job_id, harness.model_dir, harness.runs, steps=STEPS, checkpoint_every_steps=3)
        await harness.produce(job_id, 0, 2)
        await wait_for_checkpoint(bus, job_id, 2)  # then it waits for data, reading from Redis
        await harness.outage(15.0)
        status = await wait_for_status(bus, job_id)
    assert status.state == common_pb2.JOB_STATE_FAILED, harness.output
    assert "Redis unreachable for more than 5 s" in status.reason, status.reason
    assert await bus.pending_count(JOBS, JOB_GROUP) == 0  # the job is over, not left for a retry
