"""The engine registry against a real Redis: heartbeats, expiry, removal, pruning."""

from __future__ import annotations

import time

from services.common.bus import Bus
from services.common.engine_registry import EngineRegistry
from services.common.pb import common_pb2
from services.common.streams import ENGINE_HEARTBEATS, ENGINES


def engine_info(engine_id: str, version: int = 0) -> common_pb2.EngineInfo:
    return common_pb2.EngineInfo(
        engine_id=engine_id,
        address=f"{engine_id}:50052",
        backend="torch",
        policy_version=version,
        state=common_pb2.ENGINE_STATE_SERVING,
    )


async def test_heartbeats_expire_after_the_ttl(bus: Bus) -> None:
    registry = EngineRegistry(bus.redis)
    now = time.time()
    await registry.heartbeat(engine_info("engine-a"), now=now - 4.0)
    await registry.heartbeat(engine_info("engine-b", version=7), now=now - 1.0)

    alive = await registry.alive(5.0, now=now)
    assert [info.engine_id for info in alive] == ["engine-a", "engine-b"]
    assert alive[1].policy_version == 7 and alive[1].address == "engine-b:50052"
    assert abs(alive[1].last_heartbeat.ToNanoseconds() / 1e9 - (now - 1.0)) < 1e-3
    assert [info.engine_id for info in await registry.alive(2.0, now=now)] == ["engine-b"]
    assert await registry.alive(0.5, now=now) == []

    await registry.heartbeat(engine_info("engine-a", version=8), now=now)  # it beats again: alive again
    alive = await registry.alive(2.0, now=now)
    assert [(info.engine_id, info.policy_version) for info in alive] == [("engine-a", 8), ("engine-b", 7)]


async def test_remove_and_prune(bus: Bus) -> None:
    registry = EngineRegistry(bus.redis)
    now = time.time()
    await registry.heartbeat(engine_info("engine-a"), now=now)
    await registry.heartbeat(engine_info("engine-b"), now=now - 120.0)
    await registry.heartbeat(engine_info("engine-c"), now=now)

    await registry.remove("engine-c")
    assert await registry.get("engine-c") is None
    assert await registry.prune(60.0, now=now) == 1  # engine-b died without removing itself
    assert await bus.redis.hkeys(ENGINES) == [b"engine-a"]
    assert await bus.redis.zrange(ENGINE_HEARTBEATS, 0, -1) == [b"engine-a"]
    assert [info.engine_id for info in await registry.alive(5.0)] == ["engine-a"]


async def test_alive_skips_an_engine_removed_between_reads(bus: Bus) -> None:
    registry = EngineRegistry(bus.redis)
    await registry.heartbeat(engine_info("engine-a"))
    await bus.redis.hdel(ENGINES, "engine-a")  # as if removed after the heartbeat read
    assert await registry.alive(5.0) == []
