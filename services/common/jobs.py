"""The job store: one Redis hash per job, an index by submit time, and a metrics history.

Keys (besides the streams of services/common/streams.py):

- ``verst:job:{<id>}`` (hash): spec_json, name, state (a JobState name such as
  ``"JOB_STATE_RUNNING"``), policy_version, step, reason, submitted_at and
  updated_at (unix seconds), metrics_json (the latest value of every metric,
  keyed ``"{source}/{name}"``, e.g. ``"eval/accuracy"``), issued_batches and
  issued_extra (how many prompt batches, and replacement prompts for dropped
  groups, the controller has published, so that a restarted controller carries
  on where its predecessor stopped) and dropped_groups (how many prompts' worth
  of work was lost: groups the trainer reported dropped, counted once per
  control-stream entry, and dead-lettered prompt tasks and trajectories,
  counted once per dead-letter entry; each wants a replacement prompt).
- ``verst:{global}:jobs:index`` (sorted set): job ids by submit time.
- ``verst:{global}:jobs:active`` (set): ids of the jobs that are not finished yet.
- ``verst:job:{<id>}:history`` (list): one JSON row per received Metric,
  ``{"step", "policy_version", "source", "values", "time"}``, oldest first,
  capped at ``HISTORY_LIMIT`` rows.

Only the api (and its controller) writes here; everyone may read, through this
module: no other code spells these keys or parses a JobSpec's JSON. Terminal
states are final: the state changes are checked and applied atomically in Redis.
Each state change and each merged metric row is logged on the job's event log
(services/common/events.py) in the same atomic step.

A job's keys share one hash tag and the global keys another (streams.py), so on Redis Cluster
each atomic step stays within one slot: a step over a job's keys and the global ones (create,
a terminal state leaving the active set) is two, the job's first; a read over many jobs is a
pipeline, which a cluster client splits by node.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from services.common import job_scripts
from services.common.bus import DEFAULT_MAXLEN, encode
from services.common.config import JobSpec, JobSpecError, parse_job_spec
from services.common.events import DEFAULT_EVENTS_MAXLEN, EventLog, metrics_event, state_event
from services.common.payloads import NonFiniteMetricError, non_finite_metrics
from services.common.pb import common_pb2
from services.common.redis_client import AsyncClient
from services.common.streams import ACTIVE_JOBS, CONTROLLER_GROUP, JOB_INDEX, JOBS, JobStreams, job_key

QUEUED = common_pb2.JobState.Name(common_pb2.JOB_STATE_QUEUED)
RUNNING = common_pb2.JobState.Name(common_pb2.JOB_STATE_RUNNING)
SUCCEEDED = common_pb2.JobState.Name(common_pb2.JOB_STATE_SUCCEEDED)
FAILED = common_pb2.JobState.Name(common_pb2.JOB_STATE_FAILED)
CANCELLED = common_pb2.JobState.Name(common_pb2.JOB_STATE_CANCELLED)
TERMINAL_STATES = frozenset({SUCCEEDED, FAILED, CANCELLED})
"""States a job never leaves."""
JOB_STATES = (QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED)
"""Every state a job record can be in, in lifecycle order."""

HISTORY_LIMIT = 100_000
"""Rows kept in a job's metrics history (the oldest are dropped first)."""


def job_history_key(job_id: str) -> str:
    """List of a job's metric rows (JSON), oldest first."""
    return f"{job_key(job_id)}:history"


class JobNotFoundError(KeyError):
    """No job has this id."""


def decode_spec(spec_json: str | bytes, source: str = "job spec") -> JobSpec:
    """The JobSpec a JSON text holds; raises JobSpecError naming each bad field."""
    try:
        data = json.loads(spec_json)
    except ValueError as err:  # json.JSONDecodeError, UnicodeDecodeError
        raise JobSpecError([("(json)", str(err))], source) from None
    return parse_job_spec(data, source)


def submission(job_id: str, spec: JobSpec, submitted_at: float | None = None) -> common_pb2.JobSubmission:
    """The JobSubmission of a job (the payload of ``verst:jobs``)."""
    message = common_pb2.JobSubmission(job_id=job_id, spec_json=spec.model_dump_json())
    message.submitted_at.FromNanoseconds(int((time.time() if submitted_at is None else submitted_at) * 1e9))
    return message


