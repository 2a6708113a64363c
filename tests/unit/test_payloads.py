"""The payload checks every consuming read runs (services/common/payloads.py)."""

from __future__ import annotations

import pytest
from google.protobuf.message import Message

from services.common.bus import encode, metric_message
from services.common.payloads import (
    PAYLOAD_CHECKS,
    NonFiniteMetricError,
    decode_entry,
    payload_problem,
    unknown_fields,
)
from services.common.pb import common_pb2
from services.common.streams import JOBS, JobStreams

STREAMS = JobStreams("job-1")


def good_trajectory() -> common_pb2.Trajectory:
    return common_pb2.Trajectory(
        id="job-1:0:0:1", job_id="job-1", prompt_id="job-1:0:0", group_id="job-1:0:0"
    )


GOOD: list[tuple[Message, str]] = [
    (common_pb2.PromptTask(prompt_id="p", job_id="job-1", prompt_token_ids=[1]), STREAMS.prompts),
    (good_trajectory(), STREAMS.trajectories),
    (common_pb2.CheckpointHandle(job_id="job-1", version=0, uri="file:///c/v0"), STREAMS.checkpoints),
    (common_pb2.JobStatus(job_id="job-1", state=common_pb2.JOB_STATE_SUCCEEDED), STREAMS.status),
    (common_pb2.Metric(job_id="job-1", source="trainer", values={"loss": 0.5}), STREAMS.metrics),
    (common_pb2.DeadLetter(source_stream=STREAMS.prompts, reason="r"), STREAMS.dead),
    (common_pb2.JobSubmission(job_id="job-1", spec_json="{}"), JOBS),
    (common_pb2.JobEvent(job_id="job-1", warning="w"), STREAMS.events),
]


def signal() -> common_pb2.TrainerSignal:
    message = common_pb2.TrainerSignal(job_id="job-1")
    message.groups_dropped.stale = 1
    return message


@pytest.mark.parametrize(("message", "stream"), [*GOOD, (signal(), STREAMS.control)])
def test_what_verst_publishes_passes(message: Message, stream: str) -> None:
    assert payload_problem(message, stream) is None
    assert decode_entry(encode(message), type(message), stream) == (message, "")


def test_every_stream_payload_type_has_a_check() -> None:
    names = {type(message).DESCRIPTOR.full_name for message, _ in GOOD} | {"verst.v1.TrainerSignal"}
    assert set(PAYLOAD_CHECKS.names()) == names


@pytest.mark.parametrize(
    ("message", "stream", "problem"),
    [
        (common_pb2.PromptTask(job_id="job-1"), STREAMS.prompts, "no prompt_id"),
        (common_pb2.PromptTask(prompt_id="p"), STREAMS.prompts, "no job_id"),
        (
            common_pb2.PromptTask(prompt_id="p", job_id="job-2"),
            STREAMS.prompts,
            "job_id 'job-2' is not the stream's job 'job-1'",
        ),
        (common_pb2.Trajectory(job_id="job-1", group_id="g"), STREAMS.trajectories, "no id"),
        (common_pb2.Trajectory(id="t", job_id="job-1"), STREAMS.trajectories, "no group_id"),
        (common_pb2.CheckpointHandle(job_id="job-1"), STREAMS.checkpoints, "no uri"),
        (
            common_pb2.CheckpointHandle(job_id="job-1", uri="file:///x", version=-1),
            STREAMS.checkpoints,
            "version -1 is negative",
        ),
        (common_pb2.JobStatus(job_id="job-1", state=99), STREAMS.status, "state 99 is not a JobState"),
        (common_pb2.TrainerSignal(job_id="job-1"), STREAMS.control, "carries no signal"),
        (common_pb2.Metric(source="trainer"), STREAMS.metrics, "no job_id"),
        (
            common_pb2.Metric(job_id="job-1", source="trainer", values={"loss": float("nan"), "kl": 0.1}),
            STREAMS.metrics,
            "metric values must be finite numbers, not trainer/loss=nan",
        ),
        (
            common_pb2.Metric(job_id="job-1", source="eval", values={"a": float("inf"), "b": -float("inf")}),
            STREAMS.metrics,
            "metric values must be finite numbers, not eval/a=inf, eval/b=-inf",
        ),
        (common_pb2.DeadLetter(reason="r"), STREAMS.dead, "no source_stream"),
        (
            common_pb2.DeadLetter(source_stream=JobStreams("job-2").prompts),
            STREAMS.dead,
            "source stream 'verst:job:{job-2}:prompts' is not a stream of job 'job-1'",
        ),
        (common_pb2.JobSubmission(spec_json="{}"), JOBS, "no job_id"),
        (common_pb2.JobEvent(job_id="job-1"), STREAMS.events, "carries no event"),
        (
            common_pb2.JobEvent(job_id="job-2", warning="w"),
            STREAMS.events,
            "job_id 'job-2' is not the stream's job 'job-1'",
        ),
    ],
)
def test_a_bad_payload_is_named(message: Message, stream: str, problem: str) -> None:
    assert payload_problem(message, stream) == problem
    assert decode_entry(encode(message), type(message), stream) == (
        None,
        f"invalid {type(message).DESCRIPTOR.full_name} payload: {problem}",
    )


