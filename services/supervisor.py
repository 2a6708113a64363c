"""Restarts the local stack's service processes when they end on their own (`verst up`).

A thread polls every child. One that ended is started again with the same command after a
backoff that doubles with each restart in a row (1 s, 2 s, 4 s, ... up to ``max_delay_s``) and
starts over once a process has stayed up ``stable_after_s``. Every end is logged with its exit
status or signal and recorded in Redis (services/common/service_restarts.py: GET /v1/cluster and
`verst status` show it). A service that ends ``crash_loop_restarts`` times within
``crash_loop_window_s`` is a crash loop: logged as an error and marked so, then *kept* retrying
at the capped delay rather than given up on, since a local stack's usual cause (Redis or a peer
down, a full disk) tends to pass and a stack left half-dead would hide it; the mark says why it
keeps coming back.

The thread checks and restarts under the stack's lock, and does nothing once the stop event is
set, so `Stack.stop()` (which sets it, then takes the lock) never races a restart.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import redis
from pydantic import BaseModel, ConfigDict, Field

from services.common.service_restarts import ServiceRestart, forget, record

log = logging.getLogger(__name__)

RELEASE_TIMEOUT_S = 60.0
"""Longest the thread outlives its stop event waiting for the stack to stop its children."""
REDIS_TIMEOUT_S = 2.0
"""Bound on each write of a restart record: a Redis that is down delays no restart."""


class RestartPolicy(BaseModel):
    """When the supervisor restarts a child that ended."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    first_delay_s: float = Field(1.0, gt=0.0, le=3600.0)
    """Backoff before the first restart in a row; each further one doubles it."""
    max_delay_s: float = Field(30.0, gt=0.0, le=3600.0)
    """Cap of the backoff (and the delay of every restart in a crash loop)."""
    stable_after_s: float = Field(60.0, gt=0.0, le=86_400.0)
    """A process up this long has recovered: the next end starts the backoff over."""
    crash_loop_restarts: int = Field(5, ge=1, le=1000)
    """This many restarts of one service within ``crash_loop_window_s`` mark a crash loop."""
    crash_loop_window_s: float = Field(300.0, gt=0.0, le=86_400.0)
    """The window the crash-loop count looks back over."""
    poll_s: float = Field(0.5, gt=0.0, le=60.0)
    """How often the supervisor looks at the children."""


def backoff_delay(policy: RestartPolicy, in_a_row: int) -> float:
    """Delay before the ``in_a_row``-th restart in a row (1-based): doubling from the first, capped."""
    return min(policy.first_delay_s * 2 ** max(0, in_a_row - 1), policy.max_delay_s)


def exit_text(returncode: int) -> str:
    """``signal SIGKILL`` for a process a signal ended (Popen's negative code), else ``exit status N``."""
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit status {returncode}"


class Supervised(Protocol):
    """What the supervisor needs of the stack (services/stack.py's Stack)."""

    lock: threading.Lock

    def running(self) -> dict[str, subprocess.Popen[bytes]]:
        """Each child's current process, by name."""
        ...

    def respawn(self, name: str, why: str) -> subprocess.Popen[bytes]:
        """Start child ``name`` again with its command, environment and ports (lock held)."""
        ...


@dataclass
class Watch:
    """What the supervisor remembers of one child."""

    started_at: float
    """Monotonic time its current process started (or supervision began)."""
    restarts: int = 0
    in_a_row: int = 0
    """Restarts since it last stayed up ``stable_after_s``."""
    recent: deque[float] = field(default_factory=deque)
    """Monotonic times of its restarts within the crash-loop window."""
    due_at: float | None = None
    """When its pending restart is due; None while its process runs."""
    row: ServiceRestart | None = None


