"""The bus: serialized protos on Redis streams with consumer groups, at least once.

Every entry has two fields: ``t``, the proto's full name, and ``d``, its bytes.
A consumer reads new entries (XREADGROUP with a block timeout), processes them,
and acks only after its work is committed. Entries pending on a consumer that
died are reclaimed by another after an idle bound (XAUTOCLAIM). An entry that
cannot be decoded, has the wrong type, fails its payload check (payloads.py: on
every consuming read), was trimmed away before it was acked, or was delivered
more than ``max_deliveries`` times goes to the dead-letter stream with its
reason and original bytes, and is acked, so it never blocks the stream.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from google.protobuf.message import Message
from redis.exceptions import NoScriptError, ResponseError

from services.common.outage import DEFAULT_OUTAGE_S, RETRIED_ERRORS, OutageClock, OutageRetry
from services.common.payloads import (
    DATA_FIELD,
    TYPE_FIELD,
    NonFiniteMetricError,
    decode_entry,
    non_finite_metrics,
)
from services.common.pb import common_pb2
from services.common.redis_client import (
    CLUSTER_RETRY_CAP_S,
    AsyncClient,
    RedisTarget,
    as_target,
    async_client,
    is_cluster,
    slot_groups,
    socket_timeout_of,
)
from services.common.streams import JobStreams, dead_letter_stream

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)

_MAX_RECLAIM_SCANS = 16
LATEST_SCAN = 16
"""Entries ``Bus.latest`` looks back over for a good one, past bad entries at the stream's end."""
DEFAULT_MAXLEN = 1_000_000
"""Approximate cap on a stream's length; consumed entries are trimmed well before it."""
DEFAULT_MAX_CONNECTIONS = 100
"""Connections a client's pool may open at once (VERST_REDIS_MAX_CONNECTIONS)."""
POOL_WAIT_S = 5.0
"""Longest a command waits for a free pooled connection before the pool counts as exhausted."""


@dataclass(frozen=True, slots=True)
class Delivery(Generic[M]):
    """One decoded stream entry handed to a consumer."""

    stream: str
    entry_id: str
    message: M
    delivery_count: int
    """1 on the first delivery; higher when the entry was reclaimed."""


@dataclass(frozen=True, slots=True)
class _Rejected:
    entry_id: str
    reason: str
    payload_type: str
    payload: bytes
    delivery_count: int
    no_replacement: bool = False


def connect(
    target: str | RedisTarget,
    *,
    socket_timeout_s: float = 30.0,
    outage_s: float = DEFAULT_OUTAGE_S,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    pool_wait_s: float = POOL_WAIT_S,
) -> AsyncClient:
    """An asyncio Redis client (redis_client.py: a server, Sentinel's master or a cluster) that
    rides through Redis outages of up to ``outage_s`` (services pass ``VERST_REDIS_OUTAGE_S``):
    services/common/outage.py. On a cluster the bound is a count of retries that back off up to
    CLUSTER_RETRY_CAP_S each, so about ``outage_s``.

    ``socket_timeout_s`` bounds every reply; it must exceed any block timeout. At most
    ``max_connections`` are open at once (``VERST_REDIS_MAX_CONNECTIONS``; per node on a
    cluster); a command that finds none free for ``pool_wait_s`` fails, saying so (BoundedPool).
    """
    target = as_target(target)
    clock = OutageClock(target.describe())
    client = async_client(
        target,
        socket_timeout_s=socket_timeout_s,
        max_connections=max_connections,
        pool_wait_s=pool_wait_s,
        retry=OutageRetry(clock, outage_s),
        retry_on_error=list(RETRIED_ERRORS),
        cluster_retries=max(3, math.ceil(outage_s / CLUSTER_RETRY_CAP_S)),
    )
    if not is_cluster(client):
        clock.on_recovery = lambda: client.connection_pool.disconnect(inuse_connections=False)
    return client


APPEND_SCRIPT = """
-- KEYS[1]: a stream. ARGV: maxlen, the type field and its value, the data field, then one
-- payload per entry. Appends them in order; their entry ids.
local ids = {}
for i = 5, #ARGV do
  ids[#ids + 1] = redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', ARGV[2], ARGV[3], ARGV[4], ARGV[i])
end
return ids
"""
"""Many appends to one stream as one command: a pipeline of XADDs cost the client more (each
command's encoding, reply and read timeout) than the entries' bytes."""
APPEND_SHA = hashlib.sha1(APPEND_SCRIPT.encode()).hexdigest()


