"""The api's watchdog thread: it ends the process once the event loop has run no health check, or
the api has been unhealthy, for longer than its bound, and never while checks come and pass."""

from __future__ import annotations

import time

import redis.asyncio as aioredis

from services.api.config import ApiSettings
from services.api.health import EXIT_UNHEALTHY, Health, Watchdog


def watched(health: Health, bound_s: float, wait_s: float) -> list[int]:
    """The exit calls a watchdog with ``bound_s`` made within ``wait_s``."""
    exits: list[int] = []
    watchdog = Watchdog(health, bound_s, exit=exits.append, interval_s=0.01)
    watchdog.start()
    deadline = time.monotonic() + wait_s
    while not exits and time.monotonic() < deadline:
        time.sleep(0.01)
    watchdog.stop()
    return exits


def a_health() -> Health:
    # No connection is made: the watchdog reads only what the checks recorded.
    return Health(aioredis.Redis(), ApiSettings(), controller=None)


def test_a_stuck_event_loop_ends_the_process() -> None:
    health = a_health()
    health.checked_at = time.monotonic() - 0.5  # the last check finished 0.5s ago, none since
    assert watched(health, bound_s=0.2, wait_s=5.0) == [EXIT_UNHEALTHY]


def test_a_long_unhealthy_spell_ends_the_process() -> None:
    health = a_health()
    health.problems, health.unhealthy_since = ["redis does not answer: ConnectionError"], time.monotonic()
    assert watched(health, bound_s=0.2, wait_s=5.0) == [EXIT_UNHEALTHY]


def test_fresh_passing_checks_and_a_short_spell_do_not() -> None:
    health = a_health()
    assert watched(health, bound_s=10.0, wait_s=0.2) == []
    health.problems, health.unhealthy_since = ["x"], time.monotonic()
    assert watched(health, bound_s=10.0, wait_s=0.2) == []