def decode_submission(message: common_pb2.JobSubmission) -> tuple[str, JobSpec]:
    """The job id and JobSpec of a JobSubmission; raises JobSpecError (the id is missing or
    the spec invalid)."""
    if not message.job_id:
        raise JobSpecError([("job_id", "JobSubmission has no job_id")], "job submission")
    return message.job_id, decode_spec(message.spec_json, f"spec of job {message.job_id}")


@dataclass(frozen=True, slots=True)
class JobBrief:
    """A job as lists and metrics show it: its name but not its spec (which is not read)."""

    job_id: str
    name: str
    state: str
    """A JobState name, e.g. "JOB_STATE_RUNNING"."""
    policy_version: int
    step: int
    reason: str
    submitted_at: float
    """Unix seconds."""
    updated_at: float
    metrics: dict[str, float]
    """Latest value of every metric, keyed "{source}/{name}"."""

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    @classmethod
    def from_values(cls, job_id: str, values: Sequence[bytes | None]) -> JobBrief:
        """From the hash's BRIEF_FIELDS, in their order."""
        name, state, version, step, reason, submitted, updated, metrics = (
            (value or b"").decode() for value in values
        )
        return cls(
            job_id, name, state, int(version or 0), int(step or 0), reason, float(submitted or 0),
            float(updated or 0), json.loads(metrics or "{}"),
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class JobRecord(JobBrief):
    """One job as stored."""

    spec: JobSpec
    issued_batches: int
    """Prompt batches the controller has published."""
    issued_extra: int
    """Replacement prompts the controller has published for groups the trainer dropped."""
    dropped_groups: int
    """Groups the trainer reported dropped, and dead-lettered prompt tasks and trajectories
    (each wants a replacement prompt)."""

    @classmethod
    def from_hash(cls, job_id: str, fields: Mapping[bytes, bytes]) -> JobRecord:
        text = {key.decode(): value.decode() for key, value in fields.items()}
        spec = decode_spec(text["spec_json"], f"spec of job {job_id}")
        return cls(
            job_id=job_id,
            name=spec.name,
            state=text["state"],
            policy_version=int(text.get("policy_version", 0)),
            step=int(text.get("step", 0)),
            reason=text.get("reason", ""),
            submitted_at=float(text["submitted_at"]),
            updated_at=float(text["updated_at"]),
            metrics=json.loads(text.get("metrics_json", "{}")),
            spec=spec,
            issued_batches=int(text.get("issued_batches", 0)),
            issued_extra=int(text.get("issued_extra", 0)),
            dropped_groups=int(text.get("dropped_groups", 0)),
        )


BRIEF_FIELDS = ("name", "state", "policy_version", "step", "reason", "submitted_at", "updated_at",
                "metrics_json")  # fmt: skip
"""The hash fields a JobBrief is read from."""


@dataclass(frozen=True, slots=True)
class ActiveJob:
    """What the controller reads of an unfinished job on every poll."""

    job_id: str
    state: str
    submitted_at: float
    trainer_reported: bool
    """The job's checkpoints or status stream has an entry: its trainer has spoken."""


@dataclass(frozen=True, slots=True)
class MetricRow:
    """One Metric as kept in a job's history."""

    step: int
    policy_version: int
    source: str
    values: dict[str, float]
    time: float

    def to_json(self) -> str:
        return json.dumps(
            {
                "step": self.step,
                "policy_version": self.policy_version,
                "source": self.source,
                "values": self.values,
                "time": self.time,
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, raw: bytes | str) -> MetricRow:
        row = json.loads(raw)
        return cls(row["step"], row["policy_version"], row["source"], row["values"], row["time"])


class JobStore:
    """Create, read and advance job records. ``redis`` is a client from ``bus.connect``."""

    def __init__(
        self,
        redis: AsyncClient,
        *,
        history_limit: int = HISTORY_LIMIT,
        events_maxlen: int = DEFAULT_EVENTS_MAXLEN,
    ) -> None:
        self.redis = redis
        self.history_limit = history_limit
        self.events = EventLog(redis, maxlen=events_maxlen)
        self._set_state = redis.register_script(job_scripts.SET_STATE)
        self._progress = redis.register_script(job_scripts.PROGRESS)
        self._count_dropped = redis.register_script(job_scripts.COUNT_DROPPED)

    async def create(self, spec: JobSpec) -> JobRecord:
        """Store a QUEUED job, then index it and publish its JobSubmission on ``JOBS`` (two
        atomic steps, one per hash tag: a failure between leaves a record no list or trainer
        sees, and raises)."""
        job_id = f"{spec.name}-{uuid.uuid4().hex[:8]}"
        now = time.time()
        message = submission(job_id, spec, now)
        fields = {
            "spec_json": message.spec_json,
            "name": spec.name,
            "state": QUEUED,
            "policy_version": 0,
            "step": 0,
            "reason": "",
            "submitted_at": repr(now),
            "updated_at": repr(now),
            "metrics_json": "{}",
            "issued_batches": 0,
            "issued_extra": 0,
            "dropped_groups": 0,
        }
        record = self.redis.pipeline(transaction=True)
        record.hset(job_key(job_id), mapping=fields)
        self.events.add(record, state_event(job_id, QUEUED, "", now))
        await record.execute()
        listed = self.redis.pipeline(transaction=True)
        listed.zadd(JOB_INDEX, {job_id: now})
        listed.sadd(ACTIVE_JOBS, job_id)
        listed.xadd(JOBS, encode(message), maxlen=DEFAULT_MAXLEN)
        await listed.execute()
        return await self.get(job_id)

    async def get(self, job_id: str) -> JobRecord:
        """The job's record; raises JobNotFoundError."""
        fields = await self.redis.hgetall(job_key(job_id))
        if not fields:
            raise JobNotFoundError(job_id)
        return JobRecord.from_hash(job_id, fields)

    async def state(self, job_id: str) -> str | None:
        """The job's state (a JobState name); None when no job has this id."""
        state = await self.redis.hget(job_key(job_id), "state")
        return None if state is None else state.decode()

    async def is_terminal(self, job_id: str) -> bool:
        """True when the job has finished (succeeded, failed or cancelled); False when it has
        not, or no job has this id."""
        return await self.state(job_id) in TERMINAL_STATES

    async def spec(self, job_id: str) -> JobSpec:
        """The job's JobSpec; raises JobNotFoundError, or JobSpecError when it is unreadable."""
        spec_json = await self.redis.hget(job_key(job_id), "spec_json")
        if spec_json is None:
            raise JobNotFoundError(job_id)
        return decode_spec(spec_json, f"spec of job {job_id}")

    async def list(self, limit: int = 100) -> list[JobRecord]:
        """The newest ``limit`` jobs, newest first."""
        ids = [raw.decode() for raw in await self.redis.zrevrange(JOB_INDEX, 0, max(limit, 1) - 1)]
        return await self._records(ids)

    async def list_briefs(self, limit: int = 100) -> list[JobBrief]:
        """The newest ``limit`` jobs, newest first, without validating their specs (two round
        trips whatever ``limit``)."""
        ids = [raw.decode() for raw in await self.redis.zrevrange(JOB_INDEX, 0, max(limit, 1) - 1)]
        return await self.briefs(ids)

    async def list_digest(self, limit: int = 100) -> str:
        """A digest of what ``list_briefs(limit)`` would return now (two round trips, no record
        sent): the listed ids and the time each was last written (every write sets it), so it is
        unchanged while no job is added to those and none of them is written."""
        ids = [raw.decode() for raw in await self.redis.zrevrange(JOB_INDEX, 0, max(limit, 1) - 1)]
        rows = await self._fields(ids, ["updated_at"])
        pairs = zip(ids, rows, strict=True)
        text = ",".join(f"{job_id}={(updated or b'').decode()}" for job_id, (updated,) in pairs)
        return hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()

    async def briefs(self, ids: Sequence[str]) -> list[JobBrief]:
        """The briefs of the jobs ``ids`` that exist, in that order, in one round trip."""
        briefs = []
        for job_id, row in zip(ids, await self._fields(ids, BRIEF_FIELDS), strict=True):
            if row[1] is not None:  # the job exists
                row[0] = row[0] or (await self.spec(job_id)).name.encode()  # stored before names were
                briefs.append(JobBrief.from_values(job_id, row))
        return briefs

    async def active_overview(self) -> list[ActiveJob]:
        """Every unfinished job's state, submit time and whether its trainer has published a
        checkpoint or status yet, oldest first: two round trips whatever the number of jobs, and
        no spec read."""
        ids = [raw.decode() for raw in await self.redis.smembers(ACTIVE_JOBS)]
        if not ids:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for job_id in ids:
            pipe.hmget(job_key(job_id), ["state", "submitted_at"])
            pipe.xlen(JobStreams(job_id).checkpoints)
            pipe.xlen(JobStreams(job_id).status)
        values = await pipe.execute()
        jobs = [
            ActiveJob(job_id, state.decode(), float(submitted_at or 0.0), checkpoints + statuses > 0)
            for job_id, (state, submitted_at), checkpoints, statuses in zip(
                ids, values[0::3], values[1::3], values[2::3], strict=True
            )
            if state is not None and state.decode() not in TERMINAL_STATES
        ]
        return sorted(jobs, key=lambda job: (job.submitted_at, job.job_id))

    async def active_jobs(self) -> list[JobRecord]:
        """Jobs that are QUEUED or RUNNING, oldest first."""
        ids = [raw.decode() for raw in await self.redis.smembers(ACTIVE_JOBS)]
        records = await self._records(ids)
        return sorted((r for r in records if not r.terminal), key=lambda r: r.submitted_at)

    async def running_job_ids(self) -> list[str]:
        """Ids of the jobs in state RUNNING, oldest first (reads their states, not their specs)."""
        return [job.job_id for job in await self.active_overview() if job.state == RUNNING]

    async def running_jobs(self) -> list[JobRecord]:
        """Jobs in state RUNNING, oldest first."""
        records = await self._records(await self.running_job_ids())
        return [record for record in records if record.state == RUNNING]

    async def count_by_state(self) -> dict[str, int]:
        """How many jobs are in each state (every state is present, maybe with 0)."""
        ids = [raw.decode() for raw in await self.redis.zrange(JOB_INDEX, 0, -1)]
        counts = dict.fromkeys(JOB_STATES, 0)
        for (state,) in await self._fields(ids, ["state"]):
            if state is not None:
                counts[state.decode()] = counts.get(state.decode(), 0) + 1
        return counts

    async def set_state(self, job_id: str, state: str, reason: str = "") -> bool:
        """Move a job to ``state``; False (nothing changes) when the job already finished.
        A terminal state then leaves the active set (a second step: the set is a global key;
        readers of the set skip finished jobs, and a repeated call repairs a missed removal).

        Raises JobNotFoundError for an unknown job and ValueError for an unknown state.
        """
        if state not in JOB_STATES:
            raise ValueError(f"unknown job state {state!r}; expected one of {', '.join(JOB_STATES)}")
        terminal = state in TERMINAL_STATES
        now = time.time()
        events_key, event_args = self.events.script_args(state_event(job_id, state, reason, now))
        keys = [job_key(job_id), events_key]
        applied = await self._set_state(keys=keys, args=[state, reason, repr(now), *event_args])
        if applied == -1:
            raise JobNotFoundError(job_id)
        if terminal:
            await self.redis.srem(ACTIVE_JOBS, job_id)
        return applied == 1

    async def update_progress(self, job_id: str, policy_version: int, step: int) -> bool:
        """Record a new policy version and trainer step; False when older than the stored one."""
        args = [policy_version, step, repr(time.time())]
        applied = await self._progress(keys=[job_key(job_id)], args=args)
        if applied == -1:
            raise JobNotFoundError(job_id)
        return applied == 1

    async def publish_prompts(
        self,
        job_id: str,
        tasks: Sequence[common_pb2.PromptTask],
        *,
        batches: int,
        extra: int,
        metric: common_pb2.Metric | None = None,
    ) -> None:
        """Publish prompt tasks on the job's prompts stream and record that the controller has
        now issued ``batches`` prompt batches and ``extra`` replacement prompts, in one MULTI,
        so that a restarted controller neither repeats nor skips a prompt; ``metric`` goes on
        the job's metrics stream in the same round trip."""
        streams = JobStreams(job_id)
        fields = {"issued_batches": batches, "issued_extra": extra, "updated_at": repr(time.time())}
        pipe = self.redis.pipeline(transaction=True)
        for task in tasks:
            pipe.xadd(streams.prompts, encode(task), maxlen=DEFAULT_MAXLEN)
        pipe.hset(job_key(job_id), mapping=fields)
        if metric is not None:
            pipe.xadd(streams.metrics, encode(metric), maxlen=DEFAULT_MAXLEN)
        await pipe.execute()

    async def count_dropped(
        self, job_id: str, entry_id: str, groups: int, *, stream: str | None = None
    ) -> int:
        """Add ``groups`` dropped groups, reported by the entry ``entry_id`` of the job's control
        stream (or of ``stream``, its dead-letter stream), to the job's ``dropped_groups`` and ack
        that entry for the controller's group, atomically; an entry acked already is not counted
        again. Returns the job's new count."""
        keys = [job_key(job_id), stream or JobStreams(job_id).control]
        args = [CONTROLLER_GROUP, entry_id, groups, repr(time.time())]
        reply = await self._count_dropped(keys=keys, args=args)
        if reply == -1:
            raise JobNotFoundError(job_id)
        return int(reply[1])

    async def merge_metrics(
        self,
        job_id: str,
        values: Mapping[str, float],
        *,
        step: int,
        source: str,
        policy_version: int = 0,
    ) -> None:
        """Keep the latest value of each metric (as "{source}/{name}") and append a history row."""
        row = MetricRow(step, policy_version, source, {k: float(v) for k, v in values.items()}, time.time())
        await self.merge_metric_rows(job_id, [row])

    async def merge_metric_rows(
        self, job_id: str, rows: Sequence[MetricRow], *, acked: Sequence[str] = ()
    ) -> None:
        """``merge_metrics`` of several rows, in order, in one transaction; ``acked``: entries of
        the job's metrics stream that these rows came from, acked for the controller's group in
        the same MULTI, so that none is merged twice or acked unmerged. Raises
        NonFiniteMetricError, writing nothing, when a row holds NaN or an infinity."""
        for row in rows:
            if problem := non_finite_metrics(row.source, row.values):
                raise NonFiniteMetricError(f"job {job_id} step {row.step}: {problem}")
        key, history = job_key(job_id), job_history_key(job_id)

        async def merge(pipe: Any) -> None:
            current = await pipe.hget(key, "metrics_json")
            if current is None:
                raise JobNotFoundError(job_id)
            latest = json.loads(current)
            for row in rows:
                latest.update({f"{row.source}/{name}": value for name, value in row.values.items()})
            pipe.multi()
            updated = repr(max(row.time for row in rows))
            pipe.hset(key, mapping={"metrics_json": json.dumps(latest), "updated_at": updated})
            pipe.rpush(history, *(row.to_json() for row in rows))
            pipe.ltrim(history, -self.history_limit, -1)
            for row in rows:  # logged with the merge: each row once
                event = metrics_event(
                    job_id, source=row.source, step=row.step, policy_version=row.policy_version,
                    values=row.values, at=row.time,
                )  # fmt: skip
                self.events.add(pipe, event)
            if acked:
                pipe.xack(JobStreams(job_id).metrics, CONTROLLER_GROUP, *acked)

        if rows:
            await self.redis.transaction(merge, key)

    async def history(
        self, job_id: str, *, source: str | None = None, limit: int = 10_000
    ) -> list[MetricRow]:
        """The newest ``limit`` metric rows (optionally of one source), oldest first."""
        if not await self.redis.exists(job_key(job_id)):
            raise JobNotFoundError(job_id)
        if limit <= 0:
            return []
        first = 0 if source is not None else -limit  # one source's rows may lie anywhere
        rows = [
            MetricRow.from_json(raw) for raw in await self.redis.lrange(job_history_key(job_id), first, -1)
        ]
        if source is not None:
            rows = [row for row in rows if row.source == source]
        return rows[-limit:]

    async def _fields(self, ids: Sequence[str], fields: Sequence[str]) -> list[list[bytes | None]]:
        """The ``fields`` of each job's hash (None where missing), in one round trip."""
        if not ids:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for job_id in ids:
            pipe.hmget(job_key(job_id), list(fields))
        return [list(values) for values in await pipe.execute()]

    async def _records(self, ids: list[str]) -> list[JobRecord]:
        pipe = self.redis.pipeline(transaction=False)
        for job_id in ids:
            pipe.hgetall(job_key(job_id))
        return [
            JobRecord.from_hash(job_id, fields)
            for job_id, fields in zip(ids, await pipe.execute(), strict=True)
            if fields
        ]
