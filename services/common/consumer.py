"""A consumer-group member: reclaims what dead peers left pending, then reads new entries."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence
from typing import Generic

from services.common.bus import Bus, Delivery, M
from services.common.outage import calm_since

SCANS_PER_IDLE_BOUND = 5
"""A consumer looks for abandoned entries this many times per ``reclaim_idle_ms`` (at most every
5 s), so that a dead peer's work is taken over within 1.2 idle bounds of its last renewal."""


def consumer_name(service: str) -> str:
    """A name unique to this process, so that a restart is a new consumer and the
    old one's pending entries are reclaimed rather than forgotten."""
    return f"{service}-{socket.gethostname()}-{os.getpid()}"


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
    ) -> None:
        self.bus = bus
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
