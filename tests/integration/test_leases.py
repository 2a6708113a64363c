"""Stopping a renewal loop (services/common/leases.py) against a real Redis server.

A task cancelled while redis-py sends a command can lose its cancellation on Python 3.11
(``asyncio.wait_for`` returns the finished send and drops the cancel), so a renewal loop
stopped by ``cancel()`` may renew forever; ``stop_renewing`` ends it through its stop event.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time

import pytest

from services.common.bus import Bus
from services.common.leases import renew_every, stop_renewing

PERIOD_S = 0.005


async def test_a_loop_stopped_at_random_moments_of_its_redis_rounds_ends_at_once(bus: Bus) -> None:
    await bus.redis.xadd("leased", {"f": "v"})
    await bus.redis.xgroup_create("leased", "readers", id="0")
    await bus.redis.xreadgroup("readers", "me", {"leased": ">"}, count=1)
    rounds = 0

    async def renew() -> None:  # what a trainer's round does: read the owner, touch, read a state
        nonlocal rounds
        rows = await bus.redis.xpending_range("leased", "readers", min="-", max="+", count=1)
        await bus.touch("leased", "readers", "me", [rows[0]["message_id"].decode()])
        await bus.redis.hget("job", "state")
        rounds += 1

    rng = random.Random(0)
    slowest = 0.0
    for _ in range(150):
        stop = asyncio.Event()
        task = asyncio.create_task(renew_every(PERIOD_S, renew, what="test", stop=stop))
        await asyncio.sleep(rng.uniform(0.0, 3 * PERIOD_S))
        began = time.monotonic()
        await stop_renewing(task, stop, PERIOD_S)
        slowest = max(slowest, time.monotonic() - began)
        assert task.done() and not task.cancelled()
    assert rounds > 50  # the stops landed inside rounds, not only between them
    assert slowest < 0.5  # a round's end, never the bound (2 periods + 1 s) nor a cancel


async def test_a_round_that_ignores_its_bound_is_cancelled_and_left_bounded(
    caplog: pytest.LogCaptureFixture,
) -> None:
    entered, released = asyncio.Event(), False

    async def stuck() -> None:  # swallows every cancellation, as a broken client library might
        entered.set()
        while not released:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(0.05)

    stop = asyncio.Event()
    task = asyncio.create_task(renew_every(PERIOD_S, stuck, what="test", stop=stop))
    await entered.wait()
    began = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="services.common.leases"):
        await stop_renewing(task, stop, PERIOD_S)
    assert time.monotonic() - began < 2 * PERIOD_S + 1.0 + PERIOD_S + 1.0 + 0.5
    assert "ignored its stop and its cancellation" in caplog.text
    assert not task.done()
    released = True  # the round returns; the loop sees its stop
    await asyncio.wait_for(task, 1.0)


async def test_the_loops_own_error_is_raised_by_the_stop() -> None:
    async def renew() -> None:
        raise ValueError("the lease is someone else's now")

    stop = asyncio.Event()
    task = asyncio.create_task(renew_every(PERIOD_S, renew, what="test", stop=stop))
    await asyncio.wait({task}, timeout=1.0)
    with pytest.raises(ValueError, match="someone else's"):
        await stop_renewing(task, stop, PERIOD_S)
