"""Leases on stream entries: a live consumer renews what it holds, a dead one's lapses.

An entry pending on a consumer is a lease that lasts the reader's ``reclaim_idle_ms``
(consumer.py): a consumer that holds an entry longer (a trainer filling a step, a runner
waiting on a long Generate) renews it with ``Bus.touch`` every ``period_s``, several times
per idle bound, so that only a consumer that died stops renewing and its work is taken over
within seconds. The renewals run on the event loop; blocking work (an optimiser step, a
checkpoint write) runs in threads, and a renewal that comes late says so in the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from redis.exceptions import RedisError

log = logging.getLogger(__name__)

LATE_PERIODS = 3.0
"""A gap of this many periods between two renewals is logged as late."""


async def renew_every(
    period_s: float, renew: Callable[[], Awaitable[None]], *, what: str, stop: asyncio.Event | None = None
) -> None:
    """Call ``renew`` every ``period_s`` until ``stop`` is set (or the task is cancelled).

    A round is bounded by two periods (a stuck connection is dropped and the next round has a
    fresh one); a round that fails (a RedisError, the bound) is tried again a period later, and
    a run of failures is logged once, at its start and at its end. Other errors of ``renew``
    (say, "the lease is someone else's now") end the loop and propagate.
    """
    stop = stop or asyncio.Event()
    last = time.monotonic()
    failing = False
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), period_s)
        if stop.is_set():
            return
        try:
            async with asyncio.timeout(2 * period_s):
                await renew()
        except (RedisError, TimeoutError) as err:
            if not failing:
                log.warning(
                    "%s: renewal failed, retrying every %.1fs: %s", what, period_s, err or "timed out"
                )
            failing = True
            continue
        now = time.monotonic()
        if failing:
            log.info("%s: renewed again, %.1fs after the last renewal", what, now - last)
        elif now - last > LATE_PERIODS * period_s:
            log.warning(
                "%s: renewed %.1fs after the previous renewal (every %.1fs): the event loop was "
                "blocked, or Redis slow",
                *(what, now - last, period_s),
            )
        failing, last = False, now


async def stop_renewing(task: asyncio.Task[None], stop: asyncio.Event, period_s: float) -> None:
    """Stop a ``renew_every`` loop started with ``stop``, and wait for it: its round in flight
    ends within its bound (two periods). Not by cancelling first: on Python 3.11 a cancel that
    lands as redis-py's ``asyncio.wait_for`` finishes a send is lost, and the loop would renew
    forever. A loop still running past the bound is cancelled, and waited for a period more.
    Re-raises the loop's own error."""
    stop.set()
    _, late = await asyncio.wait({task}, timeout=2 * period_s + 1.0)
    if late:
        log.warning("a renewal round outlived its bound of %.1fs; cancelling it", 2 * period_s)
        task.cancel()
        _, late = await asyncio.wait({task}, timeout=period_s + 1.0)
        if late:
            log.error("a renewal loop ignored its stop and its cancellation; leaving it")
            return
    if not task.cancelled():
        task.result()  # the loop's own error, if it ended with one
