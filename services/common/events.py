"""A job's event log: what happened to it, in order, for ``GET /v1/jobs/{id}/events``.

One Redis stream per job, ``verst:job:{id}:events`` (streams.py), of ``JobEvent`` entries in the
bus's encoding. The owners of each fact append it where it happens, in the same step as the fact
where they can:

- state changes: the job store (jobs.py), in the script that applies the change, so that no change
  is missed and none is logged that did not happen (a job's stream ends with its terminal state);
- each step's metrics and each evaluation's result (source ``eval``): the job store, in the MULTI
  that merges them into the job record, so each is logged once;
- dead letters and warnings (an evaluation lost or missed): the controller, as it handles them
  (a dead letter redelivered after a controller crash may be logged twice).

Event ids are the stream's entry ids: a reader resumes after the last id it saw (the SSE
``Last-Event-ID``) and gets exactly the entries after it. The stream is capped at about
``maxlen`` entries (``MAXLEN ~``: Redis trims whole nodes, so it may hold a node's worth more); a
reader further behind than that misses the oldest. No consumer group reads it, and any number of
readers may.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import redis.asyncio as aioredis

from services.common.bus import encode
from services.common.payloads import decode_entry
from services.common.pb import common_pb2
from services.common.streams import JobStreams

log = logging.getLogger(__name__)

DEFAULT_EVENTS_MAXLEN = 20_000
"""Approximate cap on a job's event log (VERST_EVENTS_MAXLEN)."""
EVAL_SOURCE = "eval"
"""The metric source of evaluation results: their rows are ``evaluation`` events."""
EVENT_ID = re.compile(r"^\d{1,20}-\d{1,20}$")
"""A stream entry id, as readers send it back (``Last-Event-ID``)."""
START = "0-0"
"""Read from the first event."""
_TERMINAL = frozenset(
    {common_pb2.JOB_STATE_SUCCEEDED, common_pb2.JOB_STATE_FAILED, common_pb2.JOB_STATE_CANCELLED}
)


def _stamped(job_id: str, at: float | None) -> common_pb2.JobEvent:
    event = common_pb2.JobEvent(job_id=job_id)
    if at is None:
        event.time.GetCurrentTime()
    else:
        event.time.FromNanoseconds(int(at * 1e9))
    return event


def state_event(job_id: str, state: str, reason: str, at: float | None = None) -> common_pb2.JobEvent:
    """The job moved to ``state`` (a JobState name) at unix time ``at`` (default: now)."""
    event = _stamped(job_id, at)
    event.state.state = common_pb2.JobState.Value(state)
    event.state.reason = reason
    return event


def metrics_event(
    job_id: str, *, source: str, step: int, policy_version: int, values: Mapping[str, float], at: float
) -> common_pb2.JobEvent:
    """One metric row merged into the job record: an ``evaluation`` event for source ``eval``."""
    event = _stamped(job_id, at)
    metric = event.evaluation if source == EVAL_SOURCE else event.metrics
    metric.job_id, metric.source, metric.step, metric.policy_version = job_id, source, step, policy_version
    metric.values.update(values)
    metric.time.CopyFrom(event.time)
    return event


def warning_event(job_id: str, text: str) -> common_pb2.JobEvent:
    """Something the job's owner should know that does not change its state."""
    event = _stamped(job_id, None)
    event.warning = text
    return event


def dead_letter_event(job_id: str, letter: common_pb2.DeadLetter) -> common_pb2.JobEvent:
    """A dead letter of the job, without the entry's bytes (they stay on its dead-letter stream)."""
    event = _stamped(job_id, None)
    event.dead_letter.CopyFrom(letter)
    event.dead_letter.ClearField("payload")
    return event


@dataclass(frozen=True, slots=True)
class Event:
    """One entry of a job's event log."""

    id: str
    """Its stream entry id: read after it to resume."""
    message: common_pb2.JobEvent

    @property
    def kind(self) -> str:
        """``state``, ``metrics``, ``evaluation``, ``warning`` or ``dead_letter``."""
        return self.message.WhichOneof("event") or ""

    @property
    def terminal(self) -> bool:
        """The job reached a state it never leaves: its last event."""
        return self.kind == "state" and self.message.state.state in _TERMINAL

    def data(self) -> dict[str, Any]:
        """The event as JSON-ready data: id, job_id, time (unix seconds), kind, and its fields."""
        message = self.message
        data: dict[str, Any] = {
            "id": self.id,
            "job_id": message.job_id,
            "time": message.time.ToNanoseconds() / 1e9,
            "kind": self.kind,
        }
        if self.kind == "state":
            data |= {"state": common_pb2.JobState.Name(message.state.state), "reason": message.state.reason}
        elif self.kind in ("metrics", "evaluation"):
            metric = getattr(message, self.kind)
            values = {name: _finite(value) for name, value in sorted(metric.values.items())}
            data |= {
                "source": metric.source,
                "step": metric.step,
                "policy_version": metric.policy_version,
                "values": values,
            }
        elif self.kind == "warning":
            data["message"] = message.warning
        elif self.kind == "dead_letter":
            letter = message.dead_letter
            data |= {
                "source_stream": letter.source_stream,
                "entry_id": letter.entry_id,
                "reason": letter.reason,
                "payload_type": letter.payload_type,
                "delivery_count": letter.delivery_count,
            }
        return data