APPEND_CHUNK_BYTES = 256 * 1024
"""Payload bytes per append command: hiredis packs a command of several MiB many times slower
per byte than one of a few hundred KiB."""


def payload_chunks(payloads: list[bytes]) -> list[list[bytes]]:
    """``payloads`` in order, cut into runs of at most APPEND_CHUNK_BYTES (a larger one alone)."""
    chunks: list[list[bytes]] = []
    size = APPEND_CHUNK_BYTES
    for payload in payloads:
        if size + len(payload) > APPEND_CHUNK_BYTES:
            chunks.append([])
            size = 0
        chunks[-1].append(payload)
        size += len(payload)
    return chunks


def encode(message: Message) -> dict[bytes, bytes]:
    """Stream entry fields for a proto message."""
    return {TYPE_FIELD: message.DESCRIPTOR.full_name.encode(), DATA_FIELD: message.SerializeToString()}


def metric_message(
    job_id: str, source: str, values: dict[str, float], *, step: int, policy_version: int
) -> common_pb2.Metric:
    """A Metric of ``source`` time-stamped now (what ``Bus.publish_metric`` publishes); raises
    NonFiniteMetricError, naming them, for NaN or infinite values (a diverged loss fails its
    producer's work, rather than poisoning the job's record and charts)."""
    problem = non_finite_metrics(source, values)
    if problem:
        raise NonFiniteMetricError(f"job {job_id} step {step}: {problem}")
    metric = common_pb2.Metric(
        job_id=job_id, step=step, policy_version=policy_version, source=source, values=values
    )
    metric.time.GetCurrentTime()
    return metric


def newest_good(
    entries: Sequence[tuple[bytes, dict[bytes, bytes]]], message_type: type[M], stream: str
) -> tuple[M | None, list[str]]:
    """The first good message of ``entries`` (newest first), logging the bad ones passed over on
    the way; else None and why each was bad."""
    reasons = []
    for raw_id, fields in entries:
        message, reason = decode_entry(fields, message_type, stream)
        if message is not None:
            if reasons:
                log.warning("%s: passed over %d bad entries: %s", stream, len(reasons), reasons[0])
            return message, reasons
        reasons.append(f"{raw_id.decode()}: {reason}")
    return None, reasons


