"""Names of the Redis keys, streams and consumer groups: the one place they are spelled.

Every key carries a Redis Cluster hash tag (the part in braces), so that the keys a transaction
or script touches together live in one slot: each job's keys share the tag ``{<job id>}``
(``verst:job:{<id>}:prompts``, ...), and the global keys share ``{global}``. A command over the
keys of several jobs is split by slot on a cluster (bus.read_many, the job store's reads).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

PREFIX = "verst"
GLOBAL = f"{PREFIX}:{{global}}"
"""Prefix of the keys that belong to no job: one hash tag, so one slot of a cluster."""
JOBS = f"{GLOBAL}:jobs"
"""Submitted jobs (JobSubmission); trainers claim them through a consumer group."""
DEAD = f"{GLOBAL}:dead"
"""Dead letters of streams that belong to no job (such as ``JOBS``)."""
JOB_INDEX = f"{GLOBAL}:jobs:index"
"""Sorted set of job ids by submission time."""
ACTIVE_JOBS = f"{GLOBAL}:jobs:active"
"""Set of the ids of jobs not yet in a terminal state (services/common/jobs.py)."""
ENGINES = f"{GLOBAL}:engines"
"""Hash: engine id -> serialized EngineInfo (the registry the router reads)."""
ENGINE_HEARTBEATS = f"{GLOBAL}:engines:heartbeat"
"""Sorted set: engine id -> unix time of its last heartbeat."""
SERVICE_RESTARTS = f"{GLOBAL}:services:restarts"
"""Hash: service name -> JSON restart record of a local stack (services/common/service_restarts.py)."""
_JOB_KEY = re.compile(rf"^{PREFIX}:job:\{{([^{{}}]+)\}}:[A-Za-z_]+$")


# Consumer groups: who reads which stream.
TRAINERS_GROUP = "trainers"
"""Trainers on `verst:jobs`: one trainer claims each job."""
TRAINER_GROUP = "trainer"
"""The trainer of a job on its trajectories stream."""
RUNNERS_GROUP = "runners"
"""Rollout runners on a job's prompts stream."""
CONTROLLER_GROUP = "controller"
"""The controller on a job's checkpoints, metrics, status, control and dead streams."""


def job_key(job_id: str) -> str:
    """Hash holding one job's record (read and written through services/common/jobs.py only);
    the job's other keys are ``job_key(id) + ":<kind>"``."""
    if not job_id or "{" in job_id or "}" in job_id:
        raise ValueError(f"job id {job_id!r} is empty or has a brace (it is the key's hash tag)")
    return f"{PREFIX}:job:{{{job_id}}}"


@dataclass(frozen=True, slots=True)
class JobStreams:
    """The streams of one job: ``verst:job:{<id>}:<kind>`` (one hash tag: one cluster slot)."""

    job_id: str

    def _key(self, kind: str) -> str:
        return f"{job_key(self.job_id)}:{kind}"

    @property
    def prompts(self) -> str:
        """PromptTasks from the controller to the rollout runners."""
        return self._key("prompts")

    @property
    def trajectories(self) -> str:
        """Trajectories from the runners to the trainer."""
        return self._key("trajectories")

    @property
    def checkpoints(self) -> str:
        """CheckpointHandles from the trainer to the engines."""
        return self._key("checkpoints")

    @property
    def metrics(self) -> str:
        """Metrics from every service to the api."""
        return self._key("metrics")

    @property
    def status(self) -> str:
        """JobStatus reports from the trainer (succeeded, failed) to the controller."""
        return self._key("status")

    @property
    def control(self) -> str:
        """TrainerSignals (such as groups dropped) from the trainer to the controller."""
        return self._key("control")

    @property
    def dead(self) -> str:
        """DeadLetters: entries of this job that could not be processed."""
        return self._key("dead")

    @property
    def events(self) -> str:
        """JobEvents: the job's event log (services/common/events.py), read by no consumer group
        (so not among ``every``, whose consumed entries housekeeping trims)."""
        return self._key("events")

    def every(self) -> tuple[str, ...]:
        """All the job's consumed streams (the event log is not one)."""
        return (
            self.prompts,
            self.trajectories,
            self.checkpoints,
            self.metrics,
            self.status,
            self.control,
            self.dead,
        )


@functools.lru_cache(maxsize=4096)  # asked for every entry read; a process reads few streams
def job_of_stream(stream: str) -> str | None:
    """The job a stream belongs to (``verst:job:{<id>}:<kind>``); None for other streams."""
    match = _JOB_KEY.match(stream)
    return match.group(1) if match else None


def dead_letter_stream(stream: str) -> str:
    """The dead-letter stream for entries of ``stream``: the job's own, else the global one (in
    the slot of the other global keys: a dead letter and its ack are one MULTI)."""
    job_id = job_of_stream(stream)
    return DEAD if job_id is None else JobStreams(job_id).dead
