"""A job's event log (services/common/events.py) on a real Redis: ids, resuming, trimming, and the
events the job store logs with the facts."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from services.common.bus import Bus
from services.common.config import JobSpec
from services.common.events import (
    START,
    Event,
    EventLog,
    dead_letter_event,
    metrics_event,
    state_event,
    warning_event,
)
from services.common.jobs import CANCELLED, FAILED, QUEUED, RUNNING, JobStore, MetricRow
from services.common.pb import common_pb2
from services.common.streams import JobStreams

JOB = "job-1"


def warnings(count: int) -> list[common_pb2.JobEvent]:
    return [warning_event(JOB, f"w{n}") for n in range(count)]


async def test_ids_are_entry_ids_and_reading_after_one_resumes_exactly(bus: Bus) -> None:
    log = EventLog(bus.redis)
    ids = [await log.append(event) for event in warnings(6)]
    assert ids == sorted(ids, key=lambda i: tuple(map(int, i.split("-")))) and len(set(ids)) == 6

    everything = await log.read(JOB, START)
    assert [event.id for event in everything] == ids
    assert [event.message.warning for event in everything] == [f"w{n}" for n in range(6)]
    assert [event.id for event in await log.read(JOB, ids[2])] == ids[3:]
    assert [event.id for event in await log.read(JOB, ids[0], count=2)] == ids[1:3]

    began = time.monotonic()
    assert await log.read(JOB, ids[-1], block_ms=100) == []
    assert 0.08 <= time.monotonic() - began < 2.0  # it waited, with a deadline


async def test_a_blocking_read_wakes_on_an_append(bus: Bus) -> None:
    log = EventLog(bus.redis)
    first = await log.append(warning_event(JOB, "before"))
    reading = asyncio.create_task(log.read(JOB, first, block_ms=5000))
    await asyncio.sleep(0.1)
    second = await log.append(warning_event(JOB, "after"))
    began = time.monotonic()
    [event] = await asyncio.wait_for(reading, 5)
    assert (event.id, event.message.warning) == (second, "after")
    assert time.monotonic() - began < 2.0


async def test_the_log_is_trimmed_to_about_maxlen_keeping_the_newest(bus: Bus) -> None:
    log = EventLog(bus.redis, maxlen=100)
    pipe = bus.redis.pipeline(transaction=False)
    for event in warnings(1000):
        log.add(pipe, event)
    ids = [raw.decode() for raw in await pipe.execute()]

    length = await bus.redis.xlen(JobStreams(JOB).events)
    assert 100 <= length <= 200  # MAXLEN ~ trims whole nodes (100 entries each by default)
    kept = await log.read(JOB, START, count=1000)
    assert [event.id for event in kept] == ids[-length:]
    assert kept[-1].message.warning == "w999"
    # a reader that fell further behind than the cap resumes with what is left, in order
    assert [event.id for event in await log.read(JOB, ids[0], count=1000)] == ids[-length:]


async def test_a_bad_entry_is_passed_over_not_returned(bus: Bus) -> None:
    log = EventLog(bus.redis)
    first = await log.append(warning_event(JOB, "a"))
    await bus.redis.xadd(JobStreams(JOB).events, {b"t": b"verst.v1.Metric", b"d": b""})
    await log.append(warning_event("job-2", "another job's"))  # fails the payload check here
    last = await log.append(warning_event(JOB, "b"))
    assert [(e.id, e.message.warning) for e in await log.read(JOB, START)] == [(first, "a"), (last, "b")]


@pytest.mark.parametrize("bad", ["", "$", "0", "1-2-3", "abc-1", "1-"])
async def test_an_id_that_is_not_one_is_refused(bus: Bus, bad: str) -> None:
    with pytest.raises(ValueError, match="not an event id"):
        await EventLog(bus.redis).read(JOB, bad)


def test_event_data_is_json_ready_and_names_its_kind() -> None:
    state = Event("5-0", state_event(JOB, FAILED, "boom", at=12.5))
    assert state.data() == {
        "id": "5-0", "job_id": JOB, "time": 12.5, "kind": "state", "state": FAILED, "reason": "boom",
    }  # fmt: skip
    assert state.terminal and not Event("1-0", state_event(JOB, RUNNING, "")).terminal

    values = {"reward_mean": 0.5, "bad": math.inf}
    metrics = Event(
        "6-0", metrics_event(JOB, source="trainer", step=3, policy_version=3, values=values, at=1)
    )
    assert metrics.kind == "metrics" and not metrics.terminal
    assert metrics.data()["values"] == {"bad": None, "reward_mean": 0.5}  # JSON has no infinity
    assert (metrics.data()["step"], metrics.data()["source"]) == (3, "trainer")
    evaluation = metrics_event(JOB, source="eval", step=4, policy_version=4, values={"accuracy": 1.0}, at=1)
    assert Event("7-0", evaluation).kind == "evaluation"

    letter = common_pb2.DeadLetter(source_stream="s", reason="r", payload=b"secret", delivery_count=5)
    dead = Event("8-0", dead_letter_event(JOB, letter))
    assert dead.message.dead_letter.payload == b"" and letter.payload == b"secret"
    assert (dead.kind, dead.data()["reason"], dead.data()["delivery_count"]) == ("dead_letter", "r", 5)
    assert Event("9-0", warning_event(JOB, "careful")).data()["message"] == "careful"


async def test_the_job_store_logs_each_state_change_it_applies_and_each_metric_row(bus: Bus) -> None:
    store = JobStore(bus.redis, events_maxlen=1000)
    job_id = (await store.create(JobSpec.model_validate({"name": "addition"}))).job_id
    assert await store.set_state(job_id, RUNNING)
    rows = [
        MetricRow(1, 1, "trainer", {"loss": 0.25}, 100.0),
        MetricRow(1, 1, "eval", {"accuracy": 0.75}, 101.0),
    ]
    await store.merge_metric_rows(job_id, rows)
    assert await store.set_state(job_id, CANCELLED, "by the user")
    assert not await store.set_state(job_id, FAILED, "too late")  # not applied: not logged

    events = await store.events.read(job_id, START)
    assert [(e.kind, e.data().get("state")) for e in events] == [
        ("state", QUEUED), ("state", RUNNING), ("metrics", None), ("evaluation", None), ("state", CANCELLED),
    ]  # fmt: skip
    assert events[2].data()["values"] == {"loss": 0.25} and events[3].data()["time"] == 101.0
    assert events[-1].terminal and events[-1].data()["reason"] == "by the user"