def test_outside_a_job_only_the_job_id_is_required() -> None:
    task = common_pb2.PromptTask(prompt_id="p", job_id="job-2")
    assert payload_problem(task, "verst:other") is None


def test_unknown_fields_are_found_at_any_depth() -> None:
    trajectory = good_trajectory()
    assert unknown_fields(trajectory) == []
    trajectory.MergeFromString(common_pb2.Metric(values={"a": 1.0}).SerializeToString())  # 5: an int there
    trajectory.stages.MergeFromString(common_pb2.PromptTask(prompt_id="x").SerializeToString())
    assert unknown_fields(trajectory) == ["5", "stages.1"]
    handle = common_pb2.CheckpointHandle(job_id="job-1", uri="file:///x")
    handle.broadcast.tensors.add(name="w").MergeFromString(common_pb2.Metric(step=3).SerializeToString())
    assert unknown_fields(handle) == ["broadcast.tensors.2"]
    problem = payload_problem(handle, STREAMS.checkpoints)
    assert problem == "fields not in its schema (broadcast.tensors.2): the bytes of another type?"


def test_decode_entry_names_the_type_and_decoding_problems() -> None:
    task = common_pb2.PromptTask(prompt_id="p", job_id="job-1")
    wrong = decode_entry(encode(task), common_pb2.Trajectory, STREAMS.trajectories)
    assert wrong == (None, "payload type 'verst.v1.PromptTask' is not the expected 'verst.v1.Trajectory'")
    message, reason = decode_entry(
        {b"t": b"verst.v1.Trajectory", b"d": b"\xff\xff"}, common_pb2.Trajectory, "s"
    )
    assert message is None and reason.startswith("undecodable verst.v1.Trajectory payload: ")
    labelled = {b"t": b"verst.v1.Trajectory", b"d": task.SerializeToString()}
    assert decode_entry(labelled, common_pb2.Trajectory, STREAMS.trajectories)[1].endswith("no group_id")


def test_a_producer_cannot_make_a_non_finite_metric() -> None:
    with pytest.raises(NonFiniteMetricError, match=r"job job-1 step 3: .* not trainer/loss=nan"):
        metric_message("job-1", "trainer", {"loss": float("nan"), "kl": 0.0}, step=3, policy_version=3)
    assert metric_message("job-1", "trainer", {"loss": 0.5}, step=3, policy_version=3).values["loss"] == 0.5


def test_unknown_fields_of_maps_and_repeated_messages_are_found() -> None:
    """Map values and repeated messages, leaves (their types hold no messages) or not."""
    metric = common_pb2.Metric(step=1)
    assert unknown_fields(metric) == []
    handle = common_pb2.CheckpointHandle(job_id="job-1", uri="file:///x")
    handle.broadcast.tensors.add(name="a")
    handle.broadcast.tensors.add(name="b").MergeFromString(common_pb2.Metric(step=3).SerializeToString())
    handle.created_at.MergeFromString(common_pb2.PromptTask(prompt_id="x").SerializeToString())
    assert unknown_fields(handle) == ["created_at.1", "broadcast.tensors.2"]
