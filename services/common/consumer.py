"""A consumer-group member: reclaims what dead peers left pending, then reads new entries."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic

from google.protobuf.message import Message
from redis.exceptions import ResponseError

from services.common.bus import Bus, Delivery, M
from services.common.outage import calm_since

log = logging.getLogger(__name__)

SCANS_PER_IDLE_BOUND = 5
"""A consumer looks for abandoned entries this many times per ``reclaim_idle_ms`` (at most every
5 s), so that a dead peer's work is taken over within 1.2 idle bounds of its last renewal."""


def consumer_name(service: str) -> str:
    """A name unique to this process, so that a restart is a new consumer and the
    old one's pending entries are reclaimed rather than forgotten."""
    return f"{service}-{socket.gethostname()}-{os.getpid()}"


@dataclass
class _Waiter:
    message_type: type[Message]
    future: asyncio.Future[list[Delivery[Any]]]


class SharedReads:
    """One blocking XREADGROUP, on one connection, for the streams of many readers that share a
    group and a consumer name (the controller's followers of every job), instead of one blocking
    read, and one pooled connection held, per stream.

    Each ``read`` joins the next round: a round reads every stream with a reader waiting, blocks
    ``block_ms`` at most, and hands each of them its entries (maybe none); a reader that comes
    during a round waits for the next, so a read returns within about two ``block_ms``. Before
    each round the readers of the last one get ``rejoin_ms`` to come back (they handle what they
    got, then read again): otherwise the first back would start a round without the others, and
    an entry for one of those (a job's next checkpoint) would wait out that round's block. A
    round's task runs while readers wait and ends when none does."""

    def __init__(
        self,
        bus: Bus,
        group: str,
        consumer: str,
        *,
        block_ms: int = 500,
        count: int = 100,
        rejoin_ms: int = 50,
    ) -> None:
        self.bus = bus
        self.group = group
        self.consumer = consumer
        self.block_ms = block_ms
        self.count = count
        self.rejoin_ms = rejoin_ms
        self._waiting: dict[str, _Waiter] = {}
        self._joined = asyncio.Event()
        """Set by every reader that joins; the rounds clear it while they wait for readers."""
        self._rounds: asyncio.Task[None] | None = None

    async def read(self, stream: str, message_type: type[M]) -> list[Delivery[M]]:
        """The stream's new entries of the next round (at most ``count``), maybe none."""
        if stream in self._waiting:  # a second reader (a restarted driver's, its predecessor's
            # follower still winding down) reads on its own rather than take the first one's place
            return await self.bus.read(
                stream, self.group, self.consumer, message_type, count=self.count, block_ms=self.block_ms
            )
        waiter = _Waiter(message_type, asyncio.get_running_loop().create_future())
        self._waiting[stream] = waiter
        self._joined.set()
        if self._rounds is None or self._rounds.done():
            self._rounds = asyncio.create_task(self._run(), name=f"shared reads of {self.group}")
        try:
            return await waiter.future
        finally:
            if self._waiting.get(stream) is waiter:
                del self._waiting[stream]

    async def _run(self) -> None:
        last: frozenset[str] = frozenset()
        while self._waiting:
            await self._rejoin(last)
            batch = {stream: waiter for stream, waiter in self._waiting.items() if not waiter.future.done()}
            if not batch:
                await asyncio.sleep(0)  # their readers have not resumed yet
                continue
            await self._round(batch)
            last = frozenset(batch)

    async def _rejoin(self, streams: frozenset[str]) -> None:
        """Wait until the readers of ``streams`` are back, or ``rejoin_ms`` has passed (a reader
        that has left for good costs one such wait)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.rejoin_ms / 1000
        while not all(s in self._waiting and not self._waiting[s].future.done() for s in streams):
            left = deadline - loop.time()
            if left <= 0:
                return
            self._joined.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._joined.wait(), left)

    async def _round(self, batch: dict[str, _Waiter]) -> None:
        """One XREADGROUP for the batch; when the server refuses it (a stream lost its group), each
        stream again on its own, so that one stream's error reaches its own reader alone."""
        types = {stream: waiter.message_type for stream, waiter in batch.items()}
        try:
            got = await self.bus.read_many(types, self.group, self.consumer, count=self.count,
                                           block_ms=self.block_ms)  # fmt: skip
        except ResponseError as err:
            if len(batch) == 1:
                _fail(batch, err)
                return
            for stream, waiter in batch.items():
                await self._round({stream: waiter})
            return
        except Exception as err:  # an outage beyond its limit, a closed client: every reader's
            _fail(batch, err)
            return
        for stream, waiter in batch.items():
            if not waiter.future.done():
                waiter.future.set_result(got[stream])
            elif got[stream]:  # its reader is gone: the entries wait, pending, to be reclaimed
                log.info("%s: %d entries read for a reader that left", stream, len(got[stream]))