def log_line(data: Mapping[str, Any]) -> str:
    """An event's ``data()`` as one line of a job's log: UTC time, kind, what happened."""
    at = datetime.fromtimestamp(float(data.get("time", 0.0)), UTC).isoformat(timespec="milliseconds")
    kind = data.get("kind", "")
    if kind == "state":
        what = str(data["state"]).removeprefix("JOB_STATE_").lower()
        what += f": {data['reason']}" if data.get("reason") else ""
    elif kind in ("metrics", "evaluation"):
        values = " ".join(
            f"{name}={'nan' if value is None else f'{value:.6g}'}" for name, value in data["values"].items()
        )
        what = f"{data['source']} step {data['step']} v{data['policy_version']}: {values}"
    elif kind == "warning":
        what = str(data["message"])
    elif kind == "dead_letter":
        what = (
            f"from {data['source_stream']} (entry {data['entry_id']}, delivered {data['delivery_count']}"
            f" times): {data['reason']}"
        )
    else:
        what = ""
    return f"{at.replace('+00:00', 'Z')} {kind} {what}".rstrip()


def _finite(value: float) -> float | None:
    """JSON has no NaN or infinity: such a value is null."""
    return value if math.isfinite(value) else None


class EventLog:
    """Append to and read jobs' event logs. ``redis`` is a client from ``bus.connect`` (or the
    api's pool for readers)."""

    def __init__(self, redis: aioredis.Redis, *, maxlen: int = DEFAULT_EVENTS_MAXLEN) -> None:
        if maxlen < 1:
            raise ValueError(f"maxlen must be >= 1, not {maxlen}")
        self.redis = redis
        self.maxlen = maxlen

    def add(self, pipe: Any, event: common_pb2.JobEvent) -> None:
        """Queue the append of ``event`` on ``pipe`` (a pipeline or MULTI of the caller's, so the
        event is logged with the fact it reports)."""
        pipe.xadd(JobStreams(event.job_id).events, encode(event), maxlen=self.maxlen, approximate=True)

    def script_args(self, event: common_pb2.JobEvent) -> tuple[str, list[Any]]:
        """For a Lua script that logs ``event`` with the fact: the stream's key, and the arguments
        ``maxlen, field, value, field, value`` of ``XADD key MAXLEN ~ maxlen * field value ...``."""
        fields = [item for pair in encode(event).items() for item in pair]
        return JobStreams(event.job_id).events, [self.maxlen, *fields]

    async def append(self, event: common_pb2.JobEvent) -> str:
        """Append one event on its own; returns its id."""
        key = JobStreams(event.job_id).events
        entry_id = await self.redis.xadd(key, encode(event), maxlen=self.maxlen, approximate=True)
        return entry_id.decode()

    async def tail(self, job_id: str, count: int) -> list[Event]:
        """The newest ``count`` events, oldest first (bad entries passed over, as ``read`` does)."""
        key = JobStreams(job_id).events
        return _decoded(key, reversed(await self.redis.xrevrange(key, count=count)))

    async def read(
        self, job_id: str, after: str = START, *, count: int = 100, block_ms: int | None = None
    ) -> list[Event]:
        """Up to ``count`` events after the id ``after``, oldest first; with ``block_ms``, waits
        that long for one when there is none yet (below the client's socket timeout). An entry
        that is not a good JobEvent is passed over (logged), never returned."""
        if not EVENT_ID.match(after):
            raise ValueError(f"not an event id: {after!r:.60}")
        key = JobStreams(job_id).events
        reply = await self.redis.xread({key: after}, count=count, block=block_ms)
        return _decoded(key, reply[0][1] if reply else [])


def _decoded(key: str, entries: Iterable[tuple[bytes, dict[bytes, bytes]]]) -> list[Event]:
    """The good JobEvents of these stream entries, in order; a bad entry is passed over (logged)."""
    events = []
    for raw_id, fields in entries:
        message, reason = decode_entry(fields, common_pb2.JobEvent, key)
        if message is None:
            log.warning("%s: passed over event %s: %s", key, raw_id.decode(), reason)
            continue
        events.append(Event(raw_id.decode(), message))
    return events
