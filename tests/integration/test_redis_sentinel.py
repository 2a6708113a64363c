"""Sentinel fail-over through the client factory: a master, a replica and a sentinel from the
embedded binary; the master is killed and the bus's writes continue on the promoted replica."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from services.common.bus import Bus
from services.common.outage import RedisOutageError
from services.common.pb import common_pb2
from services.common.redis_client import RedisMode, parse_redis_url
from services.common.streams import RUNNERS_GROUP, JobStreams
from tests.integration.redis_topologies import SentinelSet, redis_sentinel

FAILOVER_DEADLINE_S = 30.0
"""Kill to the first write on the new master: 1 s down-after, the election, the promotion."""
SENTINEL_PASSWORD = "sentinel-secret"


@pytest.fixture
def sentinels() -> Iterator[SentinelSet]:
    with redis_sentinel(sentinel_password=SENTINEL_PASSWORD) as deployment:
        yield deployment


def task(n: int) -> common_pb2.PromptTask:
    return common_pb2.PromptTask(job_id="job-1", prompt_id=f"p{n}", group_id=f"g{n}")


async def test_writes_continue_through_a_fail_over(sentinels: SentinelSet) -> None:
    url = f"redis+sentinel://127.0.0.1:{sentinels.sentinel.port}/{sentinels.service}/0"
    target = parse_redis_url(url, sentinel_password=SENTINEL_PASSWORD)
    assert target.mode is RedisMode.SENTINEL
    assert SENTINEL_PASSWORD not in target.describe() and SENTINEL_PASSWORD not in repr(target)
    bus = Bus.from_url(target, outage_s=FAILOVER_DEADLINE_S)
    prompts = JobStreams("job-1").prompts
    try:
        await bus.ensure_group(prompts, RUNNERS_GROUP)
        await bus.publish(prompts, task(0))
        assert (await bus.redis.info("server"))["tcp_port"] == sentinels.master.port
        assert await bus.redis.wait(1, 5000) == 1, "the replica has the entry before the master dies"

        sentinels.master.kill()
        began = time.monotonic()
        await asyncio.wait_for(bus.publish(prompts, task(1)), FAILOVER_DEADLINE_S)
        took = time.monotonic() - began

        assert (await bus.redis.info("server"))["tcp_port"] == sentinels.replica.port, "the new master"
        got = await bus.read(prompts, RUNNERS_GROUP, "runner", common_pb2.PromptTask, count=10)
        assert [delivery.message.prompt_id for delivery in got] == ["p0", "p1"]
        assert await bus.ack(prompts, RUNNERS_GROUP, [d.entry_id for d in got]) == 2
        print(f"write resumed {took:.1f}s after the master was killed")
    finally:
        await bus.close()


async def test_a_wrong_sentinel_password_fails_within_the_outage_bound(sentinels: SentinelSet) -> None:
    """redis-py's master discovery counts a sentinel that refuses the login as unreachable, so the
    caller sees no master, within VERST_REDIS_OUTAGE_S, and never the password."""
    url = f"redis+sentinel://127.0.0.1:{sentinels.sentinel.port}/{sentinels.service}"
    bus = Bus.from_url(parse_redis_url(url, sentinel_password="wrong-secret"), outage_s=2)
    try:
        with pytest.raises(RedisOutageError) as raised:
            await asyncio.wait_for(bus.redis.ping(), 10)
        assert "wrong-secret" not in str(raised.value) and "wrong-secret" not in str(raised.value.__cause__)
        assert "No master found" in str(raised.value.__cause__)
    finally:
        await bus.close()
