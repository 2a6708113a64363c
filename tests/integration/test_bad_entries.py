"""Bad stream entries on a running job: dead-lettered, their work replaced, the job not failed for
them; and a failure that repeats fails the job quickly, with its reason, instead of spinning.

The controller and a real runner drive the job against the fake router and reward
(fake_services.py); the test plays the trainer, with test_controller.py's helpers and fixtures.
"""

# ruff: noqa: F811  (the fixtures imported below are the tests' parameters)

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from services.common.bus import DATA_FIELD, TYPE_FIELD, Bus
from services.common.jobs import FAILED, RUNNING, SUCCEEDED
from services.common.pb import common_pb2
from services.common.streams import CONTROLLER_GROUP, RUNNERS_GROUP, TRAINER_GROUP
from services.runner.server import Runner
from tests.helpers import eventually, stream_messages
from tests.integration.fake_services import trajectories
from tests.integration.test_controller import (  # noqa: F401  (fixtures)
    Controllers,
    Services,
    Trainer,
    controllers,
    services,
    submit,
)

RunnerFor = Callable[..., Awaitable[Runner]]
LIMIT = 6
"""The controllers' repeated_failures; above one step's samples (2 prompts x 2)."""


async def start(
    bus: Bus, directory: Path, services: Services, controllers: Controllers, **spec: Any
) -> Trainer:
    """A job whose controller runs with ``LIMIT``, RUNNING at v0."""
    _, trainer = await submit(bus, directory, services[0], eval={"at_start": False}, **spec)
    await controllers.start(repeated_failures=LIMIT)
    await trainer.publish_version(0)
    await trainer.wait_for_state(RUNNING)
    return trainer


async def issued_prompts(trainer: Trainer) -> int:
    """Prompts the controller issued, by the job record (the ended job's stream is trimmed)."""
    record = await trainer.store.get(trainer.job_id)
    return record.issued_batches * record.spec.rollout.prompts_per_step + record.issued_extra


async def letters(trainer: Trainer) -> list[common_pb2.DeadLetter]:
    return await stream_messages(trainer.bus, trainer.streams.dead, common_pb2.DeadLetter)


async def test_random_bytes_on_the_prompts_stream_are_replaced_and_the_job_succeeds(
    bus: Bus, tokenizer_dir: Path, services: Services, controllers: Controllers, runner_for: RunnerFor
) -> None:
    trainer = await start(bus, tokenizer_dir, services, controllers, trainer={"steps": 2})
    await runner_for(router_address=services[1], reward_address=services[3])
    await trainer.wait_for_prompts(4)
    garbage = random.Random(15).randbytes(64)
    entry = await bus.redis.xadd(
        trainer.streams.prompts, {TYPE_FIELD: b"verst.v1.PromptTask", DATA_FIELD: garbage}
    )

    async def replaced() -> list[common_pb2.Trajectory]:
        extra = f"{trainer.job_id}:extra:0"
        return [t for t in await trajectories(bus, trainer.job_id) if t.prompt_id == extra]

    assert len(await eventually(replaced, "the replacement prompt rolled out")) == 2
    (letter,) = await letters(trainer)
    assert letter.entry_id == entry.decode() and letter.payload == garbage
    assert letter.source_stream == trainer.streams.prompts and letter.group == RUNNERS_GROUP
    assert letter.reason.startswith("undecodable verst.v1.PromptTask payload")
    record = await trainer.store.get(trainer.job_id)
    assert (record.state, record.dropped_groups, record.issued_extra) == (RUNNING, 1, 1)
    assert await bus.pending_count(trainer.streams.dead, CONTROLLER_GROUP) == 0
    for version in (1, 2):
        await trainer.publish_version(version)
    services[0].version = 2
    await trainer.report(common_pb2.JOB_STATE_SUCCEEDED, 2)
    await trainer.wait_for_state(SUCCEEDED)
    record = await trainer.store.get(trainer.job_id)
    assert (record.issued_batches, record.issued_extra, record.reason) == (2, 1, "")
    assert len(await trajectories(bus, trainer.job_id)) == 10, "5 prompts rolled out, 2 samples each"