class Supervisor:
    """The supervising thread of one stack: ``start()`` after the stack is ready, ``stop()`` and
    then ``release()`` when it stops."""

    def __init__(self, stack: Supervised, policy: RestartPolicy, redis_url: str) -> None:
        self.stack = stack
        self.policy = policy
        self.redis = redis.Redis.from_url(
            redis_url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S
        )
        self.stopping = threading.Event()
        self.released = threading.Event()
        self.watches: dict[str, Watch] = {}
        self.thread = threading.Thread(target=self._run, name="verst-supervisor", daemon=True)

    def start(self) -> None:
        now = time.monotonic()
        self.watches = {name: Watch(started_at=now) for name in self.stack.running()}
        self._redis_call("forget earlier restarts", lambda: forget(self.redis, list(self.watches)))
        self.thread.start()

    def stop(self) -> None:
        """No restart begins after this returns (the check runs under the stack's lock)."""
        self.stopping.set()

    def release(self) -> None:
        """The children are stopped: let the thread end (see ``_run``) and wait for it."""
        self.released.set()
        if self.thread.is_alive():
            self.thread.join(timeout=RELEASE_TIMEOUT_S)
        self.redis.close()

    def alive(self) -> bool:
        return self.thread.is_alive()

    def _run(self) -> None:
        while not self.stopping.wait(self.policy.poll_s):
            for row in self.check(time.monotonic()):
                self._redis_call(
                    f"record the restart of {row.service}", lambda row=row: record(self.redis, row)
                )
        # The kernel's die-with-parent signal follows the *thread* that started a process: the
        # children restarted here must not get it before the stack stops them in order.
        self.released.wait(RELEASE_TIMEOUT_S)

    def check(self, now: float) -> list[ServiceRestart]:
        """One look at every child: note the ends, start those whose backoff is over; returns the
        records that changed (written to Redis by the caller, outside the lock)."""
        changed = []
        with self.stack.lock:
            if self.stopping.is_set():
                return []
            for name, process in self.stack.running().items():
                watch = self.watches.setdefault(name, Watch(started_at=now))
                returncode = process.poll()
                if returncode is None:
                    if watch.in_a_row and now - watch.started_at >= self.policy.stable_after_s:
                        changed += self._recovered(watch)
                    continue
                if watch.due_at is None:
                    changed.append(self._ended(name, watch, returncode, now))
                elif now >= watch.due_at:
                    changed.append(self._restart(name, watch, now))
        return changed

    def _recovered(self, watch: Watch) -> list[ServiceRestart]:
        """Up ``stable_after_s``: the backoff starts over and a crash-loop mark goes."""
        watch.in_a_row = 0
        watch.recent.clear()
        if watch.row is None or not watch.row.crash_loop:
            return []
        log.warning(
            "%s has stayed up %.0fs: no longer crash-looping", watch.row.service, self.policy.stable_after_s
        )
        watch.row = watch.row.model_copy(
            update={"crash_loop": False, "next_delay_s": self.policy.first_delay_s}
        )
        return [watch.row]

    def _ended(self, name: str, watch: Watch, returncode: int, now: float) -> ServiceRestart:
        ending = exit_text(returncode)
        watch.in_a_row += 1
        while watch.recent and now - watch.recent[0] > self.policy.crash_loop_window_s:
            watch.recent.popleft()
        crash_loop = len(watch.recent) + 1 >= self.policy.crash_loop_restarts
        delay = self.policy.max_delay_s if crash_loop else backoff_delay(self.policy, watch.in_a_row)
        watch.due_at = now + delay
        up_s = now - watch.started_at
        if crash_loop:
            log.error(
                "%s is crash-looping: ended (%s) %d times within %.0fs; restarting it every %.0fs",
                name, ending, len(watch.recent) + 1, self.policy.crash_loop_window_s, delay,
            )  # fmt: skip
        else:
            log.warning("%s ended (%s) after %.1fs up; restarting it in %.1fs", name, ending, up_s, delay)
        watch.row = ServiceRestart(
            service=name, restarts=watch.restarts, last_exit=ending, last_exit_at=time.time(),
            state="restarting", next_delay_s=delay, crash_loop=crash_loop,
        )  # fmt: skip
        return watch.row

    def _restart(self, name: str, watch: Watch, now: float) -> ServiceRestart:
        assert watch.row is not None
        watch.restarts += 1
        watch.recent.append(now)
        watch.due_at = None
        watch.started_at = now
        try:
            process = self.stack.respawn(name, f"restart {watch.restarts} after {watch.row.last_exit}")
        except OSError as err:  # no process (fork or exec failed): seen as ended again at the next look
            log.error("could not restart %s: %s", name, err)
            return watch.row
        log.warning("restarted %s (pid %d), restart %d", name, process.pid, watch.restarts)
        next_delay = (
            self.policy.max_delay_s
            if watch.row.crash_loop
            else backoff_delay(self.policy, watch.in_a_row + 1)
        )
        watch.row = watch.row.model_copy(
            update={"restarts": watch.restarts, "state": "running", "next_delay_s": next_delay}
        )
        return watch.row

    def _redis_call(self, what: str, call: Callable[[], object]) -> None:
        """Run a Redis write; a failure is logged, never fatal: the restart itself has happened."""
        try:
            call()
        except redis.RedisError as err:
            log.warning("could not %s in Redis: %s", what, err)
