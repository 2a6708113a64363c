"""The job store against a real Redis server: lifecycle, final states, progress, metrics history,
issued prompts and dropped groups."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from services.common.bus import Bus
from services.common.config import JobSpec, JobSpecError
from services.common.jobs import (
    CANCELLED,
    FAILED,
    QUEUED,
    RUNNING,
    SUCCEEDED,
    JobNotFoundError,
    JobStore,
    MetricRow,
    decode_spec,
    decode_submission,
    job_history_key,
    submission,
)
from services.common.payloads import NonFiniteMetricError
from services.common.pb import common_pb2
from services.common.streams import CONTROLLER_GROUP, JOBS, JobStreams, job_key
from tests.helpers import stream_messages


@pytest.fixture
def store(bus: Bus) -> JobStore:
    return JobStore(bus.redis, history_limit=5)


async def test_create_stores_a_queued_job_and_submits_it_in_one_step(store: JobStore, bus: Bus) -> None:
    spec = JobSpec.model_validate({"name": "addition", "trainer": {"steps": 7}})
    record = await store.create(spec)

    assert re.fullmatch(r"addition-[0-9a-f]{8}", record.job_id)
    assert record.state == QUEUED and not record.terminal
    assert (record.policy_version, record.step, record.reason, record.metrics) == (0, 0, "", {})
    assert record.spec == spec
    assert record.submitted_at == record.updated_at
    await bus.ensure_group(JOBS, "trainers")
    [delivery] = await bus.read(JOBS, "trainers", "t", common_pb2.JobSubmission, block_ms=100)
    assert delivery.message.job_id == record.job_id
    assert decode_submission(delivery.message) == (record.job_id, spec)
    assert delivery.message.submitted_at.seconds == int(record.submitted_at)
    assert [r.job_id for r in await store.active_jobs()] == [record.job_id]


async def test_lifecycle_and_terminal_states_are_final(store: JobStore) -> None:
    job_id = (await store.create(JobSpec())).job_id
    assert await store.set_state(job_id, RUNNING) is True
    assert [r.job_id for r in await store.running_jobs()] == [job_id]
    assert await store.set_state(job_id, QUEUED) is False, "a running job never goes back to the queue"
    assert await store.set_state(job_id, SUCCEEDED, "done") is True
    for state in (CANCELLED, FAILED, RUNNING, SUCCEEDED):
        assert await store.set_state(job_id, state, "too late") is False
    record = await store.get(job_id)
    assert (record.state, record.reason, record.terminal) == (SUCCEEDED, "done", True)
    assert await store.active_jobs() == [] and await store.running_jobs() == []
    assert record.updated_at >= record.submitted_at


async def test_a_cancel_and_a_success_race_and_exactly_one_wins(store: JobStore) -> None:
    for _ in range(5):
        job_id = (await store.create(JobSpec())).job_id
        await store.set_state(job_id, RUNNING)
        won = await asyncio.gather(store.set_state(job_id, CANCELLED), store.set_state(job_id, SUCCEEDED))
        assert sorted(won) == [False, True]
        assert (await store.get(job_id)).state == (CANCELLED if won[0] else SUCCEEDED)


async def test_unknown_jobs_and_states_are_errors(store: JobStore) -> None:
    with pytest.raises(JobNotFoundError):
        await store.get("nope-00000000")
    with pytest.raises(JobNotFoundError):
        await store.set_state("nope-00000000", RUNNING)
    with pytest.raises(JobNotFoundError):
        await store.update_progress("nope-00000000", 1, 1)
    with pytest.raises(JobNotFoundError):
        await store.merge_metrics("nope-00000000", {"x": 1.0}, step=0, source="eval")
    with pytest.raises(JobNotFoundError):
        await store.history("nope-00000000")
    job_id = (await store.create(JobSpec())).job_id
    with pytest.raises(ValueError, match="unknown job state 'DONE'"):
        await store.set_state(job_id, "DONE")
    assert await store.redis.exists(job_key("nope-00000000")) == 0, "errors must not create records"


async def test_progress_only_moves_forward(store: JobStore) -> None:
    job_id = (await store.create(JobSpec())).job_id
    assert await store.update_progress(job_id, 3, 3) is True
    assert await store.update_progress(job_id, 2, 2) is False, "a re-delivered old handle"
    assert await store.update_progress(job_id, 3, 4) is True
    record = await store.get(job_id)
    assert (record.policy_version, record.step) == (3, 4)


async def test_metrics_keep_the_latest_per_source_and_a_bounded_history(store: JobStore) -> None:
    job_id = (await store.create(JobSpec())).job_id
    await store.merge_metrics(job_id, {"accuracy": 0.25, "reward_mean": 0.3}, step=0, source="eval")
    for step in range(1, 6):
        await store.merge_metrics(
            job_id, {"loss": 1.0 / step, "reward_mean": 0.1 * step}, step=step, source="trainer"
        )
    await store.merge_metrics(job_id, {"accuracy": 0.75}, step=5, source="eval", policy_version=5)

    record = await store.get(job_id)
    assert record.metrics == {
        "eval/accuracy": 0.75,
        "eval/reward_mean": 0.3,
        "trainer/loss": pytest.approx(0.2),
        "trainer/reward_mean": pytest.approx(0.5),
    }
    rows = await store.history(job_id)
    assert len(rows) == 5, "capped at history_limit: the oldest rows were dropped"
    assert [(r.source, r.step) for r in rows] == [("trainer", s) for s in range(2, 6)] + [("eval", 5)]
    assert rows[-1].policy_version == 5 and rows[-1].values == {"accuracy": 0.75}
    assert [r.step for r in await store.history(job_id, source="trainer", limit=2)] == [4, 5]
    assert await store.redis.llen(job_history_key(job_id)) == 5


async def test_a_non_finite_metric_is_refused_by_name_and_nothing_is_merged(store: JobStore) -> None:
    job_id = (await store.create(JobSpec())).job_id
    await store.merge_metrics(job_id, {"loss": 0.5}, step=1, source="trainer")
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(NonFiniteMetricError, match=f"trainer/kl={bad}"):
            await store.merge_metrics(job_id, {"loss": 0.25, "kl": bad}, step=2, source="trainer")
    assert (await store.get(job_id)).metrics == {"trainer/loss": 0.5}
    assert [row.step for row in await store.history(job_id)] == [1]


async def test_list_is_newest_first_and_counts_by_state(store: JobStore) -> None:
    ids = [(await store.create(JobSpec(name=f"job{i}"))).job_id for i in range(4)]
    await store.set_state(ids[0], RUNNING)
    await store.set_state(ids[1], FAILED, "boom")
    assert [r.job_id for r in await store.list(limit=3)] == ids[::-1][:3]
    assert [r.job_id for r in await store.active_jobs()] == [ids[0], ids[2], ids[3]]
    assert await store.count_by_state() == {QUEUED: 2, RUNNING: 1, SUCCEEDED: 0, FAILED: 1, CANCELLED: 0}


async def test_briefs_list_newest_first_without_their_specs(store: JobStore) -> None:
    ids = [(await store.create(JobSpec(name=f"job{i}"))).job_id for i in range(3)]
    await store.set_state(ids[1], FAILED, "boom")
    await store.update_progress(ids[2], 4, 8)
    await store.merge_metrics(ids[2], {"loss": 0.5}, step=8, source="trainer")
    briefs = await store.list_briefs(limit=2)
    assert [(b.job_id, b.name, b.state) for b in briefs] == [
        (ids[2], "job2", QUEUED),
        (ids[1], "job1", FAILED),
    ]
    assert (briefs[0].policy_version, briefs[0].step, briefs[0].metrics) == (4, 8, {"trainer/loss": 0.5})
    assert briefs[1].reason == "boom"
    record = await store.get(ids[0])
    [brief] = await store.briefs(["nope", ids[0]])
    assert (brief.job_id, brief.name, brief.submitted_at, brief.updated_at) == (
        record.job_id,
        record.name,
        record.submitted_at,
        record.updated_at,
    )
    assert await store.briefs([]) == []
    await store.redis.hdel(job_key(ids[0]), "name")  # a job stored before names were
    assert [brief.name for brief in await store.briefs([ids[0]])] == ["job0"]


async def test_the_list_digest_changes_with_every_write_of_a_listed_job(store: JobStore, bus: Bus) -> None:
    ids = [(await store.create(JobSpec(name=f"job{i}"))).job_id for i in range(3)]
    control = JobStreams(ids[2]).control
    await bus.ensure_group(control, CONTROLLER_GROUP)
    signal = common_pb2.TrainerSignal(job_id=ids[2])
    signal.groups_dropped.stale = 1
    entry = await bus.publish(control, signal)
    await bus.read(control, CONTROLLER_GROUP, "c", common_pb2.TrainerSignal, block_ms=100)
    task = common_pb2.PromptTask(prompt_id=f"{ids[1]}:0:0", job_id=ids[1])
    writes: dict[str, Callable[[], Awaitable[Any]]] = {
        "state": lambda: store.set_state(ids[1], RUNNING),
        "progress": lambda: store.update_progress(ids[2], 3, 3),
        "metrics": lambda: store.merge_metrics(ids[2], {"loss": 0.5}, step=3, source="trainer"),
        "prompts": lambda: store.publish_prompts(ids[1], [task], batches=1, extra=0),
        "dropped": lambda: store.count_dropped(ids[2], entry, 1),
        "a new job": lambda: store.create(JobSpec(name="job3")),
    }
    digest = await store.list_digest(limit=2)
    await store.list_briefs(limit=2)
    await store.set_state(ids[0], FAILED)  # not among the newest two
    assert await store.list_digest(limit=2) == digest, "reads and jobs beyond the limit change nothing"
    for what, write in writes.items():
        await write()
        assert await store.list_digest(limit=2) != digest, what
        digest = await store.list_digest(limit=2)
    assert await store.update_progress(ids[2], 2, 2) is False
    assert await store.list_digest(limit=2) == digest, "a write that changes nothing"


async def test_the_overview_of_active_jobs_says_whose_trainer_has_spoken(store: JobStore, bus: Bus) -> None:
    ids = [(await store.create(JobSpec(name=f"job{i}"))).job_id for i in range(4)]
    await store.set_state(ids[1], RUNNING)
    await store.set_state(ids[3], CANCELLED, "user")
    await bus.publish(JobStreams(ids[1]).checkpoints, common_pb2.CheckpointHandle(job_id=ids[1]))
    await bus.publish(JobStreams(ids[2]).status, common_pb2.JobStatus(job_id=ids[2]))
    await bus.ensure_group(JobStreams(ids[0]).checkpoints, CONTROLLER_GROUP)  # an empty stream
    overview = await store.active_overview()
    assert [(job.job_id, job.state, job.trainer_reported) for job in overview] == [
        (ids[0], QUEUED, False),
        (ids[1], RUNNING, True),
        (ids[2], QUEUED, True),
    ]
    assert overview[0].submitted_at == (await store.get(ids[0])).submitted_at


async def test_states_and_specs_are_read_through_the_store(store: JobStore) -> None:
    spec = JobSpec.model_validate({"name": "addition", "rollout": {"weight_update": "abort"}})
    job_id = (await store.create(spec)).job_id
    assert await store.state(job_id) == QUEUED and not await store.is_terminal(job_id)
    assert await store.spec(job_id) == spec
    assert await store.state("nope") is None and not await store.is_terminal("nope")
    with pytest.raises(JobNotFoundError):
        await store.spec("nope")
    await store.set_state(job_id, CANCELLED, "user")
    assert await store.state(job_id) == CANCELLED and await store.is_terminal(job_id)


async def test_running_job_ids_are_oldest_first(store: JobStore) -> None:
    ids = [(await store.create(JobSpec())).job_id for _ in range(3)]
    for job_id in reversed(ids):
        await store.set_state(job_id, RUNNING)
    await store.set_state(ids[1], FAILED, "boom")
    assert await store.running_job_ids() == [ids[0], ids[2]]
    assert [r.job_id for r in await store.running_jobs()] == [ids[0], ids[2]]


def test_specs_and_submissions_decode_with_the_bad_fields_named() -> None:
    spec = JobSpec.model_validate({"name": "addition", "trainer": {"steps": 3}})
    assert decode_spec(spec.model_dump_json()) == spec
    assert decode_submission(submission("j", spec)) == ("j", spec)
    with pytest.raises(JobSpecError, match=r"spec of job j:\n  trainer\.steps: "):
        decode_submission(common_pb2.JobSubmission(job_id="j", spec_json='{"trainer": {"steps": -1}}'))
    with pytest.raises(JobSpecError, match=r"\(json\): "):
        decode_spec("{not json")
    with pytest.raises(JobSpecError, match="job_id"):
        decode_submission(submission("", spec))


async def test_prompts_and_issued_counts_are_written_together(store: JobStore, bus: Bus) -> None:
    job_id = (await store.create(JobSpec())).job_id
    tasks = [common_pb2.PromptTask(prompt_id=f"{job_id}:0:{i}", job_id=job_id) for i in range(2)]
    await store.publish_prompts(job_id, tasks, batches=1, extra=0)
    await store.publish_prompts(job_id, tasks[:1], batches=1, extra=1)
    published = await stream_messages(bus, JobStreams(job_id).prompts, common_pb2.PromptTask)
    assert [t.prompt_id for t in published] == [tasks[0].prompt_id, tasks[1].prompt_id, tasks[0].prompt_id]
    record = await store.get(job_id)
    assert (record.issued_batches, record.issued_extra) == (1, 1)


async def test_metric_rows_merge_in_order_and_are_acked_with_the_merge(store: JobStore, bus: Bus) -> None:
    """The controller merges what one read of the metrics stream brought in one transaction that
    also acks those entries: a row is never merged without its ack, nor acked unmerged."""
    job_id = (await store.create(JobSpec())).job_id
    stream = JobStreams(job_id).metrics
    await bus.ensure_group(stream, CONTROLLER_GROUP)
    for step in (1, 2):
        await bus.publish_metric(job_id, "trainer", {"loss": 1.0 / step}, step=step, policy_version=step)
    read = await bus.read(stream, CONTROLLER_GROUP, "c", common_pb2.Metric, count=10, block_ms=100)
    rows = [MetricRow(d.message.step, d.message.policy_version, d.message.source, dict(d.message.values), 0.0)
            for d in read]  # fmt: skip
    rows.append(MetricRow(2, 2, "rollout", {"weight_sync_latency_s": 0.01}, 0.0))
    assert await bus.pending_count(stream, CONTROLLER_GROUP) == 2
    await store.merge_metric_rows(job_id, rows, acked=[d.entry_id for d in read])
    assert await bus.pending_count(stream, CONTROLLER_GROUP) == 0
    record = await store.get(job_id)
    assert record.metrics == {"trainer/loss": 0.5, "rollout/weight_sync_latency_s": 0.01}
    assert [(r.source, r.step) for r in await store.history(job_id)] == [
        ("trainer", 1), ("trainer", 2), ("rollout", 2)
    ]  # fmt: skip
    with pytest.raises(JobNotFoundError):
        await store.merge_metric_rows("nope-00000000", rows, acked=["1-0"])


async def test_a_batch_and_its_issue_lag_metric_go_out_together(store: JobStore, bus: Bus) -> None:
    job_id = (await store.create(JobSpec())).job_id
    tasks = [common_pb2.PromptTask(prompt_id=f"{job_id}:0:0", job_id=job_id)]
    lag = common_pb2.Metric(job_id=job_id, source="controller", step=3, values={"issue_lag_s": 0.02})
    await store.publish_prompts(job_id, tasks, batches=1, extra=0, metric=lag)
    [metric] = await stream_messages(bus, JobStreams(job_id).metrics, common_pb2.Metric)
    assert metric == lag
    assert len(await stream_messages(bus, JobStreams(job_id).prompts, common_pb2.PromptTask)) == 1


async def test_dropped_groups_are_counted_once_per_control_entry(store: JobStore, bus: Bus) -> None:
    """The count and the ack are one step: a redelivered entry (the controller died before
    acking, or two controllers race) is not counted again, and nothing is acked uncounted."""
    job_id = (await store.create(JobSpec())).job_id
    stream = JobStreams(job_id).control
    await bus.ensure_group(stream, CONTROLLER_GROUP)
    signals = [common_pb2.TrainerSignal(job_id=job_id) for _ in range(2)]
    for signal in signals:
        signal.groups_dropped.stale = 1
    first, second = await bus.publish_many(stream, signals)
    await bus.read(stream, CONTROLLER_GROUP, "c", common_pb2.TrainerSignal, block_ms=100)
    assert await store.count_dropped(job_id, first, 2) == 2
    assert await store.count_dropped(job_id, first, 2) == 2, "counted once"
    assert await bus.pending_count(stream, CONTROLLER_GROUP) == 1
    assert await store.count_dropped(job_id, second, 3) == 5
    assert await bus.pending_count(stream, CONTROLLER_GROUP) == 0
    assert (await store.get(job_id)).dropped_groups == 5
    with pytest.raises(JobNotFoundError):
        await store.count_dropped("nope", first, 1)
