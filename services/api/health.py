"""What keeps the api serving in a crowd, and what says when it cannot.

- ``request_client``: the Redis client of the request handlers. Its pool is their own and bounded
  (a request waits at most ``request_timeout_s`` for a free connection), so the job drivers, whose
  followers hold blocking reads on the bus's pool, can never starve a request of a connection.
- ``RedisErrorHandler``: a Redis error in a handler is a 503 with a short reason, not a 500.
- ``Health``: every ``HEALTH_INTERVAL_S`` it pings Redis through the request pool and looks at the
  controller's last finished poll; ``/healthz`` answers from it (503 with the problems).
- ``Watchdog``: a thread that ends the process with status ``EXIT_UNHEALTHY`` once it has been
  unhealthy, or its event loop has run no check, for ``unhealthy_exit_s``, so that a supervisor
  restarts it: a thread, because a stuck event loop runs nothing of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Protocol

import redis.asyncio as aioredis
from fastapi import Request
from fastapi.responses import JSONResponse
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.api.config import ApiSettings
from services.common.redis_client import AsyncClient, RedisTarget, async_client

log = logging.getLogger(__name__)

HEALTH_INTERVAL_S = 1.0
"""How often the health monitor checks."""
EXIT_UNHEALTHY = 3
"""The api's exit status when the watchdog ends it."""
REDIS_ERROR_LOG_EVERY_S = 10.0
"""At most one log line per this many seconds for the 503s that Redis errors cause."""


def request_client(url: str | RedisTarget, settings: ApiSettings) -> AsyncClient:
    """A Redis client for the request handlers, on a BlockingConnectionPool of their own.

    It fails fast rather than riding out an outage (two quick retries of a dropped connection):
    a request is answered 503 within a few ``request_timeout_s`` and the client asks again."""
    return async_client(
        url,
        max_connections=settings.request_connections,
        pool_wait_s=settings.request_timeout_s,
        socket_timeout_s=settings.request_timeout_s,
        socket_connect_timeout_s=settings.request_timeout_s,
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), retries=2),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
        cluster_retries=2,
        pool_class=aioredis.BlockingConnectionPool,
    )


def short_error(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text[:160]}" if text else type(err).__name__


class RedisErrorHandler:
    """The exception handler of RedisError (``app.add_exception_handler``): a 503 with a short
    reason; it logs the first of a burst and then a count."""

    def __init__(self) -> None:
        self._logged_at = -REDIS_ERROR_LOG_EVERY_S
        self._unlogged = 0

    async def __call__(self, request: Request, exc: Exception) -> JSONResponse:
        reason = short_error(exc)
        now = time.monotonic()
        if now - self._logged_at >= REDIS_ERROR_LOG_EVERY_S:
            more = f" (and {self._unlogged} more since the last line)" if self._unlogged else ""
            log.warning("%s %s: 503: redis: %s%s", request.method, request.url.path, reason, more)
            self._logged_at, self._unlogged = now, 0
        else:
            self._unlogged += 1
        body = {"detail": f"the job store (Redis) is unavailable: {reason}"}
        return JSONResponse(body, 503, headers={"Retry-After": "1"})


class Polling(Protocol):
    last_poll: float
    """time.monotonic() when the controller last finished a poll."""


class Health:
    """The api's health as of its last check: a list of problems, empty when healthy."""

    def __init__(self, redis: aioredis.Redis, settings: ApiSettings, controller: Polling | None) -> None:
        self.redis = redis
        self.settings = settings
        self.controller = controller
        self.problems: list[str] = []
        self.checked_at = time.monotonic()
        self.unhealthy_since: float | None = None
        """time.monotonic() of the first check of the current unhealthy spell; None when healthy."""

    async def check(self) -> list[str]:
        """Check now; the problems found (also kept as ``problems``)."""
        problems = []
        try:
            async with asyncio.timeout(self.settings.request_timeout_s):
                await self.redis.ping()
        except (RedisError, OSError, TimeoutError) as err:
            problems.append(f"redis does not answer: {short_error(err)}")
        if self.controller is not None:
            idle = time.monotonic() - self.controller.last_poll
            if idle > self.settings.controller_stall_s:
                problems.append(f"the controller has not finished a poll for {idle:.0f}s")
        now = time.monotonic()
        if problems and self.unhealthy_since is None:
            self.unhealthy_since = now
            log.warning("api unhealthy: %s", "; ".join(problems))
        elif not problems and self.unhealthy_since is not None:
            log.info("api healthy again after %.0fs", now - self.unhealthy_since)
            self.unhealthy_since = None
        self.problems, self.checked_at = problems, now
        return problems

    async def run(self, stop: asyncio.Event) -> None:
        """Check every HEALTH_INTERVAL_S until ``stop`` is set."""
        while not stop.is_set():
            try:
                await self.check()
            except Exception:  # a bug here must not end the checks: they are what /healthz says
                log.exception("health check failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), HEALTH_INTERVAL_S)

    def current(self, now: float | None = None) -> list[str]:
        """The last check's problems, and one more when checks have stopped coming."""
        late = (time.monotonic() if now is None else now) - self.checked_at
        if late > self.settings.request_timeout_s + 2 * HEALTH_INTERVAL_S:
            return [*self.problems, f"no health check has finished for {late:.0f}s"]
        return self.problems

    def exit_reason(self, now: float, bound_s: float) -> str:
        """Why the process should exit now, after ``bound_s`` of trouble; "" when it should not."""
        if now - self.checked_at > bound_s:
            return f"the event loop has finished no health check for {now - self.checked_at:.0f}s"
        if self.unhealthy_since is not None and now - self.unhealthy_since > bound_s:
            return f"unhealthy for {now - self.unhealthy_since:.0f}s: {'; '.join(self.problems)}"
        return ""


class Watchdog:
    """Ends the process (``exit(EXIT_UNHEALTHY)``, by default ``os._exit``) once ``health`` says so."""

    def __init__(
        self,
        health: Health,
        bound_s: float,
        *,
        exit: Callable[[int], object] = os._exit,
        interval_s: float = HEALTH_INTERVAL_S,
    ) -> None:
        self.health = health
        self.bound_s = bound_s
        self._exit = exit
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="api watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval_s + 1.0)

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            reason = self.health.exit_reason(time.monotonic(), self.bound_s)
            if reason:
                log.critical("api: %s; exiting (status %d) for its supervisor", reason, EXIT_UNHEALTHY)
                for handler in logging.getLogger().handlers:
                    handler.flush()
                self._exit(EXIT_UNHEALTHY)
                return
