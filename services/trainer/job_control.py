"""Stopping a trainer's running job: why it stops (``StopKind``), the request (``JobStopped``),
and ``JobControl``, which the job checks between steps and between reads."""

from __future__ import annotations

import asyncio
import enum


class StopKind(enum.Enum):
    SHUTDOWN = "shutdown"
    """The process is stopping: leave the job unacked for another trainer."""
    LOST = "lost"
    """Another trainer holds the job now: leave it."""
    REQUESTED = "requested"
    """Stop RPC: report the job CANCELLED and ack it."""
    ENDED_ELSEWHERE = "ended elsewhere"
    """The job store says the job is over (cancelled by the api, say): ack it quietly."""


class JobStopped(Exception):
    def __init__(self, kind: StopKind, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


class CheckpointUnavailable(Exception):
    """The job has no checkpoint of its current weights (it is still loading, or failed to)."""


class JobControl:
    """Stop requests for the running job, checked between steps and between reads."""

    def __init__(self, shutdown: asyncio.Event) -> None:
        self.shutdown = shutdown
        self._stop: JobStopped | None = None

    def stop(self, stop: JobStopped) -> None:
        if self._stop is None:
            self._stop = stop

    @property
    def stopping(self) -> bool:
        return self._stop is not None or self.shutdown.is_set()

    def check(self) -> None:
        if self.shutdown.is_set():
            raise JobStopped(StopKind.SHUTDOWN, "the trainer is shutting down")
        if self._stop is not None:
            raise self._stop
