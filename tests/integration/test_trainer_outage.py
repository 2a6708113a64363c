"""A real trainer process through Redis outages: Redis (with its append-only file) is SIGKILLed
mid-job and started again on its port. After 60 s of downtime (within VERST_REDIS_OUTAGE_S) the
job carries on in the same epoch where it stood and succeeds, every trajectory trained exactly
once; with a 5 s bound, a 15 s outage fails the job with a reason that says so."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from services.common.bus import Bus, connect
from services.common.pb import common_pb2
from services.common.redis_server import EmbeddedRedis
from services.common.streams import JOBS, JobStreams
from services.trainer.job import JOB_GROUP, TRAJECTORY_GROUP
from tests.helpers import eventually, lineage_trained_ids, stream_messages
from tests.integration.rollout_helpers import tiny_llama
from tests.integration.test_trainer_resume import TOKENIZER, group, start_trainer, submit, trainer_env

pytestmark = pytest.mark.slow

STEPS = 6
PROMPTS_PER_STEP = 2
DEADLINE_S = 90.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama(0, heads=2, max_positions=64, vocab=len(TOKENIZER)).save_pretrained(directory)
    TOKENIZER.save_pretrained(directory)
    return directory


@pytest.fixture
def server(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis(tmp_path / "redis") as started:
        yield started


@pytest.fixture
async def outage_bus(server: EmbeddedRedis) -> AsyncIterator[Bus]:
    bus = Bus(connect(server.url, outage_s=120.0))  # the test's own calls ride through too
    yield bus
    await bus.close()


async def produce(bus: Bus, job_id: str, first: int, steps: int) -> list[str]:
    """Publish the groups of ``steps`` more steps, from group ``first`` on; their ids."""
    ids = [f"g{index}" for index in range(first, first + steps * PROMPTS_PER_STEP)]
    for group_id in ids:
        await bus.publish_many(JobStreams(job_id).trajectories, group(job_id, group_id, 0))
    return ids


async def newest_handle(bus: Bus, job_id: str, version: int) -> common_pb2.CheckpointHandle:
    async def reached() -> common_pb2.CheckpointHandle | None:
        handle = await bus.latest(JobStreams(job_id).checkpoints, common_pb2.CheckpointHandle)
        return handle if handle is not None and handle.version >= version else None

    return await eventually(reached, f"checkpoint v{version}", timeout_s=DEADLINE_S)


async def job_status(bus: Bus, job_id: str) -> common_pb2.JobStatus:
    async def reported() -> common_pb2.JobStatus | None:
        found = await stream_messages(bus, JobStreams(job_id).status, common_pb2.JobStatus)
        return found[-1] if found else None

    return await eventually(reported, f"the end of {job_id}", timeout_s=DEADLINE_S)


async def outage(server: EmbeddedRedis, seconds: float) -> float:
    """SIGKILL Redis, wait, start it again on its port with its append-only file; the downtime."""
    killed = time.monotonic()
    server.kill()
    await asyncio.sleep(seconds)
    await asyncio.to_thread(server.start)
    return time.monotonic() - killed


def finish(trainer: subprocess.Popen[str]) -> str:
    trainer.terminate()
    output, _ = trainer.communicate(timeout=60)
    return output


def outage_log(output: str) -> list[str]:
    return [line for line in output.splitlines() if "services.common.outage" in line]


async def test_a_job_survives_a_60_s_redis_outage_with_nothing_lost(
    server: EmbeddedRedis,
    outage_bus: Bus,
    model_dir: Path,
    tmp_path: Path,
    python: str,
    python_env: dict[str, str],
) -> None:
    bus, job_id, runs = outage_bus, "outage-60", tmp_path / "runs"
    trainer = start_trainer(python, python_env | trainer_env(server.url))
    try:
        await submit(bus, job_id, model_dir, runs, steps=STEPS, checkpoint_every_steps=3, keep_checkpoints=10)
        produced = await produce(bus, job_id, 0, 4)  # the trainer has steps 3 and 4 to do when...
        before = await newest_handle(bus, job_id, 2)
        down_s = await outage(server, 60.0)  # ...Redis goes away
        produced += await produce(bus, job_id, len(produced), STEPS - 4)
        status = await job_status(bus, job_id)
        after = await bus.latest(JobStreams(job_id).checkpoints, common_pb2.CheckpointHandle)
    finally:
        output = await asyncio.to_thread(finish, trainer)
    assert down_s >= 60.0
    assert (status.state, status.policy_version) == (common_pb2.JOB_STATE_SUCCEEDED, STEPS), output
    assert after is not None and after.epoch == before.epoch, "the same epoch went on: not resumed"
    trained = lineage_trained_ids(runs / job_id)
    assert sorted(trained) == sorted(f"{g}:{i}" for g in produced for i in range(2)), "lost or twice"
    assert await bus.pending_count(JobStreams(job_id).trajectories, TRAJECTORY_GROUP) == 0
    assert await bus.pending_count(JOBS, JOB_GROUP) == 0
    lines = outage_log(output)
    assert len(lines) == 2 and "WARNING" in lines[0] and "answers again" in lines[1], lines


async def test_an_outage_beyond_the_bound_fails_the_job_saying_so(
    server: EmbeddedRedis,
    outage_bus: Bus,
    model_dir: Path,
    tmp_path: Path,
    python: str,
    python_env: dict[str, str],
) -> None:
    bus, job_id = outage_bus, "outage-15"
    env = python_env | trainer_env(server.url) | {"VERST_REDIS_OUTAGE_S": "5"}
    trainer = start_trainer(python, env)
    try:
        await submit(bus, job_id, model_dir, tmp_path / "runs", steps=STEPS, checkpoint_every_steps=3)
        await produce(bus, job_id, 0, 2)
        await newest_handle(bus, job_id, 2)  # then it waits for data, reading from Redis
        await outage(server, 15.0)
        status = await job_status(bus, job_id)
    finally:
        output = await asyncio.to_thread(finish, trainer)
    assert status.state == common_pb2.JOB_STATE_FAILED, output
    assert "Redis unreachable for more than 5 s" in status.reason, status.reason
    assert await bus.pending_count(JOBS, JOB_GROUP) == 0  # the job is over, not left for a retry
