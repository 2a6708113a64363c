"""Housekeeping of the streams (services/common/housekeeping.py) on a real Redis: consumers that
died leave their groups while those holding entries stay, trimming keeps every unacked entry (and
a job's newest checkpoint handles and its dead letters), and the controller does both for a running
job and once more when it ends."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from services.common import housekeeping
from services.common.bus import Bus
from services.common.housekeeping import remove_dead_consumers, tidy, tidy_job
from services.common.jobs import SUCCEEDED
from services.common.pb import common_pb2
from services.common.streams import JOBS, JobStreams
from tests.helpers import eventually
from tests.integration.test_controller import (  # noqa: F401  (fixtures)
    Controllers,
    Services,
    Trainer,
    controllers,
    services,
    submit,
)

STREAMS = JobStreams("tidy")


def task(index: int) -> common_pb2.PromptTask:
    return common_pb2.PromptTask(prompt_id=f"p{index}", job_id="tidy")


async def members(bus: Bus, stream: str, group: str) -> dict[str, int]:
    """The group's consumers and how many entries each holds."""
    return {c["name"].decode(): int(c["pending"]) for c in await bus.redis.xinfo_consumers(stream, group)}


async def ids(bus: Bus, stream: str) -> list[str]:
    return [entry_id.decode() for entry_id, _ in await bus.redis.xrange(stream)]


async def test_dead_consumers_are_removed_and_those_holding_entries_stay(bus: Bus) -> None:
    stream = STREAMS.prompts
    await bus.ensure_group(stream, "runners")
    await bus.publish_many(stream, [task(i) for i in range(3)])
    done = await bus.read(stream, "runners", "runner-done", common_pb2.PromptTask, count=1, block_ms=50)
    await bus.ack(stream, "runners", [d.entry_id for d in done])
    held = await bus.read(stream, "runners", "runner-holding", common_pb2.PromptTask, count=1, block_ms=50)
    await asyncio.sleep(0.25)
    await bus.read(stream, "runners", "runner-live", common_pb2.PromptTask, count=1, block_ms=50)
    assert await members(bus, stream, "runners") == {"runner-done": 0, "runner-holding": 1, "runner-live": 1}

    assert await remove_dead_consumers(bus, stream, dead_after_ms=200) == ["runners/runner-done"]
    assert await members(bus, stream, "runners") == {"runner-holding": 1, "runner-live": 1}
    # Once its entry is taken over (reclaimed by a live runner), the dead holder goes too.
    await bus.redis.xclaim(stream, "runners", "runner-live", 0, [held[0].entry_id], justid=True)
    await asyncio.sleep(0.25)
    await bus.read(stream, "runners", "runner-live", common_pb2.PromptTask, count=1, block_ms=50)
    assert (await tidy(bus, stream, dead_after_ms=200, trim=False)).removed == ("runners/runner-holding",)
    assert await members(bus, stream, "runners") == {"runner-live": 2}
    # A quiet live consumer that was removed comes back on its next read.
    assert await remove_dead_consumers(bus, stream, dead_after_ms=10**9) == []


async def test_trimming_keeps_every_unacked_entry(bus: Bus) -> None:
    stream = STREAMS.trajectories
    await bus.ensure_group(stream, "trainer")
    published = await bus.publish_many(stream, [task(i) for i in range(10)])
    got = await bus.read(stream, "trainer", "t", common_pb2.PromptTask, count=8, block_ms=50)
    await bus.ack(stream, "trainer", [d.entry_id for d in got[:3] + got[4:]])  # #3 pending; 8, 9 unread
    assert (await tidy(bus, stream, dead_after_ms=60_000)).trimmed == 3
    assert await ids(bus, stream) == published[3:], "from the oldest unacked entry on"

    await bus.ack(stream, "trainer", [got[3].entry_id])
    assert (await tidy(bus, stream, dead_after_ms=60_000)).trimmed == 5
    assert await ids(bus, stream) == published[8:], "the two never delivered"
    rest = await bus.read(stream, "trainer", "t", common_pb2.PromptTask, count=8, block_ms=50)
    await bus.ack(stream, "trainer", [d.entry_id for d in rest])
    assert (await tidy(bus, stream, dead_after_ms=60_000)).trimmed == 2
    assert await ids(bus, stream) == []


