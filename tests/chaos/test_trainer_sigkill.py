"""Exactly-once training under chaos: one job, its trainer process SIGKILLed at ten random
moments (seeded) and restarted each time, while a producer feeds it groups. The job succeeds,
every produced trajectory is trained exactly once into the surviving lineage's weights (the
manifests of its chain of durable checkpoints), and nothing is left unacked."""

from __future__ import annotations

import asyncio
import contextlib
import random
import subprocess
import time
from pathlib import Path

import pytest

from services.common.bus import Bus
from services.common.pb import common_pb2
from services.common.streams import JOBS, JobStreams
from services.trainer.checkpoints import CheckpointStore
from services.trainer.job import JOB_GROUP, TRAJECTORY_GROUP
from tests.helpers import eventually, lineage_trained_ids, stream_messages
from tests.integration.rollout_helpers import tiny_llama
from tests.integration.test_trainer_resume import TOKENIZER, group, start_trainer, submit, trainer_env

pytestmark = pytest.mark.slow

KILLS = 10
STEPS = 30
PROMPTS_PER_STEP = 2
AHEAD_STEPS = 3
"""The producer keeps this many steps of groups beyond the newest published version."""
STEPS_PER_KILL = STEPS // (KILLS + 1)
"""Until the last kill the producer feeds at most this many more steps per kill, so the job cannot
finish before it has been killed KILLS times (on a fast machine it otherwise may)."""
SPARES = 2
"""Trainer processes started ahead, so that a restart does not wait for torch's import."""
RUN_DEADLINE_S = 240.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama(0, heads=2, max_positions=64, vocab=len(TOKENIZER)).save_pretrained(directory)
    TOKENIZER.save_pretrained(directory)
    return directory


async def newest_handle(bus: Bus, job_id: str) -> common_pb2.CheckpointHandle | None:
    return await bus.latest(JobStreams(job_id).checkpoints, common_pb2.CheckpointHandle)


async def produce(
    bus: Bus, job_id: str, store: CheckpointStore, produced: list[str], gate: dict[str, int]
) -> None:
    """Publish groups a few steps ahead of the newest version, their tokens labelled with the
    newest durable checkpoint's version (never ahead of any trainer that may resume)."""
    total = STEPS * PROMPTS_PER_STEP
    while len(produced) < total:
        handle = await newest_handle(bus, job_id)
        ahead = (handle.version if handle else 0) + AHEAD_STEPS
        allowed = min(total, ahead * PROMPTS_PER_STEP, gate["steps"] * PROMPTS_PER_STEP)
        while len(produced) < allowed:
            durable = await asyncio.to_thread(store.latest)
            version = int(durable.handle.version) if durable is not None else 0
            group_id = f"g{len(produced)}"
            await bus.publish_many(JobStreams(job_id).trajectories, group(job_id, group_id, version))
            produced.append(group_id)
        await asyncio.sleep(0.05)


async def holder(bus: Bus, job_id: str, trainers: list[subprocess.Popen[str]]) -> subprocess.Popen[str]:
    """The trainer process that holds the job (trainers are named ``trainer-<host>-<pid>``)."""

    async def find() -> subprocess.Popen[str] | None:
        pending = await bus.redis.xpending_range(JOBS, JOB_GROUP, min="-", max="+", count=10)
        owners = {entry["consumer"].decode() for entry in pending}
        return next((t for t in trainers if any(o.endswith(f"-{t.pid}") for o in owners)), None)

    return await eventually(find, f"the trainer holding {job_id}", timeout_s=60.0)


async def new_epoch(bus: Bus, job_id: str, after: int) -> int:
    """Wait until a trainer has begun an epoch above ``after``; its number."""

    async def begun() -> int | None:
        handle = await newest_handle(bus, job_id)
        return int(handle.epoch) if handle is not None and handle.epoch > after else None

    return await eventually(begun, f"an epoch of {job_id} above {after}", timeout_s=60.0)


async def test_a_trainer_killed_ten_times_trains_every_trajectory_exactly_once(
    bus: Bus, redis_url: str, model_dir: Path, tmp_path: Path, python: str, python_env: dict[str, str]
) -> None:
    job_id, runs = "chaos-0001", tmp_path / "runs"
    streams = JobStreams(job_id)
    rng = random.Random(1414)
    env = python_env | trainer_env(redis_url, max_deliveries=KILLS + 5)  # each kill redelivers
    store = CheckpointStore(runs, job_id, keep=1)
    produced: list[str] = []
    await submit(
        bus, job_id, model_dir, runs, steps=STEPS, prompts_per_step=PROMPTS_PER_STEP,
        checkpoint_every_steps=3, keep_checkpoints=STEPS, ppo_epochs=4,
    )  # fmt: skip
    gate = {"steps": STEPS_PER_KILL}
    producer = asyncio.create_task(produce(bus, job_id, store, produced, gate))
    started = time.monotonic()
    epoch, kills = 0, 0
    processes: list[subprocess.Popen[str]] = []
    try:
        # Spare trainers start (import torch) while one trains; whichever polls first takes the
        # job over a reclaim-idle after the kill.
        spares = [start_trainer(python, env) for _ in range(SPARES)]
        processes.extend(spares)
        while kills < KILLS:
            assert time.monotonic() - started < RUN_DEADLINE_S, f"only {kills} kills so far"
            output = ""
            epoch = await new_epoch(bus, job_id, epoch)
            trainer = await holder(bus, job_id, spares)
            spares.remove(trainer)
            if len(processes) < KILLS + 1:
                spares.append(start_trainer(python, env))
                processes.append(spares[-1])
            await asyncio.sleep(rng.uniform(0.0, 1.0))  # mid-step, mid-save, mid-ack: anywhere
            trainer.kill()
            output, _ = await asyncio.to_thread(trainer.communicate, timeout=30)
            kills += 1
            gate["steps"] = STEPS if kills == KILLS else STEPS_PER_KILL * (kills + 1)
            assert not await stream_messages(bus, streams.status, common_pb2.JobStatus), output
        survivor = await holder(bus, job_id, spares)
        try:

            async def succeeded() -> common_pb2.JobStatus | None:
                found = await stream_messages(bus, streams.status, common_pb2.JobStatus)
                return found[-1] if found else None

            status = await eventually(succeeded, "the job's end", timeout_s=RUN_DEADLINE_S)
        finally:
            survivor.terminate()
            output, _ = await asyncio.to_thread(survivor.communicate, timeout=30)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.communicate(timeout=30)
        producer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await producer
    assert (status.state, status.policy_version) == (common_pb2.JOB_STATE_SUCCEEDED, STEPS), output
    trained = lineage_trained_ids(runs / job_id)
    everything = {f"{g}:{i}" for g in produced for i in range(2)}
    assert len(trained) == len(set(trained)), "a trajectory was trained twice into the final weights"
    assert set(trained) == everything, "a trajectory was lost"
    assert await stream_messages(bus, streams.control, common_pb2.TrainerSignal) == []  # none dropped
    assert await bus.pending_count(streams.trajectories, TRAJECTORY_GROUP) == 0
    assert await bus.pending_count(JOBS, JOB_GROUP) == 0