def _fail(batch: dict[str, _Waiter], err: Exception) -> None:
    for waiter in batch.values():
        if not waiter.future.done():
            waiter.future.set_exception(err)


class StreamConsumer(Generic[M]):
    """Reads one stream as one member of a consumer group.

    Each ``poll`` first (every ``reclaim_every_s``, by default a fifth of the idle bound)
    takes over entries that have been pending on any consumer for ``reclaim_idle_ms``, then
    reads new ones. A live consumer that holds an entry longer than ``reclaim_idle_ms`` renews
    it (``Bus.touch``) well within that bound, or live work is handed out twice (which
    idempotent consumers tolerate, but it wastes work).
    """

    def __init__(
        self,
        bus: Bus,
        stream: str,
        group: str,
        consumer: str,
        message_type: type[M],
        *,
        count: int = 100,
        block_ms: int = 1000,
        reclaim_idle_ms: int = 5_000,
        reclaim_every_s: float | None = None,
        shared: SharedReads | None = None,
    ) -> None:
        self.bus = bus
        self.shared = shared
        """Read new entries in the rounds of this (same group and consumer), not on our own."""
        self.stream = stream
        self.group = group
        self.consumer = consumer
        self.message_type = message_type
        self.count = count
        self.block_ms = block_ms
        self.reclaim_idle_ms = reclaim_idle_ms
        if reclaim_every_s is None:
            reclaim_every_s = min(5.0, reclaim_idle_ms / 1000 / SCANS_PER_IDLE_BOUND)
        self.reclaim_every_s = reclaim_every_s
        self._next_reclaim = 0.0
        self._ready = False

    async def poll(self, count: int | None = None) -> list[Delivery[M]]:
        """Reclaimed entries if any are due, else new entries (waiting up to block_ms); at most
        ``count`` (default: the consumer's)."""
        count = count or self.count
        if not self._ready:
            await self.bus.ensure_group(self.stream, self.group)
            self._ready = True
        now = time.monotonic()
        if now >= self._next_reclaim and self._idle_means_abandoned(now):
            self._next_reclaim = now + self.reclaim_every_s
            reclaimed = await self.bus.reclaim(
                self.stream,
                self.group,
                self.consumer,
                self.message_type,
                min_idle_ms=self.reclaim_idle_ms,
                count=count,
            )
            if reclaimed:
                self._next_reclaim = now  # more may be waiting: look again next poll
                return reclaimed
        if self.shared is not None:
            return await self.shared.read(self.stream, self.message_type)
        return await self.bus.read(
            self.stream,
            self.group,
            self.consumer,
            self.message_type,
            count=count,
            block_ms=self.block_ms,
        )

    def _idle_means_abandoned(self, now: float) -> bool:
        """Whether an entry idle for ``reclaim_idle_ms`` was left by a dead consumer: not within
        that long after a Redis outage, during which live consumers could not renew theirs."""
        return now - calm_since(self.bus.redis, float("-inf")) >= self.reclaim_idle_ms / 1000

    async def ack(self, deliveries: Sequence[Delivery[M]]) -> int:
        return await self.bus.ack(self.stream, self.group, [d.entry_id for d in deliveries])

    async def dead_letter(self, delivery: Delivery[M], reason: str, *, no_replacement: bool = False) -> None:
        """Dead-letter an entry this consumer cannot process (see ``Bus.dead_letter``)."""
        await self.bus.dead_letter(
            self.stream, self.group, self.consumer, delivery, reason, no_replacement=no_replacement
        )