async def test_a_jobs_checkpoints_keep_their_newest_handles_and_its_dead_letters_stay(bus: Bus) -> None:
    handles = [common_pb2.CheckpointHandle(job_id="tidy", version=v, uri="file:///c") for v in range(20)]
    published = await bus.publish_many(STREAMS.checkpoints, handles)
    await bus.publish(STREAMS.dead, common_pb2.DeadLetter(source_stream=STREAMS.prompts, entry_id="1-0"))
    assert await tidy_job(bus, "tidy", dead_after_ms=60_000) == 0, "no groups yet: nothing is known acked"
    for stream in (STREAMS.checkpoints, STREAMS.dead):
        await bus.ensure_group(stream, "controller")
        got = await bus.redis.xreadgroup("controller", "c", {stream: ">"}, count=100)
        await bus.ack(stream, "controller", [entry_id.decode() for entry_id, _ in got[0][1]])
    assert await tidy_job(bus, "tidy", dead_after_ms=60_000) == 4
    assert await ids(bus, STREAMS.checkpoints) == published[4:], "the newest LATEST_SCAN handles"
    assert len(await ids(bus, STREAMS.dead)) == 1 and not await bus.redis.exists(STREAMS.status)


async def test_the_controller_tidies_a_running_job_and_again_when_it_ends(
    bus: Bus,
    tokenizer_dir: Path,
    services: Services,  # noqa: F811  (fixtures)
    controllers: Controllers,  # noqa: F811  (fixtures)
) -> None:
    _, trainer = await submit(bus, tokenizer_dir, services[0], eval={"at_start": False, "every_steps": 0})
    streams = trainer.streams
    # A trainer holds this job's submission and another one's.
    await bus.publish(JOBS, common_pb2.JobSubmission(job_id="another"))
    await bus.ensure_group(JOBS, "trainers")
    submissions = await bus.read(JOBS, "trainers", "trainer-a", common_pb2.JobSubmission, block_ms=50)
    await controllers.start(housekeeping_s=0.2, dead_consumer_s=1.0)
    await trainer.publish_version(0)
    assert len(await trainer.wait_for_prompts(4)) == 4
    # A runner took every prompt and acked all but the last; another one died long ago.
    await bus.ensure_group(streams.prompts, "runners")
    taken = await bus.read(
        streams.prompts, "runners", "runner-a", common_pb2.PromptTask, count=4, block_ms=50
    )
    await bus.ack(streams.prompts, "runners", [d.entry_id for d in taken[:3]])
    await bus.redis.xgroup_createconsumer(streams.prompts, "runners", "runner-dead")

    async def tidied() -> bool:
        gone = "runner-dead" not in await members(bus, streams.prompts, "runners")
        return gone and await ids(bus, streams.prompts) == [taken[3].entry_id]

    await eventually(tidied, "the running job's prompts trimmed and its dead runner removed", timeout_s=10)
    await bus.ack(streams.prompts, "runners", [taken[3].entry_id])

    # The job ends (its trainer acks its submission): what is acked goes; the prompts issued
    # meanwhile, which no runner read, stay, as do the other job and the checkpoint handles.
    services[0].version = 4
    for version in range(1, 5):
        await trainer.publish_version(version)
    await eventually(lambda: _issued(trainer, 4), "batches 2 and 3 issued")
    await trainer.report(common_pb2.JOB_STATE_SUCCEEDED, 4)
    await bus.ack(JOBS, "trainers", [d.entry_id for d in submissions if d.message.job_id == trainer.job_id])
    await trainer.wait_for_state(SUCCEEDED)
    unread = [i for i in await ids(bus, streams.prompts) if i not in {d.entry_id for d in taken}]
    assert len(unread) == 4, "batches 2 and 3, issued on versions 1 and 2"

    async def ended() -> bool:
        lengths = [await bus.redis.xlen(s) for s in (streams.checkpoints, streams.status)]
        return lengths == [5, 0] and await ids(bus, streams.prompts) == unread

    await eventually(ended, "the ended job's streams trimmed", timeout_s=10)
    await eventually(lambda: _only(bus, JOBS, submissions[1].entry_id), "verst:jobs trimmed", timeout_s=10)


async def _only(bus: Bus, stream: str, entry_id: str) -> bool:
    return await ids(bus, stream) == [entry_id]


async def _issued(trainer: Trainer, batches: int) -> bool:
    return (await trainer.store.get(trainer.job_id)).issued_batches == batches


async def test_a_pass_that_fails_unexpectedly_does_not_end_the_tending(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tend_job runs beside a job's driver: a pass that raises (a bug, not an outage) is logged and
    the next pass runs, rather than taking the driver down with it."""
    passes: list[str] = []

    async def failing_once(bus: Bus, job_id: str, *, dead_after_ms: int, ended: bool = False) -> int:
        passes.append(job_id)
        if len(passes) == 1:
            raise AttributeError("'NoneType' object has no attribute 'partition'")
        return 0

    monkeypatch.setattr(housekeeping, "tidy_job", failing_once)
    stop = asyncio.Event()
    tending = asyncio.create_task(housekeeping.tend_job(bus, "tidy", 0.01, 60.0, stop))

    async def three_passes() -> bool:
        return len(passes) >= 3

    await eventually(three_passes, "three passes", timeout_s=5)
    stop.set()
    await asyncio.wait_for(tending, 5)
