"""The engine registry in Redis: who serves rollouts, where, and whether they are alive.

Engines write their EngineInfo into the hash ``verst:engines`` and the time of the write into
the sorted set ``verst:engines:heartbeat``, together, every ``heartbeat_s``. An engine is
alive while its last heartbeat is younger than a ttl. Times are the writers' and readers'
wall clocks (unix seconds), so hosts are assumed to keep their clocks in sync (NTP).
"""

from __future__ import annotations

import time

import redis.asyncio as aioredis

from services.common.pb import common_pb2
from services.common.streams import ENGINE_HEARTBEATS, ENGINES


class EngineRegistry:
    """Heartbeats, removal and liveness queries over the registry keys."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self.redis = redis

    async def heartbeat(self, info: common_pb2.EngineInfo, *, now: float | None = None) -> None:
        """Record ``info`` (its last_heartbeat set to ``now``) and its heartbeat, atomically."""
        if not info.engine_id:
            raise ValueError("EngineInfo.engine_id is empty")
        stamp = time.time() if now is None else now
        record = common_pb2.EngineInfo()
        record.CopyFrom(info)
        record.last_heartbeat.FromNanoseconds(int(stamp * 1e9))
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(ENGINES, info.engine_id, record.SerializeToString())
        pipe.zadd(ENGINE_HEARTBEATS, {info.engine_id: stamp})
        await pipe.execute()

    async def remove(self, engine_id: str) -> None:
        """Forget an engine (it is shutting down)."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.hdel(ENGINES, engine_id)
        pipe.zrem(ENGINE_HEARTBEATS, engine_id)
        await pipe.execute()

    async def alive(self, ttl_s: float, *, now: float | None = None) -> list[common_pb2.EngineInfo]:
        """Engines whose last heartbeat is younger than ``ttl_s``, ordered by engine id."""
        stamp = time.time() if now is None else now
        beats = await self.redis.zrangebyscore(
            ENGINE_HEARTBEATS, f"({stamp - ttl_s}", "+inf", withscores=True
        )
        if not beats:
            return []
        ids = [engine_id for engine_id, _ in beats]
        records = await self.redis.hmget(ENGINES, ids)
        engines = []
        for (_, beat), raw in zip(beats, records, strict=True):
            if raw is None:  # removed between the two reads
                continue
            info = common_pb2.EngineInfo.FromString(raw)
            info.last_heartbeat.FromNanoseconds(int(beat * 1e9))
            engines.append(info)
        return sorted(engines, key=lambda info: info.engine_id)

    async def get(self, engine_id: str) -> common_pb2.EngineInfo | None:
        """The last EngineInfo an engine wrote, alive or not; None if it is not registered."""
        raw = await self.redis.hget(ENGINES, engine_id)
        return None if raw is None else common_pb2.EngineInfo.FromString(raw)

    async def prune(self, max_age_s: float, *, now: float | None = None) -> int:
        """Delete engines silent for more than ``max_age_s`` (crashed without removing
        themselves); returns how many were deleted."""
        stamp = time.time() if now is None else now
        stale = await self.redis.zrangebyscore(ENGINE_HEARTBEATS, "-inf", stamp - max_age_s)
        if not stale:
            return 0
        pipe = self.redis.pipeline(transaction=True)
        pipe.hdel(ENGINES, *stale)
        pipe.zrem(ENGINE_HEARTBEATS, *stale)
        await pipe.execute()
        return len(stale)
