"""The bus against a real Redis server: delivery, reclaim, dead letters, ordering, trimming."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.common.bus import (
    APPEND_CHUNK_BYTES,
    DATA_FIELD,
    LATEST_SCAN,
    TYPE_FIELD,
    Bus,
    encode,
    payload_chunks,
)
from services.common.consumer import StreamConsumer
from services.common.pb import common_pb2
from services.common.streams import JobStreams

STREAMS = JobStreams("job-1")
GROUP = "trainer"


def trajectory(i: int) -> common_pb2.Trajectory:
    return common_pb2.Trajectory(
        id=f"traj-{i}",
        job_id="job-1",
        prompt_id=f"p-{i // 4}",
        group_id=f"p-{i // 4}",
        sample_index=i % 4,
        response_token_ids=[i, i + 1, i + 2],
        behaviour_logprobs=[-0.5, -1.0, -1.5],
        loss_mask=[True, True, False],
        policy_versions=[3, 3, 4],
        reward=float(i),
    )


def handle(version: int) -> common_pb2.CheckpointHandle:
    return common_pb2.CheckpointHandle(job_id="job-1", version=version, uri=f"file:///ckpt/v{version}")


async def dead_letters(bus: Bus, stream: str) -> list[common_pb2.DeadLetter]:
    entries = await bus.redis.xrange(stream)
    return [common_pb2.DeadLetter.FromString(fields[DATA_FIELD]) for _, fields in entries]


async def test_at_least_once_unacked_entries_are_redelivered(bus: Bus) -> None:
    stream = STREAMS.trajectories
    await bus.ensure_group(stream, GROUP)
    await bus.publish_many(stream, [trajectory(i) for i in range(10)])

    first = await bus.read(stream, GROUP, "a", common_pb2.Trajectory, count=10, block_ms=100)
    assert [d.message.id for d in first] == [f"traj-{i}" for i in range(10)]
    assert all(d.delivery_count == 1 for d in first)
    # "a" never acks. A fresh read gives nothing new, but after the idle bound another consumer
    # gets every entry again, with its delivery count raised.
    assert await bus.read(stream, GROUP, "b", common_pb2.Trajectory, block_ms=50) == []
    await asyncio.sleep(0.06)
    again = await bus.reclaim(stream, GROUP, "b", common_pb2.Trajectory, min_idle_ms=50)
    assert [d.message for d in again] == [d.message for d in first]
    assert all(d.delivery_count == 2 for d in again)

    assert await bus.ack(stream, GROUP, [d.entry_id for d in again]) == 10
    assert await bus.pending_count(stream, GROUP) == 0
    await asyncio.sleep(0.06)
    assert await bus.reclaim(stream, GROUP, "c", common_pb2.Trajectory, min_idle_ms=50) == []


async def test_reclaim_leaves_entries_of_live_consumers(bus: Bus) -> None:
    stream = STREAMS.prompts
    await bus.ensure_group(stream, GROUP)
    await bus.publish(stream, common_pb2.PromptTask(prompt_id="p", job_id="job-1"))
    await bus.read(stream, GROUP, "a", common_pb2.PromptTask, block_ms=100)
    assert await bus.reclaim(stream, GROUP, "b", common_pb2.PromptTask, min_idle_ms=60_000) == []
    assert await bus.pending_count(stream, GROUP) == 1


async def test_ensure_group_is_idempotent(bus: Bus) -> None:
    assert await bus.ensure_group(STREAMS.metrics, GROUP) is True
    assert await bus.ensure_group(STREAMS.metrics, GROUP) is False
    assert await bus.ensure_group(STREAMS.metrics, "other") is True


async def test_poisoned_entries_are_dead_lettered_and_do_not_block(bus: Bus) -> None:
    stream = STREAMS.trajectories
    await bus.ensure_group(stream, GROUP)
    await bus.publish(stream, trajectory(0))
    garbage_id = (
        await bus.redis.xadd(stream, {TYPE_FIELD: b"verst.v1.Trajectory", DATA_FIELD: b"\xff\xff\xff"})
    ).decode()
    wrong_type_id = await bus.publish(stream, common_pb2.Metric(job_id="job-1"))
    no_fields_id = (await bus.redis.xadd(stream, {b"x": b"1"})).decode()
    await bus.publish(stream, trajectory(1))

    got = await bus.read(stream, GROUP, "a", common_pb2.Trajectory, count=10, block_ms=100)
    assert [d.message.id for d in got] == ["traj-0", "traj-1"]
    # Only the two good entries wait for an ack: the poisoned ones were acked with their dead letter.
    assert await bus.pending_count(stream, GROUP) == 2

    letters = await dead_letters(bus, STREAMS.dead)
    assert [letter.entry_id for letter in letters] == [garbage_id, wrong_type_id, no_fields_id]
    garbage, wrong, missing = letters
    assert "undecodable verst.v1.Trajectory payload" in garbage.reason
    assert garbage.payload == b"\xff\xff\xff"
    assert garbage.source_stream == stream and garbage.group == GROUP and garbage.consumer == "a"
    assert "'verst.v1.Metric' is not the expected 'verst.v1.Trajectory'" in wrong.reason
    assert common_pb2.Metric.FromString(wrong.payload).job_id == "job-1"
    assert "'' is not the expected" in missing.reason
    assert garbage.dead_at.seconds > 0


async def test_entry_delivered_too_often_is_dead_lettered(bus: Bus) -> None:
    """An entry that crashes every consumer that takes it must not circulate forever."""
    stream = STREAMS.trajectories
    await bus.ensure_group(stream, GROUP)
    await bus.publish(stream, trajectory(7))
    await bus.read(stream, GROUP, "c0", common_pb2.Trajectory, block_ms=100)
    for attempt in range(2, bus.max_deliveries + 1):
        await asyncio.sleep(0.02)
        again = await bus.reclaim(stream, GROUP, f"c{attempt}", common_pb2.Trajectory, min_idle_ms=10)
        assert [d.delivery_count for d in again] == [attempt]
    await asyncio.sleep(0.02)
    assert await bus.reclaim(stream, GROUP, "last", common_pb2.Trajectory, min_idle_ms=10) == []

    (letter,) = await dead_letters(bus, STREAMS.dead)
    assert letter.reason == f"delivered {bus.max_deliveries + 1} times without an ack (max_deliveries=3)"
    assert common_pb2.Trajectory.FromString(letter.payload).id == "traj-7"
    assert await bus.pending_count(stream, GROUP) == 0
    # The stream keeps flowing.
    await bus.publish(stream, trajectory(8))
    after = await bus.read(stream, GROUP, "last", common_pb2.Trajectory, block_ms=100)
    assert [d.message.id for d in after] == ["traj-8"]


async def test_consumer_can_dead_letter_what_it_cannot_process(bus: Bus) -> None:
    consumer = StreamConsumer(bus, STREAMS.trajectories, GROUP, "a", common_pb2.Trajectory, block_ms=100)
    await bus.publish(STREAMS.trajectories, trajectory(1))  # before the group exists: group starts at 0
    (delivery,) = await consumer.poll()
    await consumer.dead_letter(delivery, "reward_error set: verifier crashed")
    (letter,) = await dead_letters(bus, STREAMS.dead)
    assert letter.reason == "reward_error set: verifier crashed"
    assert letter.delivery_count == 1
    assert await bus.pending_count(STREAMS.trajectories, GROUP) == 0


async def test_entry_trimmed_while_pending_is_dead_lettered_not_lost(bus: Bus) -> None:
    stream = STREAMS.trajectories
    await bus.ensure_group(stream, GROUP)
    ids = await bus.publish_many(stream, [trajectory(i) for i in range(3)])
    await bus.read(stream, GROUP, "a", common_pb2.Trajectory, count=3, block_ms=100)
    await bus.redis.xtrim(stream, maxlen=1, approximate=False)  # drops the first two, still pending
    await asyncio.sleep(0.02)
    survivors = await bus.reclaim(stream, GROUP, "b", common_pb2.Trajectory, min_idle_ms=10)
    assert [d.entry_id for d in survivors] == [ids[2]]
    letters = await dead_letters(bus, STREAMS.dead)
    assert sorted(letter.entry_id for letter in letters) == sorted(ids[:2])
    assert all("trimmed" in letter.reason for letter in letters)
    assert await bus.pending_count(stream, GROUP) == 1


async def test_per_stream_order_is_kept(bus: Bus) -> None:
    stream = STREAMS.trajectories
    await bus.ensure_group(stream, GROUP)
    for start in range(0, 500, 50):
        await bus.publish_many(stream, [trajectory(i) for i in range(start, start + 50)])
    await bus.publish(STREAMS.prompts, common_pb2.PromptTask(prompt_id="other stream", job_id="job-1"))
    seen: list[str] = []
    while batch := await bus.read(stream, GROUP, "a", common_pb2.Trajectory, count=37, block_ms=50):
        seen += [d.message.id for d in batch]
        await bus.ack(stream, GROUP, [d.entry_id for d in batch])
    assert seen == [f"traj-{i}" for i in range(500)]


async def test_publish_groups_appends_each_streams_groups_in_order_as_one_command(bus: Bus) -> None:
    other = JobStreams("job-2").trajectories
    groups = [
        (STREAMS.trajectories, [trajectory(i) for i in range(0, 4)]),
        (other, [trajectory(i) for i in range(100, 102)]),
        (STREAMS.trajectories, [trajectory(i) for i in range(4, 8)]),
    ]
    await bus.redis.script_flush()  # a new Redis: the script is loaded on first use
    first = await bus.publish_groups(groups)
    second = await bus.publish_groups(groups[:1])  # loaded now
    assert [len(ids) for ids in first] == [4, 2, 4] and len(second[0]) == 4
    for stream, ids in ((STREAMS.trajectories, [*first[0], *first[2], *second[0]]), (other, first[1])):
        entries = await bus.redis.xrange(stream)
        assert [entry_id.decode() for entry_id, _ in entries] == ids
        assert {fields[TYPE_FIELD] for _, fields in entries} == {b"verst.v1.Trajectory"}
    messages = [common_pb2.Trajectory.FromString(f[DATA_FIELD]) for _, f in await bus.redis.xrange(other)]
    assert messages == groups[1][1]


async def test_publish_groups_fails_only_the_groups_of_a_stream_that_refused(bus: Bus) -> None:
    await bus.redis.set("not-a-stream", "x")  # XADD to it fails: WRONGTYPE
    outcomes = await bus.publish_groups(
        [("not-a-stream", [trajectory(0)]), (STREAMS.trajectories, [trajectory(1)])]
    )
    assert isinstance(outcomes[0], Exception) and "WRONGTYPE" in str(outcomes[0])
    assert isinstance(outcomes[1], list) and len(outcomes[1]) == 1
    with pytest.raises(TypeError, match="one stream carries one type"):
        await bus.publish_groups([(STREAMS.trajectories, [trajectory(2), handle(1)])])


async def test_block_timeout_is_a_deadline(bus: Bus) -> None:
    await bus.ensure_group(STREAMS.prompts, GROUP)
    start = time.monotonic()
    assert await bus.read(STREAMS.prompts, GROUP, "a", common_pb2.PromptTask, block_ms=200) == []
    assert 0.15 < time.monotonic() - start < 2.0
    with pytest.raises(ValueError, match="block_ms"):
        await bus.read(STREAMS.prompts, GROUP, "a", common_pb2.PromptTask, block_ms=10**7)


async def test_publish_caps_stream_length(bus: Bus) -> None:
    stream = STREAMS.metrics
    for _ in range(5):
        await bus.publish_many(stream, [common_pb2.Metric(step=i) for i in range(200)], maxlen=100)
    # Approximate trimming removes whole nodes: the length stays near the cap, never unbounded.
    assert 100 <= await bus.redis.xlen(stream) < 300


async def test_trim_consumed_deletes_only_what_every_group_acked(bus: Bus) -> None:
    stream = STREAMS.trajectories
    await bus.ensure_group(stream, "trainer")
    await bus.ensure_group(stream, "auditor")
    ids = await bus.publish_many(stream, [trajectory(i) for i in range(10)])
    assert await bus.trim_consumed(stream) == 0

    trainer = await bus.read(stream, "trainer", "t", common_pb2.Trajectory, count=10, block_ms=50)
    await bus.ack(stream, "trainer", [d.entry_id for d in trainer])
    auditor = await bus.read(stream, "auditor", "a", common_pb2.Trajectory, count=6, block_ms=50)
    await bus.ack(stream, "auditor", [d.entry_id for d in auditor[:4]])  # 4, 5 still pending

    assert await bus.trim_consumed(stream) == 4
    remaining = [eid.decode() for eid, _ in await bus.redis.xrange(stream)]
    assert remaining == ids[4:]


async def test_publish_many_and_encode_round_trip(bus: Bus) -> None:
    handle = common_pb2.CheckpointHandle(job_id="j", version=2, uri="file:///ckpt/v2", sha256="ab" * 32)
    (entry_id,) = await bus.publish_many(STREAMS.checkpoints, [handle])
    ((got_id, fields),) = await bus.redis.xrange(STREAMS.checkpoints)
    assert got_id.decode() == entry_id
    assert fields == encode(handle)
    assert common_pb2.CheckpointHandle.FromString(fields[DATA_FIELD]) == handle


async def test_latest_reads_the_newest_message_without_a_group(bus: Bus) -> None:
    stream = STREAMS.checkpoints
    assert await bus.latest(stream, common_pb2.CheckpointHandle) is None
    for version in range(3):
        await bus.publish(stream, handle(version))
    latest = await bus.latest(stream, common_pb2.CheckpointHandle)
    assert latest is not None and latest.version == 2
    with pytest.raises(TypeError, match=r"is a good verst\.v1\.Metric.*not the expected 'verst\.v1\.Metric'"):
        await bus.latest(stream, common_pb2.Metric)


async def test_latest_passes_over_bad_entries_at_the_end(bus: Bus) -> None:
    """A bad newest entry must not hide the good handle before it (engines would stop loading)."""
    stream = STREAMS.checkpoints
    await bus.publish(stream, handle(3))
    await bus.redis.xadd(stream, {TYPE_FIELD: b"verst.v1.CheckpointHandle", DATA_FIELD: b"\xff\xff\xff"})
    await bus.publish(stream, common_pb2.Metric(job_id="job-1"))
    await bus.publish(stream, common_pb2.CheckpointHandle(job_id="job-2", version=9, uri="file:///v9"))
    latest = await bus.latest(stream, common_pb2.CheckpointHandle)
    assert latest is not None and latest.version == 3
    for _ in range(LATEST_SCAN):
        await bus.redis.xadd(stream, {TYPE_FIELD: b"verst.v1.CheckpointHandle", DATA_FIELD: b"\xff"})
    with pytest.raises(TypeError, match=f"none of the newest {LATEST_SCAN} entries"):
        await bus.latest(stream, common_pb2.CheckpointHandle)


async def test_payloads_are_checked_on_every_read(bus: Bus) -> None:
    """Bytes that decode as the labelled type are not enough: unknown fields, another job's
    payload or a missing id are dead-lettered with the problem, and nothing stays pending."""
    stream = STREAMS.trajectories
    await bus.ensure_group(stream, GROUP)
    task = common_pb2.PromptTask(
        prompt_id="job-1:0:3",
        job_id="job-1",
        group_id="job-1:0:3",
        prompt_token_ids=[5, 6, 7],
        prompt_text="12+34=",
        n_samples=2,
        answer="46",
    )
    task.created_at.GetCurrentTime()
    assert common_pb2.Trajectory.FromString(task.SerializeToString()).id == "job-1:0:3"  # lenient protobuf
    labelled = await bus.redis.xadd(
        stream, {TYPE_FIELD: b"verst.v1.Trajectory", DATA_FIELD: task.SerializeToString()}
    )
    foreign = trajectory(1)
    foreign.job_id = "job-2"
    nested = trajectory(2)
    nested.stages.MergeFromString(common_pb2.Metric(source="x").SerializeToString())  # field 4: a double
    no_id = trajectory(3)
    no_id.id = ""
    await bus.publish_many(stream, [foreign, nested, no_id, trajectory(4)])

    got = await bus.read(stream, GROUP, "a", common_pb2.Trajectory, count=10, block_ms=100)
    assert [d.message.id for d in got] == ["traj-4"]
    assert await bus.pending_count(stream, GROUP) == 1
    letters = await dead_letters(bus, STREAMS.dead)
    assert letters[0].entry_id == labelled.decode()
    prefix = "invalid verst.v1.Trajectory payload: "
    assert [letter.reason.removeprefix(prefix) for letter in letters] == [
        "fields not in its schema (5, 16): the bytes of another type?",
        "job_id 'job-2' is not the stream's job 'job-1'",
        "fields not in its schema (stages.4): the bytes of another type?",
        "no id",
    ]
    assert all(letter.reason.startswith(prefix) for letter in letters)
    assert not any(letter.no_replacement for letter in letters)


async def test_wait_newer_returns_at_once_for_an_entry_after_the_one_seen(bus: Bus) -> None:
    stream = STREAMS.checkpoints
    assert await bus.newest_id(stream) == "0-0"
    assert await bus.wait_newer(stream, "0-0", block_ms=50) is None  # nothing, after its deadline
    first = await bus.publish(stream, handle(1))
    assert await bus.newest_id(stream) == first
    assert await bus.wait_newer(stream, "0-0", block_ms=50) == first  # already there: no wait
    waiting = asyncio.create_task(bus.wait_newer(stream, first, block_ms=5000))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    started = time.monotonic()
    second = await bus.publish(stream, handle(2))
    assert await asyncio.wait_for(waiting, 2.0) == second and time.monotonic() - started < 1.0
    with pytest.raises(ValueError, match="block_ms"):
        await bus.wait_newer(stream, first, block_ms=0)


async def test_wait_newest_returns_the_newest_good_handle_from_its_own_read(bus: Bus) -> None:
    stream = STREAMS.checkpoints
    assert await bus.wait_newest(stream, "0-0", common_pb2.CheckpointHandle, block_ms=50) is None
    first = await bus.publish(stream, handle(1))
    second = await bus.publish(stream, handle(2))
    await bus.redis.xadd(stream, {"junk": b"not a handle"})  # the newest entry is bad: passed over
    got = await bus.wait_newest(stream, "0-0", common_pb2.CheckpointHandle, block_ms=50)
    assert got is not None and got[1] is not None and got[1].version == 2
    assert got[0] == await bus.newest_id(stream) and got[0] not in (first, second)
    waiting = asyncio.create_task(bus.wait_newest(stream, got[0], common_pb2.CheckpointHandle, block_ms=5000))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    third = await bus.publish(stream, handle(3))
    woke = await asyncio.wait_for(waiting, 2.0)
    assert woke is not None and woke[0] == third and woke[1] is not None and woke[1].version == 3
    # More entries than one read takes: the newest comes from the stream's end, not the read's.
    for version in range(4, 4 + LATEST_SCAN + 2):
        last = await bus.publish(stream, handle(version))
    behind = await bus.wait_newest(stream, third, common_pb2.CheckpointHandle, block_ms=50)
    assert behind is not None and behind[0] == last and behind[1] is not None
    assert behind[1].version == 3 + LATEST_SCAN + 2
    with pytest.raises(ValueError, match="block_ms"):
        await bus.wait_newest(stream, third, common_pb2.CheckpointHandle, block_ms=0)


async def test_reclaim_follows_the_cursor_past_live_entries(bus: Bus) -> None:
    """Idle entries far down the pending list are found, not only the first ones scanned."""
    stream = STREAMS.trajectories
    await bus.ensure_group(stream, GROUP)
    await bus.publish_many(stream, [trajectory(i) for i in range(60)])
    live = await bus.read(stream, GROUP, "live", common_pb2.Trajectory, count=50, block_ms=100)
    await bus.read(stream, GROUP, "dead", common_pb2.Trajectory, count=10, block_ms=100)
    await asyncio.sleep(0.05)
    # "live" keeps its entries fresh; only the dead consumer's 10, behind them, are idle.
    held = await bus.touch(stream, GROUP, "live", [d.entry_id for d in live])
    assert len(held) == 50
    first = await bus.reclaim(stream, GROUP, "new", common_pb2.Trajectory, min_idle_ms=40, count=4)
    rest = await bus.reclaim(stream, GROUP, "new", common_pb2.Trajectory, min_idle_ms=40, count=100)
    assert len(first) == 4
    got = first + rest
    assert sorted(d.message.id for d in got) == sorted(f"traj-{i}" for i in range(50, 60))
    assert await bus.owner(stream, GROUP, got[0].entry_id) == "new"
    assert await bus.owner(stream, GROUP, live[0].entry_id) == "live"
    await bus.ack(stream, GROUP, [live[0].entry_id])
    assert await bus.owner(stream, GROUP, live[0].entry_id) is None
    assert await bus.touch(stream, GROUP, "live", [live[0].entry_id]) == []


def test_payloads_are_cut_into_chunks_in_order() -> None:
    big, small = b"b" * APPEND_CHUNK_BYTES, b"s" * (APPEND_CHUNK_BYTES // 3)
    payloads = [small, small, small, small, big, small]
    chunks = payload_chunks(payloads)
    assert [b for chunk in chunks for b in chunk] == payloads
    assert [len(chunk) for chunk in chunks] == [3, 1, 1, 1]  # a payload as big as a chunk alone
    assert all(sum(map(len, chunk)) <= APPEND_CHUNK_BYTES for chunk in chunks)
    assert payload_chunks([]) == []


async def test_a_publish_larger_than_a_chunk_keeps_its_order(bus: Bus) -> None:
    stream = STREAMS.trajectories
    many = [common_pb2.Trajectory(id=f"t{i}", response_token_ids=[7] * 20_000) for i in range(60)]
    await bus.redis.script_flush()
    [ids] = await bus.publish_groups([(stream, many)])
    entries = await bus.redis.xrange(stream)
    assert [entry_id.decode() for entry_id, _ in entries] == ids
    assert [common_pb2.Trajectory.FromString(f[DATA_FIELD]).id for _, f in entries] == [t.id for t in many]


async def test_trim_consumed_when_the_pending_entries_are_acked_while_it_looks(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The groups' states say an entry is pending; by the time their pending entries are read,
    it was acked (busy streams do this): the trim goes on, bounded by the last delivered entry."""
    stream = STREAMS.trajectories
    await bus.ensure_group(stream, "trainer")
    ids = await bus.publish_many(stream, [trajectory(i) for i in range(6)])
    read = await bus.read(stream, "trainer", "t", common_pb2.Trajectory, count=4, block_ms=50)
    seen = await bus.redis.xinfo_groups(stream)
    assert int(seen[0]["pending"]) == 4
    await bus.ack(stream, "trainer", [d.entry_id for d in read])

    async def as_seen(name: str) -> list[dict[str, object]]:
        return seen

    monkeypatch.setattr(bus.redis, "xinfo_groups", as_seen)
    assert await bus.trim_consumed(stream) == 4
    remaining = [eid.decode() for eid, _ in await bus.redis.xrange(stream)]
    assert remaining == ids[4:]
