"""Housekeeping of the streams: consumers that died leave their groups, consumed entries go.

Consumer names include host and pid (consumer.py), so every process that ever read a stream
stays a member of its group until removed. ``remove_dead_consumers`` removes the members that
hold no pending entries and have not touched the stream for ``dead_after_ms``: checked and
deleted in one Lua script, so that an entry delivered meanwhile keeps its consumer (a
consumer's pending entries would go with it). A live consumer removed while quiet comes back
on its next read. ``Bus.trim_consumed`` deletes what every group has delivered and acked.

One owner runs both: the controller, for each running job's streams every
``VERST_CONTROLLER_HOUSEKEEPING_S``, and once more, with ``verst:jobs``, when the job ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from redis.exceptions import RedisError, ResponseError

from services.common.bus import LATEST_SCAN, Bus
from services.common.jobs import JobStore
from services.common.streams import JOBS, JobStreams

log = logging.getLogger(__name__)

_REMOVE_IDLE_CONSUMERS = """
local removed = {}
for _, info in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local fields = {}
  for i = 1, #info, 2 do fields[info[i]] = info[i + 1] end
  if tonumber(fields['pending']) == 0 and tonumber(fields['idle']) >= tonumber(ARGV[2]) then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], fields['name'])
    table.insert(removed, fields['name'])
  end
end
return removed
"""
"""KEYS[1] stream, ARGV[1] group, ARGV[2] idle bound (ms): the names of the consumers removed."""


@dataclass(frozen=True, slots=True)
class Tidied:
    """What one pass over one stream did."""

    removed: tuple[str, ...] = ()
    """Consumers removed, as ``group/consumer``."""
    trimmed: int = 0
    """Entries deleted."""


async def remove_dead_consumers(bus: Bus, stream: str, *, dead_after_ms: int) -> list[str]:
    """Remove, from every group of ``stream``, the consumers with no pending entries that have
    been idle for at least ``dead_after_ms``; their ``group/consumer`` names."""
    removed: list[str] = []
    for info in await bus.redis.xinfo_groups(stream):
        group = info["name"].decode() if isinstance(info["name"], bytes) else info["name"]
        names = await bus.redis.eval(_REMOVE_IDLE_CONSUMERS, 1, stream, group, dead_after_ms)
        removed += [f"{group}/{name.decode() if isinstance(name, bytes) else name}" for name in names]
    return removed


async def tidy(bus: Bus, stream: str, *, dead_after_ms: int, trim: bool = True, keep: int = 0) -> Tidied:
    """Remove the dead consumers of ``stream``, then (``trim``) its consumed entries but the
    newest ``keep``; nothing when the stream does not exist (yet)."""
    try:
        removed = await remove_dead_consumers(bus, stream, dead_after_ms=dead_after_ms)
        trimmed = await bus.trim_consumed(stream, keep=keep) if trim else 0
    except ResponseError as err:
        if "no such key" in str(err).lower():
            return Tidied()
        raise
    if removed:
        log.info("%s: removed dead consumers %s", stream, ", ".join(removed))
    return Tidied(tuple(removed), trimmed)


async def tidy_job(bus: Bus, job_id: str, *, dead_after_ms: int, ended: bool = False) -> int:
    """``tidy`` every stream of the job and, once the job has ``ended``, ``verst:jobs``; entries
    deleted. The dead letters keep their entries (the record of what was lost), the checkpoints
    their newest LATEST_SCAN (engines and trainers read the newest good handle)."""
    streams = JobStreams(job_id)
    trimmed = 0
    for stream in [*streams.every(), *([JOBS] if ended else [])]:
        keep = LATEST_SCAN if stream == streams.checkpoints else 0
        done = await tidy(bus, stream, dead_after_ms=dead_after_ms, trim=stream != streams.dead, keep=keep)
        trimmed += done.trimmed
    return trimmed


async def tend_job(bus: Bus, job_id: str, every_s: float, dead_after_s: float, stop: asyncio.Event) -> None:
    """``tidy_job`` every ``every_s`` (0: never) until ``stop``; a pass that fails is logged and
    tried again. A consumer idle for ``dead_after_s`` with nothing pending has died."""
    while every_s > 0 and not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)
        if stop.is_set():
            return
        try:
            await tidy_job(bus, job_id, dead_after_ms=int(dead_after_s * 1000))
        except RedisError as err:
            log.warning("%s: housekeeping failed, trying again in %.0fs: %s", job_id, every_s, err)
        except Exception:  # a bug here must not stop the job's driver, which runs this beside it
            log.exception("%s: housekeeping failed unexpectedly, trying again in %.0fs", job_id, every_s)


async def tidy_ended_job(bus: Bus, store: JobStore, job_id: str, dead_after_s: float) -> None:
    """The last ``tidy_job``, once the job store has the job over (a failure is logged: the
    job's outcome stands)."""
    try:
        if not await store.is_terminal(job_id):
            return
        trimmed = await tidy_job(bus, job_id, dead_after_ms=int(dead_after_s * 1000), ended=True)
    except RedisError as err:
        log.warning("%s: the housekeeping after its end failed: %s", job_id, err)
        return
    log.info("%s: %d consumed stream entries trimmed after its end", job_id, trimmed)
