"""Riding through Redis outages: one retry policy for every Redis client of every service.

A Redis server that is down or restarting refuses connections or drops them; one that
is loading its append-only file after a restart answers ``LOADING`` (redis-py's
BusyLoadingError); one that hangs lets the socket time out. Every client that
``bus.connect`` makes retries those errors inside redis-py, around each command,
pipeline and connect, with capped exponential backoff, for as long as the outage
has lasted less than ``VERST_REDIS_OUTAGE_S`` (default 120 s). Within that bound a
call only takes longer, so no caller sees the outage and no job changes state
because of it. Beyond it every call raises RedisOutageError (a ConnectionError
whose text says so) after one attempt, until Redis answers again; the service that
owns a job then fails it with that reason, once it can be recorded
(``wait_until_up``).

An outage runs from the first failed attempt to the next command that succeeds. The
clients of one ``connect`` share an OutageClock, which logs one WARNING line when an
outage begins and one INFO line when it ends, not one per retry. A call that fails
on a socket timeout was already waiting that long, so a hung server (rather than a
dead one) is given up on up to one socket timeout after the bound.

Retrying keeps the bus at least once (see docs/architecture.md, "The bus"): a command
whose reply was lost may have run, and runs again. An XADD can then append its entry
twice (consumers are idempotent by message id), an XREADGROUP's lost entries stay
pending on the consumer until they are reclaimed, and a dead-letter MULTI can write
its letter twice; XACK, XCLAIM and the job store's writes are idempotent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import (
    AuthenticationError,
    AuthorizationError,
    BusyLoadingError,
    MaxConnectionsError,
    RedisError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_OUTAGE_S = 120.0
"""How long an outage is ridden through unless VERST_REDIS_OUTAGE_S says otherwise."""
RETRIED_ERRORS: tuple[type[RedisError], ...] = (RedisConnectionError, RedisTimeoutError, BusyLoadingError)
"""Errors of an unreachable, restarting or loading server."""
_PERMANENT = (AuthenticationError, AuthorizationError, MaxConnectionsError)
"""ConnectionErrors that waiting does not cure: they are raised at once."""
_CONNECT_STEPS = ("connect", "connect_check_health", "_connect_retry")
"""redis-py's connection methods whose retried steps only open a socket (no command);
``_connect_retry``: a Sentinel-managed connection's (asks Sentinel for the master, then connects)."""


class RedisOutageError(RedisConnectionError):
    """Redis has been unreachable for longer than the outage bound."""

    def __init__(self, limit_s: float) -> None:
        super().__init__(f"Redis unreachable for more than {limit_s:.0f} s (VERST_REDIS_OUTAGE_S)")
        self.limit_s = limit_s


class OutageClock:
    """When the current outage of one Redis server began, as the clients of one process see
    it; logs its beginning and its end once each. Shared by a client's connections
    (a deep copy of it is itself, since redis-py deep-copies a client's Retry)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.began: float | None = None
        """monotonic time of the first failure of the current outage; None while Redis answers."""
        self.ended = float("-inf")
        """monotonic time the last outage ended (-inf: there was none)."""
        self.outages = 0
        self.on_recovery: Callable[[], Awaitable[object]] | None = None
        """Run by the call that ends an outage (``connect``: close the idle connections, which
        died with the server and would fail, one by one, at their next use)."""

    def __deepcopy__(self, memo: dict[int, Any]) -> OutageClock:
        return self

    def failed(self, error: BaseException) -> float:
        """Record a failed attempt; seconds since the outage began."""
        now = time.monotonic()
        if self.began is None:
            self.began = now
            self.outages += 1
            log.warning("Redis %s unreachable (%s: %s); retrying", self.name, type(error).__name__, error)
        return now - self.began

    def answered(self) -> bool:
        """Record a command that succeeded; True when that ended an outage."""
        if self.began is None:
            return False
        now = time.monotonic()
        log.info("Redis %s answers again after %.1f s", self.name, now - self.began)
        self.began, self.ended = None, now
        return True

    def up_since(self) -> float:
        """monotonic time since which Redis has answered: the end of the last outage (-inf when
        there was none; now during one). Time-outs that Redis's absence may have run down
        (a stall, the idle time of pending entries) count from here."""
        return time.monotonic() if self.began is not None else self.ended


class OutageRetry(Retry):
    """redis-py's Retry, bounded by the time since the outage began instead of a count."""

    def __init__(self, clock: OutageClock, limit_s: float, *, base_s: float = 0.05, cap_s: float = 2.0):
        super().__init__(ExponentialBackoff(cap=cap_s, base=base_s), -1, RETRIED_ERRORS)
        self.clock = clock
        self.limit_s = limit_s

    async def call_with_retry(  # type: ignore[override]
        self,
        do: Callable[[], Awaitable[T]],
        fail: Callable[..., Any],
        is_retryable: Callable[[Exception], bool] | None = None,
        with_failure_count: bool = False,
    ) -> T:
        failures = 0
        while True:
            try:
                result = await do()
            except self._supported_errors as error:
                if isinstance(error, _PERMANENT) or (is_retryable is not None and not is_retryable(error)):
                    raise
                failures += 1
                await (fail(error, failures) if with_failure_count else fail(error))
                if isinstance(error, RedisOutageError):  # a connect inside this call gave up
                    raise
                down_s = self.clock.failed(error)
                if down_s >= self.limit_s:
                    raise RedisOutageError(self.limit_s) from error
                await asyncio.sleep(min(self._backoff.compute(failures), self.limit_s - down_s))
            else:
                # A connection can open while Redis still loads: only a command is an answer.
                if not _opens_socket(do) and self.clock.answered() and self.clock.on_recovery:
                    with contextlib.suppress(RedisError, OSError):  # the call itself succeeded
                        await self.clock.on_recovery()
                return result


def _opens_socket(do: Callable[..., Any]) -> bool:
    qualname = getattr(do, "__qualname__", "")
    return qualname.split(".<locals>")[0].rpartition(".")[2] in _CONNECT_STEPS


def outage_clock(client: aioredis.Redis) -> OutageClock | None:
    """The OutageClock of a client made by ``bus.connect`` (None for another client, and for a
    cluster's: it counts retries instead)."""
    pool = getattr(client, "connection_pool", None)
    retry = pool.connection_kwargs.get("retry") if pool is not None else None
    return retry.clock if isinstance(retry, OutageRetry) else None


def calm_since(client: aioredis.Redis, since: float) -> float:
    """``since`` (a monotonic time), or the end of a Redis outage after it: the start of a
    time-out that an outage must not run down."""
    clock = outage_clock(client)
    return since if clock is None else max(since, clock.up_since())


async def wait_until_up(client: aioredis.Redis, stop: asyncio.Event, *, poll_s: float = 1.0) -> bool:
    """Wait until Redis answers a PING (True) or ``stop`` is set (False)."""
    while not stop.is_set():
        with contextlib.suppress(RedisError):
            await client.ping()
            return True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), poll_s)
    return False
