"""The local stack's supervisor (services/supervisor.py): a child that ends is restarted after a
doubling, capped backoff that starts over once it stays up; a crash loop is marked and retried at
the cap; nothing restarts once stopping; every end is recorded with its signal or status."""

from __future__ import annotations

import signal
import threading

import pytest

from services.supervisor import RestartPolicy, Supervisor, backoff_delay, exit_text

POLICY = RestartPolicy(first_delay_s=1.0, max_delay_s=8.0, stable_after_s=60.0, crash_loop_restarts=4,
                       crash_loop_window_s=100.0)  # fmt: skip


class FakeProcess:
    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode


class FakeStack:
    """One child, ``engine-0``, whose process the test ends at will."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.process = FakeProcess(100)
        self.respawned: list[str] = []

    def running(self) -> dict[str, FakeProcess]:
        return {"engine-0": self.process}

    def respawn(self, name: str, why: str) -> FakeProcess:
        assert self.lock.locked(), "restarts happen under the stack's lock"
        self.respawned.append(why)
        self.process = FakeProcess(self.process.pid + 1)
        return self.process


def supervisor(stack: FakeStack) -> Supervisor:
    # check() leaves the records to its caller: this Redis is never asked
    return Supervisor(stack, POLICY, "redis://127.0.0.1:1/0")  # type: ignore[arg-type]


def crash(stack: FakeStack, watching: Supervisor, now: float, returncode: int = -signal.SIGKILL) -> float:
    """End the child at ``now``, see the end noted, and return the delay the supervisor chose."""
    stack.process.returncode = returncode
    [row] = watching.check(now)
    assert row.state == "restarting"
    return row.next_delay_s


def test_the_backoff_doubles_up_to_its_cap() -> None:
    assert [backoff_delay(POLICY, n) for n in range(1, 7)] == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]


def test_an_end_is_told_by_its_signal_or_status() -> None:
    assert exit_text(-signal.SIGKILL) == "signal SIGKILL"
    assert exit_text(3) == "exit status 3"


def test_a_child_that_ends_is_restarted_after_its_backoff() -> None:
    stack = FakeStack()
    watching = supervisor(stack)
    assert watching.check(0.0) == []
    assert crash(stack, watching, 10.0) == 1.0
    assert watching.check(10.5) == [] and stack.respawned == []  # still waiting out the backoff
    [row] = watching.check(11.0)
    assert stack.respawned == ["restart 1 after signal SIGKILL"]
    assert (row.service, row.restarts, row.state, row.last_exit) == (
        "engine-0",
        1,
        "running",
        "signal SIGKILL",
    )
    assert crash(stack, watching, 12.0, returncode=1) == 2.0  # again at once: twice the wait
    assert watching.check(14.0)[0].last_exit == "exit status 1"
    assert watching.check(14.0 + POLICY.stable_after_s) == []  # stayed up: the backoff starts over
    assert crash(stack, watching, 80.0) == 1.0


def test_a_crash_loop_is_marked_and_retried_at_the_cap() -> None:
    stack = FakeStack()
    watching = supervisor(stack)
    now, delays = 0.0, []
    for _ in range(POLICY.crash_loop_restarts):
        delays.append(crash(stack, watching, now))
        now += delays[-1]
        watching.check(now)
    assert delays == [1.0, 2.0, 4.0, 8.0]
    assert watching.watches["engine-0"].row is not None and watching.watches["engine-0"].row.crash_loop
    assert crash(stack, watching, now) == POLICY.max_delay_s
    assert len(stack.respawned) == POLICY.crash_loop_restarts, "kept retrying, not given up on"
    [recovered] = watching.check(now + POLICY.max_delay_s + POLICY.stable_after_s + 1)
    assert recovered.service == "engine-0"  # restarted (the check just before did it)...
    [calm] = watching.check(now + 2 * (POLICY.max_delay_s + POLICY.stable_after_s))
    assert not calm.crash_loop  # ...and up long enough: no longer a crash loop


def test_a_restart_that_cannot_start_is_tried_again_after_a_longer_backoff() -> None:
    stack = FakeStack()
    watching = supervisor(stack)
    crash(stack, watching, 0.0)
    ended = stack.process

    def no_fork(name: str, why: str) -> FakeProcess:
        raise OSError("Resource temporarily unavailable")

    stack.respawn = no_fork  # type: ignore[method-assign]
    [row] = watching.check(1.0)
    assert row.state == "restarting" and stack.process is ended
    assert watching.check(1.5)[0].next_delay_s == 2.0  # seen ended again: the next, doubled wait


def test_nothing_restarts_once_stopping() -> None:
    stack = FakeStack()
    watching = supervisor(stack)
    crash(stack, watching, 0.0)
    watching.stop()
    assert watching.check(100.0) == [] and stack.respawned == []


@pytest.mark.parametrize("field", ["first_delay_s", "poll_s"])
def test_a_policy_refuses_a_zero_delay(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        RestartPolicy(**{field: 0.0})
