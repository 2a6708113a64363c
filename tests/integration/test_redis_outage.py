"""Riding through Redis outages (services/common/outage.py): a real redis-server with an
append-only file is SIGKILLed and started again on its port, and the clients of
``bus.connect`` wait it out, up to their bound, with one log line when an outage begins
and one when it ends."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

from services.common.bus import Bus, connect
from services.common.consumer import StreamConsumer
from services.common.outage import RedisOutageError, calm_since, wait_until_up
from services.common.pb import common_pb2
from services.common.redis_server import EmbeddedRedis

LOADING_BALLAST = b"*3\r\n$5\r\nDEBUG\r\n$5\r\nSLEEP\r\n$6\r\n0.0002\r\n" * 15_000
"""Commands appended to the append-only file that keep the restarted server loading (answering
LOADING) for a few seconds, as a large data set would."""
Task = common_pb2.PromptTask


@pytest.fixture
def server(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    # "always": a write held back by a slow fsync must not die with the SIGKILL (what is
    # checked is riding through the outage, not everysec's window).
    with EmbeddedRedis(tmp_path / "redis", appendfsync="always") as started:
        yield started


def restart_with_ballast(server: EmbeddedRedis) -> None:
    """Start the killed server again with its append-only file and the ballast after it."""
    assert server.data_dir is not None
    with (server.data_dir / "appendonly.aof").open("ab") as aof:
        aof.write(LOADING_BALLAST)
    server.start()


def assert_loading(server: EmbeddedRedis) -> None:
    with pytest.raises(redis.BusyLoadingError), redis.Redis.from_url(server.url, socket_timeout=10) as plain:
        plain.get("anything")


def start_loading(server: EmbeddedRedis) -> None:
    """Start the killed server again; it is still loading when this returns."""
    restart_with_ballast(server)
    assert_loading(server)


async def written_then_killed(
    server: EmbeddedRedis, caplog: pytest.LogCaptureFixture, *, outage_s: float
) -> aioredis.Redis:
    """A client that has set k=v, and the server SIGKILLed after that; the outage is logged."""
    caplog.set_level(logging.INFO, logger="services.common.outage")
    client = connect(server.url, outage_s=outage_s)
    await client.set("k", "v")
    server.kill()
    return client


def outage_lines(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    return [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "services.common.outage"]


async def test_calls_in_flight_wait_out_a_crash_and_the_reload(
    server: EmbeddedRedis, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="services.common.outage")
    bus = Bus(connect(server.url, outage_s=60))
    stream = "outage:tasks"
    await bus.ensure_group(stream, "g")
    first = await bus.publish(stream, Task(prompt_id="a", job_id="j"))
    server.kill()
    publish = asyncio.create_task(bus.publish(stream, Task(prompt_id="b", job_id="j")))
    read = asyncio.create_task(bus.read(stream, "g", "c", Task, block_ms=500))
    await asyncio.sleep(6.0)  # longer than a retry budget of a few attempts would last
    assert not publish.done() and not read.done()
    await asyncio.to_thread(start_loading, server)
    second = await asyncio.wait_for(publish, 30)
    delivered = await asyncio.wait_for(read, 30)
    entries = await bus.redis.xrange(stream)
    await bus.close()

    assert [entry_id.decode() for entry_id, _ in entries] == [first, second]  # the first survived
    assert delivered and delivered[0].entry_id == first and delivered[0].message.prompt_id == "a"
    (begun, ended) = outage_lines(caplog)
    assert begun[0] == "WARNING" and "unreachable" in begun[1], begun
    assert ended[0] == "INFO" and "answers again" in ended[1], ended


async def test_a_call_made_while_redis_loads_waits_until_it_has_loaded(
    server: EmbeddedRedis, caplog: pytest.LogCaptureFixture
) -> None:
    await (await written_then_killed(server, caplog, outage_s=60)).aclose()
    await asyncio.to_thread(restart_with_ballast, server)
    fresh = connect(server.url, outage_s=60)
    read = asyncio.create_task(fresh.get("k"))  # connects while the server loads
    await asyncio.sleep(0)
    await asyncio.to_thread(assert_loading, server)  # asked after the get: that saw LOADING too
    assert await asyncio.wait_for(read, 30) == b"v"
    await fresh.aclose()
    (begun, ended) = outage_lines(caplog)
    assert "BusyLoadingError" in begun[1], begun
    assert ended[0] == "INFO", ended


async def test_an_outage_beyond_the_bound_fails_calls_until_redis_answers(
    server: EmbeddedRedis, caplog: pytest.LogCaptureFixture
) -> None:
    client = await written_then_killed(server, caplog, outage_s=2)
    started = time.monotonic()
    with pytest.raises(RedisOutageError, match=r"Redis unreachable for more than 2 s"):
        await client.get("k")
    assert 2.0 <= time.monotonic() - started < 6.0
    started = time.monotonic()
    with pytest.raises(RedisOutageError):
        await client.get("k")  # the bound has passed: one attempt, no more waiting
    assert time.monotonic() - started < 1.0
    stop = asyncio.Event()
    back = asyncio.create_task(wait_until_up(client, stop, poll_s=0.2))
    await asyncio.sleep(1.0)
    assert not back.done()
    await asyncio.to_thread(server.start)
    assert await asyncio.wait_for(back, 30)
    assert await client.get("k") == b"v"
    await client.aclose()
    assert [level for level, _ in outage_lines(caplog)] == ["WARNING", "INFO"]


async def test_wait_until_up_returns_false_when_stopped(server: EmbeddedRedis) -> None:
    client = connect(server.url, outage_s=1)
    server.kill()
    stop = asyncio.Event()
    waiting = asyncio.create_task(wait_until_up(client, stop, poll_s=0.1))
    await asyncio.sleep(0.5)
    stop.set()
    assert await asyncio.wait_for(waiting, 10) is False
    await client.aclose()


async def test_entries_idle_through_an_outage_are_not_reclaimed_right_after_it(
    server: EmbeddedRedis,
) -> None:
    """Their consumers could not renew them while Redis was down: reclaiming them at once
    would hand live work out twice. Once a reclaim-idle has passed since, they are fair game."""
    bus = Bus(connect(server.url, outage_s=60))
    stream = "outage:held"
    await bus.ensure_group(stream, "g")
    await bus.publish(stream, Task(prompt_id="held", job_id="j"))
    assert len(await bus.read(stream, "g", "holder", Task, block_ms=100)) == 1
    server.kill()
    pending = asyncio.create_task(bus.pending_count(stream, "g"))
    await asyncio.sleep(1.5)
    await asyncio.to_thread(server.start)
    assert await asyncio.wait_for(pending, 30) == 1
    ended = calm_since(bus.redis, float("-inf"))
    assert time.monotonic() - ended < 5.0
    peer = StreamConsumer(bus, stream, "g", "peer", Task, block_ms=50, reclaim_idle_ms=1000)
    assert await peer.poll() == []  # idle 1.5 s, but only because of the outage
    await asyncio.sleep(1.1)
    reclaimed = await peer.poll()
    await bus.close()
    assert [d.message.prompt_id for d in reclaimed] == ["held"]
