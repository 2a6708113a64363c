"""What a stream entry must hold to be handed to a consumer: the checks of every consuming read.

An entry has two fields: ``t``, the proto's full name, and ``d``, its bytes. Decoding alone
proves little: protobuf's parser is lenient, so the bytes of one message type often decode as
another (a PromptTask's bytes read as a Trajectory give it an id, a job and a group), and fields
the schema does not have are kept aside rather than refused. So ``decode_entry``, which
``Bus.read``, ``Bus.reclaim`` and ``Bus.latest`` use for every entry, also refuses a payload
that holds fields its schema lacks (at any depth), and one that fails its type's check.

The checks are one registry, ``PAYLOAD_CHECKS``, keyed by the message's full name: each is a
short function of the message and the job of the stream it came from (None for a stream outside
a job) that returns what is wrong, or None. A type without a check is held to its schema only.
Every service runs the same schema, so a field this code does not know means a wrong payload,
not a newer producer.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from google.protobuf.descriptor import Descriptor
from google.protobuf.message import DecodeError, Message
from google.protobuf.unknown_fields import UnknownFieldSet

from services.common.pb import common_pb2
from services.common.registry import Entry, Registry
from services.common.streams import job_of_stream

M = TypeVar("M", bound=Message)
PayloadCheck = Callable[[Any, str | None], str | None]
"""(message, the stream's job or None) -> what is wrong with it, or None."""

TYPE_FIELD = b"t"
DATA_FIELD = b"d"
_SHOWN_FIELDS = 8
"""Unknown field paths named in a reason, at most."""
_SINGLE, _REPEATED, _MAP = "single", "repeated", "map"
"""How a field holds messages (``_message_fields``)."""

PAYLOAD_CHECKS: Registry[Entry[PayloadCheck]] = Registry(
    Entry, kind="payload check", field="payload type", owner="bus"
)


def _check(message_type: type[Message]) -> Callable[[PayloadCheck], PayloadCheck]:
    return PAYLOAD_CHECKS.register(message_type.DESCRIPTOR.full_name)


def unknown_fields(message: Message, prefix: str = "") -> list[str]:
    """Paths of the fields ``message`` holds that its schema lacks ("5", "stages.9", ...)."""
    found = _own_unknown(message, prefix)
    for name, shape, leaf in _message_fields(message.DESCRIPTOR):
        value = getattr(message, name)  # an unset message reads as an empty default: no HasField
        items = (value,) if shape == _SINGLE else value.values() if shape == _MAP else value
        for item in items:
            found += (
                _own_unknown(item, f"{prefix}{name}.") if leaf else unknown_fields(item, f"{prefix}{name}.")
            )
    return found


def _own_unknown(message: Message, prefix: str) -> list[str]:
    unknown = UnknownFieldSet(message)
    return [f"{prefix}{field.field_number}" for field in unknown] if len(unknown) else []


@functools.cache
def _message_fields(descriptor: Descriptor) -> tuple[tuple[str, str, bool], ...]:
    """The fields of a message type that hold messages: how (one, repeated, or map values), and
    whether that type holds no messages itself (a leaf: its own unknown fields are all it can
    have; most payloads' messages are Timestamps and StageTimes, checked without a recursion)."""
    fields = []
    for field in descriptor.fields:
        kind = field.message_type
        if kind is None:
            continue
        if kind.GetOptions().map_entry:
            kind = kind.fields_by_name["value"].message_type
            if kind is not None:
                fields.append((field.name, _MAP, _is_leaf(kind)))
        else:
            shape = _REPEATED if field.is_repeated else _SINGLE
            fields.append((field.name, shape, _is_leaf(kind)))
    return tuple(fields)


def _is_leaf(descriptor: Descriptor) -> bool:
    return all(field.message_type is None for field in descriptor.fields)


def payload_problem(message: Message, stream: str) -> str | None:
    """What is wrong with a decoded payload read from ``stream``, or None when nothing is."""
    unknown = unknown_fields(message)
    if unknown:
        shown = ", ".join(unknown[:_SHOWN_FIELDS]) + (", ..." if len(unknown) > _SHOWN_FIELDS else "")
        return f"fields not in its schema ({shown}): the bytes of another type?"
    name = message.DESCRIPTOR.full_name
    if name not in PAYLOAD_CHECKS:
        return None
    return PAYLOAD_CHECKS.get(name).fn(message, job_of_stream(stream))


def decode_entry(fields: Mapping[bytes, bytes], message_type: type[M], stream: str) -> tuple[M | None, str]:
    """The entry's message and "", or None and why it is not a good ``message_type`` payload."""
    expected = message_type.DESCRIPTOR.full_name
    payload_type = fields.get(TYPE_FIELD, b"").decode(errors="replace")
    if payload_type != expected:
        return None, f"payload type {payload_type!r} is not the expected {expected!r}"
    try:
        message = message_type.FromString(fields.get(DATA_FIELD, b""))
    except DecodeError as err:
        return None, f"undecodable {expected} payload: {err}"
    problem = payload_problem(message, stream)
    if problem:
        return None, f"invalid {expected} payload: {problem}"
    return message, ""


# -- the checks, by payload type ------------------------------------------------------------------


def _job_problem(job_id: str, stream_job: str | None) -> str | None:
    if not job_id:
        return "no job_id"
    if stream_job is not None and job_id != stream_job:
        return f"job_id {job_id!r} is not the stream's job {stream_job!r}"
    return None


@_check(common_pb2.PromptTask)
def _prompt_task(task: common_pb2.PromptTask, stream_job: str | None) -> str | None:
    if not task.prompt_id:
        return "no prompt_id"
    return _job_problem(task.job_id, stream_job)


@_check(common_pb2.Trajectory)
def _trajectory(trajectory: common_pb2.Trajectory, stream_job: str | None) -> str | None:
    """Enough to file it in a group; what makes a group untrainable is the trainer's check
    (``collector.trajectory_problem``), which drops the whole group."""
    if not trajectory.id:
        return "no id"
    if not trajectory.group_id:
        return "no group_id"
    return _job_problem(trajectory.job_id, stream_job)


@_check(common_pb2.CheckpointHandle)
def _checkpoint_handle(handle: common_pb2.CheckpointHandle, stream_job: str | None) -> str | None:
    if not handle.uri:
        return "no uri"
    if handle.version < 0:
        return f"version {handle.version} is negative"
    return _job_problem(handle.job_id, stream_job)


@_check(common_pb2.JobStatus)
def _job_status(status: common_pb2.JobStatus, stream_job: str | None) -> str | None:
    if status.state not in common_pb2.JobState.values():
        return f"state {status.state} is not a JobState"
    return _job_problem(status.job_id, stream_job)


@_check(common_pb2.TrainerSignal)
def _trainer_signal(signal: common_pb2.TrainerSignal, stream_job: str | None) -> str | None:
    if signal.WhichOneof("signal") is None:
        return "carries no signal"
    return _job_problem(signal.job_id, stream_job)


class NonFiniteMetricError(ValueError):
    """A metric value is NaN or infinite: refused where it is made and where it is kept."""


def non_finite_metrics(source: str, values: Mapping[str, float]) -> str | None:
    """Which of a metric row's values are not finite numbers (JSON, the charts and the trackers
    have no NaN or infinity), named as ``source/name=value``; None when all are."""
    bad = [f"{source}/{name}={value}" for name, value in sorted(values.items()) if not math.isfinite(value)]
    return f"metric values must be finite numbers, not {', '.join(bad)}" if bad else None


@_check(common_pb2.Metric)
def _metric(metric: common_pb2.Metric, stream_job: str | None) -> str | None:
    return _job_problem(metric.job_id, stream_job) or non_finite_metrics(metric.source, metric.values)


@_check(common_pb2.DeadLetter)
def _dead_letter(letter: common_pb2.DeadLetter, stream_job: str | None) -> str | None:
    if not letter.source_stream:
        return "no source_stream"
    source_job = job_of_stream(letter.source_stream)
    if stream_job is not None and source_job != stream_job:
        return f"source stream {letter.source_stream!r} is not a stream of job {stream_job!r}"
    return None


@_check(common_pb2.JobEvent)
def _job_event(event: common_pb2.JobEvent, stream_job: str | None) -> str | None:
    if event.WhichOneof("event") is None:
        return "carries no event"
    return _job_problem(event.job_id, stream_job)


@_check(common_pb2.JobSubmission)
def _job_submission(submission: common_pb2.JobSubmission, stream_job: str | None) -> str | None:
    return None if submission.job_id else "no job_id"