async def test_prompt_task_bytes_labelled_trajectory_are_dead_lettered_and_replaced(
    bus: Bus, tokenizer_dir: Path, services: Services, controllers: Controllers
) -> None:
    """Protobuf decodes a PromptTask's bytes as a Trajectory with an id, a job and a group; the
    bus still refuses them (fields a Trajectory lacks), so nothing waits for them in the trainer."""
    trainer = await start(bus, tokenizer_dir, services, controllers)
    (task, *_) = await trainer.wait_for_prompts(4)
    stream = trainer.streams.trajectories
    await bus.ensure_group(stream, TRAINER_GROUP)
    entry = await bus.redis.xadd(
        stream, {TYPE_FIELD: b"verst.v1.Trajectory", DATA_FIELD: task.SerializeToString()}
    )
    assert common_pb2.Trajectory.FromString(task.SerializeToString()).job_id == trainer.job_id
    assert await bus.read(stream, TRAINER_GROUP, "trainer-1", common_pb2.Trajectory, block_ms=200) == []
    assert await bus.pending_count(stream, TRAINER_GROUP) == 0

    prompts = await trainer.wait_for_prompts(5)
    assert [p.prompt_id for p in prompts[4:]] == [f"{trainer.job_id}:extra:0"]
    (letter,) = await letters(trainer)
    assert letter.entry_id == entry.decode() and not letter.no_replacement
    assert letter.reason.startswith("invalid verst.v1.Trajectory payload: fields not in its schema (")
    assert await trainer.state() == RUNNING


async def test_a_failure_that_repeats_fails_the_job_quickly_without_a_hot_loop(
    bus: Bus, tokenizer_dir: Path, services: Services, controllers: Controllers, runner_for: RunnerFor
) -> None:
    """Every task refused the same way: each is replaced, until the same failure has come
    ``LIMIT`` times without a new version; then the job fails, naming it, and issuing stops."""
    services[0].refusal = "verifier 'nope' is not registered"
    trainer = await start(bus, tokenizer_dir, services, controllers)
    started = time.monotonic()
    await runner_for(router_address=services[1], reward_address=services[3])
    await trainer.wait_for_state(FAILED)
    took = time.monotonic() - started
    reason = (await trainer.store.get(trainer.job_id)).reason
    assert reason.startswith(f"the same failure repeated: {LIMIT} entries dead-lettered for it")
    assert "prompts stream" in reason and "verifier 'nope' is not registered" in reason
    assert took < 10.0
    await asyncio.sleep(0.5)  # the runner may finish the tasks it holds; nothing more is issued
    issued, dead = await issued_prompts(trainer), len(await letters(trainer))
    assert LIMIT <= dead <= issued <= 4 + LIMIT, "bounded: the batches, and replacements until the limit"
    await asyncio.sleep(0.5)
    assert (await issued_prompts(trainer), len(await letters(trainer))) == (issued, dead)


async def test_invalid_groups_the_trainer_reports_count_once_and_a_new_version_resets_the_count(
    bus: Bus, tokenizer_dir: Path, services: Services, controllers: Controllers
) -> None:
    """The trainer dead-letters an invalid group's trajectories (no_replacement) and reports the
    group dropped: one replacement per group. The same failure fails the job only when it
    repeats with no new version between."""
    trainer = await start(bus, tokenizer_dir, services, controllers)
    await trainer.wait_for_prompts(4)
    stream = trainer.streams.trajectories
    await bus.ensure_group(stream, TRAINER_GROUP)

    async def invalid_group(index: int) -> None:
        group = f"{trainer.job_id}:g{index}"
        members = [
            common_pb2.Trajectory(
                id=f"{group}:{i}", job_id=trainer.job_id, group_id=group, reward_error="boom"
            )
            for i in range(2)
        ]
        await bus.publish_many(stream, members)
        deliveries = await bus.read(stream, TRAINER_GROUP, "trainer-1", common_pb2.Trajectory, block_ms=200)
        reason = f"group {group!r} cannot be trained: scoring failed: boom"
        for delivery in deliveries:
            await bus.dead_letter(stream, TRAINER_GROUP, "trainer-1", delivery, reason, no_replacement=True)
        await trainer.report_drops(0, invalid=1)

    for index in range(2):  # 4 dead letters, below LIMIT
        await invalid_group(index)
    assert len(await trainer.wait_for_prompts(6)) == 6, "one replacement per group, not per trajectory"
    await trainer.publish_version(1)  # progress: what failed before counts no more
    prompts = await trainer.wait_for_prompts(8)
    for index in range(2, 4):  # 4 more: 8 in all, but only 4 since version 1
        await invalid_group(index)
    assert len(await trainer.wait_for_prompts(len(prompts) + 2)) == len(prompts) + 2
    record = await trainer.store.get(trainer.job_id)
    assert (record.state, record.dropped_groups) == (RUNNING, 4)
    await invalid_group(4)  # 6 since version 1
    await trainer.wait_for_state(FAILED, timeout_s=5.0)
    reason = (await trainer.store.get(trainer.job_id)).reason
    assert reason.startswith(f"the same failure repeated: {LIMIT} entries")
    assert "trajectories stream" in reason and "scoring failed: boom" in reason