class Bus:
    """Publish, consume, ack, reclaim and dead-letter protos on Redis streams."""

    def __init__(
        self,
        client: AsyncClient,
        *,
        maxlen: int = DEFAULT_MAXLEN,
        max_deliveries: int = 5,
        block_limit_ms: int | None = None,
    ) -> None:
        if maxlen < 1 or max_deliveries < 1:
            raise ValueError("maxlen and max_deliveries must be >= 1")
        self.redis = client
        self.maxlen = maxlen
        self.max_deliveries = max_deliveries
        timeout = socket_timeout_of(client)
        self.block_limit_ms = block_limit_ms or int(((timeout or 30.0) - 1.0) * 1000)

    def _check_block(self, block_ms: int) -> None:
        """A blocking read must end before the client's socket timeout would cut it off."""
        if not 0 < block_ms <= self.block_limit_ms:
            raise ValueError(f"block_ms must be in (0, {self.block_limit_ms}] (below the socket timeout)")

    @classmethod
    def from_url(
        cls,
        url: str | RedisTarget,
        *,
        outage_s: float = DEFAULT_OUTAGE_S,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        **kwargs: Any,
    ) -> Bus:
        return cls(connect(url, outage_s=outage_s, max_connections=max_connections), **kwargs)

    async def close(self) -> None:
        await self.redis.aclose()

    # -- producing -------------------------------------------------------

    async def publish(self, stream: str, message: Message, *, maxlen: int | None = None) -> str:
        """Append one message; returns its entry id."""
        entry_id = await self.redis.xadd(stream, encode(message), maxlen=maxlen or self.maxlen)
        return entry_id.decode()

    async def publish_metric(
        self, job_id: str, source: str, values: dict[str, float], *, step: int, policy_version: int
    ) -> str:
        """Publish a time-stamped Metric on the job's metrics stream."""
        metric = metric_message(job_id, source, values, step=step, policy_version=policy_version)
        return await self.publish(JobStreams(job_id).metrics, metric)

    async def publish_many(
        self, stream: str, messages: Iterable[Message], *, maxlen: int | None = None
    ) -> list[str]:
        """Append messages in one round trip, in order; returns their entry ids."""
        pipe = self.redis.pipeline(transaction=False)
        for message in messages:
            pipe.xadd(stream, encode(message), maxlen=maxlen or self.maxlen)
        return [entry_id.decode() for entry_id in await pipe.execute()]

    async def publish_groups(
        self, groups: Sequence[tuple[str, Sequence[Message]]], *, maxlen: int | None = None
    ) -> list[list[str] | Exception]:
        """Append several groups of messages, each to its own stream; per group, its entry ids,
        or the error of the appends to its stream (which may have written some: the consumers
        keep one entry per id). The appends to one stream go as one command, the streams'
        concurrently. Messages of one stream are of one type."""
        by_stream: dict[str, list[int]] = {}
        kinds: dict[str, Any] = {}
        for index, (stream, messages) in enumerate(groups):
            by_stream.setdefault(stream, []).append(index)
            for message in messages:
                if kinds.setdefault(stream, message.DESCRIPTOR) is not message.DESCRIPTOR:
                    raise TypeError(f"messages of several types for {stream}: one stream carries one type")
        appended = await asyncio.gather(
            *(
                self._append(stream, [m for i in indices for m in groups[i][1]], maxlen or self.maxlen)
                for stream, indices in by_stream.items()
            ),
            return_exceptions=True,
        )
        outcomes: list[list[str] | Exception] = [[] for _ in groups]
        for indices, ids in zip(by_stream.values(), appended, strict=True):
            if isinstance(ids, BaseException):
                if not isinstance(ids, Exception):
                    raise ids
                for i in indices:
                    outcomes[i] = ids
                continue
            start = 0
            for i in indices:
                outcomes[i] = ids[start : start + len(groups[i][1])]
                start += len(groups[i][1])
        return outcomes

    async def _append(self, stream: str, messages: list[Message], maxlen: int) -> list[str]:
        """``messages`` (of one type) appended to ``stream``, in order, a few hundred KiB per
        command (APPEND_SCRIPT), the commands in one round trip."""
        if not messages:
            return []
        head = [maxlen, TYPE_FIELD, messages[0].DESCRIPTOR.full_name.encode(), DATA_FIELD]
        chunks = payload_chunks([m.SerializeToString() for m in messages])
        replies = await self._append_chunks(stream, head, chunks)
        if any(isinstance(reply, NoScriptError) for reply in replies):  # a new or restarted Redis
            await self.redis.script_load(APPEND_SCRIPT)
            missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
            again = await self._append_chunks(stream, head, [chunks[i] for i in missing])
            for i, reply in zip(missing, again, strict=True):
                replies[i] = reply
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return [entry_id.decode() for reply in replies for entry_id in reply]

    async def _append_chunks(self, stream: str, head: list[Any], chunks: list[list[bytes]]) -> list[Any]:
        pipe = self.redis.pipeline(transaction=False)
        for chunk in chunks:
            pipe.evalsha(APPEND_SHA, 1, stream, *head, *chunk)
        return list(await pipe.execute(raise_on_error=False))

    async def latest(self, stream: str, message_type: type[M]) -> M | None:
        """The newest good message of a stream, without a consumer group (e.g. the latest
        checkpoint handle: every engine wants it, none consumes it). None when empty.

        Bad entries at the stream's end (a wrong type, undecodable, failing the payload
        check) are passed over, so one cannot hide the good entry before it; the
        consumer group that reads the stream dead-letters them. Raises TypeError when
        none of the newest ``LATEST_SCAN`` entries is good."""
        return (await self.newest(stream, message_type))[1]

    async def newest(self, stream: str, message_type: type[M]) -> tuple[str, M | None]:
        """The id of the stream's newest entry ("0-0" when it is empty or missing) and its
        newest good message (as ``latest``), read in one round trip: an entry published after
        the id wakes a ``wait_newer`` or ``wait_newest`` from it at once."""
        entries = await self.redis.xrevrange(stream, count=LATEST_SCAN)
        if not entries:
            return "0-0", None
        message, reasons = newest_good(entries, message_type, stream)
        if message is not None:
            return entries[0][0].decode(), message
        raise TypeError(
            f"none of the newest {len(entries)} entries of {stream} is a good "
            f"{message_type.DESCRIPTOR.full_name}: {reasons[0]}"
        )

    async def wait_newer(self, stream: str, after_id: str, *, block_ms: int) -> str | None:
        """Wait at most ``block_ms`` for an entry newer than ``after_id`` (``"$"``: newer than
        the newest now), without a consumer group; the first such entry's id, or None."""
        self._check_block(block_ms)
        reply = await self.redis.xread({stream: after_id}, count=1, block=block_ms)
        return reply[0][1][0][0].decode() if reply and reply[0][1] else None

    async def wait_newest(
        self, stream: str, after_id: str, message_type: type[M], *, block_ms: int
    ) -> tuple[str, M | None] | None:
        """Wait at most ``block_ms`` for entries newer than ``after_id``, without a consumer
        group; then the newest's id and good message, as ``newest`` gives them, from the same
        read (a follower that waits and then reads the newest pays two round trips a version).
        None when nothing came in time."""
        self._check_block(block_ms)
        reply = await self.redis.xread({stream: after_id}, count=LATEST_SCAN, block=block_ms)
        entries = reply[0][1] if reply else []
        if not entries:
            return None
        if len(entries) < LATEST_SCAN:  # all that came: otherwise the newest lies beyond them
            message, _ = newest_good(entries[::-1], message_type, stream)
            if message is not None:
                return entries[-1][0].decode(), message
        return await self.newest(stream, message_type)  # looks further back, or names the bad ones

    async def newest_id(self, stream: str) -> str:
        """The id of the stream's newest entry ("0-0" when it is empty or missing)."""
        entries = await self.redis.xrevrange(stream, count=1)
        return entries[0][0].decode() if entries else "0-0"

    # -- consuming -------------------------------------------------------

    async def ensure_group(self, stream: str, group: str, *, start_id: str = "0") -> bool:
        """Create the consumer group (and the stream) unless it exists; True if created."""
        try:
            await self.redis.xgroup_create(stream, group, id=start_id, mkstream=True)
        except ResponseError as err:
            if "BUSYGROUP" not in str(err):
                raise
            return False
        return True

    async def read(
        self,
        stream: str,
        group: str,
        consumer: str,
        message_type: type[M],
        *,
        count: int = 100,
        block_ms: int = 1000,
    ) -> list[Delivery[M]]:
        """New entries for this consumer, waiting at most ``block_ms`` for the first."""
        self._check_block(block_ms)
        reply = await self.redis.xreadgroup(group, consumer, {stream: ">"}, count=count, block=block_ms)
        entries = reply[0][1] if reply else []
        return await self._decode_all(stream, group, consumer, message_type, entries, {})

    async def read_many(
        self,
        streams: dict[str, type[Message]],
        group: str,
        consumer: str,
        *,
        count: int = 100,
        block_ms: int = 1000,
    ) -> dict[str, list[Delivery[Any]]]:
        """New entries of several streams (each with its message type) for this consumer of one
        group, in one XREADGROUP: one connection, waiting at most ``block_ms`` for the first entry
        of any; at most ``count`` per stream. Every stream asked for has a list, maybe empty.
        On a cluster, one XREADGROUP per hash slot (a job's streams share one), run together."""
        self._check_block(block_ms)
        replies = await asyncio.gather(
            *(
                self.redis.xreadgroup(group, consumer, dict.fromkeys(names, ">"), count=count, block=block_ms)
                for names in slot_groups(list(streams), self.redis)
            )
        )
        got = {
            (name.decode() if isinstance(name, bytes) else name): entries
            for reply in replies
            for name, entries in _stream_replies(reply)
        }
        return {
            stream: await self._decode_all(stream, group, consumer, kind, got.get(stream, []), {})
            for stream, kind in streams.items()
        }

    async def reclaim(
        self,
        stream: str,
        group: str,
        consumer: str,
        message_type: type[M],
        *,
        min_idle_ms: int,
        count: int = 100,
    ) -> list[Delivery[M]]:
        """Take over up to ``count`` entries pending on other consumers for at least
        ``min_idle_ms``. Follows XAUTOCLAIM's cursor through the pending list (a
        Redis 7 server scans only ``10 * count`` pending entries per call)."""
        cursor: bytes | str = "0-0"
        present: list[tuple[bytes, dict[bytes, bytes]]] = []
        trimmed_seen = False
        for _ in range(_MAX_RECLAIM_SCANS):
            cursor, entries, *_ = await self.redis.xautoclaim(
                stream,
                group,
                consumer,
                min_idle_time=min_idle_ms,
                start_id=cursor,
                count=count - len(present),
            )
            present += [(eid, fields) for eid, fields in entries if eid is not None]
            trimmed_seen |= any(eid is None for eid, _ in entries)
            if cursor in (b"0-0", "0-0") or len(present) >= count:
                break
        if trimmed_seen:
            await self._dead_letter_trimmed(stream, group, consumer, {eid for eid, _ in present})
        if not present:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for entry_id, _ in present:
            pipe.xpending_range(stream, group, min=entry_id, max=entry_id, count=1)
        counts = {
            rows[0]["message_id"]: int(rows[0]["times_delivered"]) for rows in await pipe.execute() if rows
        }
        return await self._decode_all(stream, group, consumer, message_type, present, counts)

    async def touch(self, stream: str, group: str, consumer: str, entry_ids: Sequence[str]) -> list[str]:
        """Reset the idle time of entries this consumer still works on, so that they are
        not reclaimed as abandoned (XCLAIM JUSTID: no delivery is counted). Returns the
        ids now held; an id acked or deleted meanwhile is not among them."""
        if not entry_ids:
            return []
        held = await self.redis.xclaim(stream, group, consumer, 0, list(entry_ids), justid=True)
        return [eid.decode() if isinstance(eid, bytes) else eid for eid in held]

    async def owner(self, stream: str, group: str, entry_id: str) -> str | None:
        """The consumer an entry is pending on, or None when it is not pending."""
        rows = await self.redis.xpending_range(stream, group, min=entry_id, max=entry_id, count=1)
        return rows[0]["consumer"].decode() if rows else None

    async def ack(self, stream: str, group: str, entry_ids: Sequence[str]) -> int:
        """Acknowledge processed entries; returns how many were pending."""
        if not entry_ids:
            return 0
        return int(await self.redis.xack(stream, group, *entry_ids))

    async def ack_many(self, group: str, entries: Sequence[tuple[str, str]]) -> int:
        """Acknowledge processed (stream, entry id) pairs of several streams in one round trip;
        returns how many were pending."""
        by_stream: dict[str, list[str]] = {}
        for stream, entry_id in entries:
            by_stream.setdefault(stream, []).append(entry_id)
        if not by_stream:
            return 0
        pipe = self.redis.pipeline(transaction=False)
        for stream, entry_ids in by_stream.items():
            pipe.xack(stream, group, *entry_ids)
        return sum(int(acked) for acked in await pipe.execute())

    async def dead_letter(
        self,
        stream: str,
        group: str,
        consumer: str,
        delivery: Delivery[Any],
        reason: str,
        *,
        no_replacement: bool = False,
    ) -> None:
        """Move a delivered entry that its consumer cannot process to the dead-letter stream;
        ``no_replacement`` when the work it stood for needs no replacement prompt (DeadLetter)."""
        rejected = _Rejected(
            delivery.entry_id,
            reason,
            delivery.message.DESCRIPTOR.full_name,
            delivery.message.SerializeToString(),
            delivery.delivery_count,
            no_replacement,
        )
        await self._dead_letter_all(stream, group, consumer, [rejected])

    # -- housekeeping ----------------------------------------------------

    async def pending_count(self, stream: str, group: str) -> int:
        summary = await self.redis.xpending(stream, group)
        return int(summary["pending"])

    async def trim_consumed(self, stream: str, *, keep: int = 0) -> int:
        """Delete the entries every group has acked that lie before the oldest one still unacked
        (pending, or not delivered yet) in any group, except the newest ``keep`` (a stream read
        by ``latest``: pass LATEST_SCAN); returns how many were deleted.

        Safe with MINID: nothing at or after a group's oldest pending entry, or after its last
        delivered one, is touched. A stream without groups is left alone. The groups' states are
        read apart from their pending entries, which consumers ack in between: a group with
        entries pending then, and none when its pending entries are read, is bounded by the
        last entry delivered before (what was delivered since lies after it and stays).
        """
        groups = await self.redis.xinfo_groups(stream)
        if not groups:
            return 0
        newest = await self.redis.xrevrange(stream, count=keep) if keep else []
        bounds = [_id_key(newest[-1][0])] if newest else []
        for info in groups:
            oldest_pending = None
            if int(info["pending"]):
                oldest_pending = (await self.redis.xpending(stream, info["name"]))["min"]
            if oldest_pending is not None:
                bounds.append(_id_key(oldest_pending))
            else:
                ms, seq = _id_key(info["last-delivered-id"])
                bounds.append((ms, seq + 1))
        low = min(bounds)
        if low <= (0, 1):
            return 0
        return int(await self.redis.xtrim(stream, minid=f"{low[0]}-{low[1]}", approximate=False))

    # -- internals -------------------------------------------------------

    async def _decode_all(
        self,
        stream: str,
        group: str,
        consumer: str,
        message_type: type[M],
        entries: Sequence[tuple[bytes, dict[bytes, bytes]]],
        delivery_counts: dict[bytes, int],
    ) -> list[Delivery[M]]:
        good: list[Delivery[M]] = []
        bad: list[_Rejected] = []
        for raw_id, fields in entries:
            entry_id = raw_id.decode()
            count = delivery_counts.get(raw_id, 1)
            if count > self.max_deliveries:
                reason = f"delivered {count} times without an ack (max_deliveries={self.max_deliveries})"
            else:
                message, reason = decode_entry(fields, message_type, stream)
                if message is not None:
                    good.append(Delivery(stream, entry_id, message, count))
                    continue
            payload_type = fields.get(TYPE_FIELD, b"").decode(errors="replace")
            bad.append(_Rejected(entry_id, reason, payload_type, fields.get(DATA_FIELD, b""), count))
        if bad:
            await self._dead_letter_all(stream, group, consumer, bad)
        return good

    async def _dead_letter_all(
        self, stream: str, group: str, consumer: str, rejected: Sequence[_Rejected]
    ) -> None:
        """Write dead letters and ack the originals atomically."""
        dead_stream = dead_letter_stream(stream)
        pipe = self.redis.pipeline(transaction=True)
        for item in rejected:
            letter = common_pb2.DeadLetter(
                source_stream=stream,
                entry_id=item.entry_id,
                group=group,
                consumer=consumer,
                reason=item.reason,
                payload_type=item.payload_type,
                payload=item.payload,
                delivery_count=item.delivery_count,
                no_replacement=item.no_replacement,
            )
            letter.dead_at.GetCurrentTime()
            pipe.xadd(dead_stream, encode(letter), maxlen=self.maxlen)
            pipe.xack(stream, group, item.entry_id)
            log.warning("dead-lettered %s %s to %s: %s", stream, item.entry_id, dead_stream, item.reason)
        await pipe.execute()

    async def _dead_letter_trimmed(self, stream: str, group: str, consumer: str, claimed: set[bytes]) -> None:
        """XAUTOCLAIM on Redis 6.2 returns a nil entry, without its id, for an entry
        that was trimmed while pending. Find those ids in our pending list and
        dead-letter them, so that the loss is recorded rather than silent."""
        rows = await self.redis.xpending_range(stream, group, "-", "+", 10_000, consumername=consumer)
        candidates = [row["message_id"] for row in rows if row["message_id"] not in claimed]
        pipe = self.redis.pipeline(transaction=False)
        for entry_id in candidates:
            pipe.xrange(stream, min=entry_id, max=entry_id, count=1)
        gone = [eid for eid, found in zip(candidates, await pipe.execute(), strict=True) if not found]
        reason = "entry was trimmed from the stream (MAXLEN cap) before it was acked"
        await self._dead_letter_all(
            stream, group, consumer, [_Rejected(eid.decode(), reason, "", b"", 0) for eid in gone]
        )


def _stream_replies(reply: Any) -> list[tuple[bytes | str, list[Any]]]:
    """XREADGROUP's reply as (stream, entries) pairs: a list from one server, a dict (RESP3, or
    redis-py's cluster client) otherwise."""
    if not reply:
        return []
    return list(reply.items()) if isinstance(reply, dict) else [(name, entries) for name, entries in reply]


def _id_key(entry_id: bytes | str) -> tuple[int, int]:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)
