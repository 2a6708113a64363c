"""The engine thread's handoff to the event loop: order kept, one wake-up per burst, failures apart."""

from __future__ import annotations

import asyncio
import threading

import pytest

from services.rollout.servicer import LoopHandoff


def counting_loop() -> tuple[asyncio.AbstractEventLoop, list[int]]:
    loop = asyncio.new_event_loop()
    wakeups: list[int] = []
    schedule = loop.call_soon_threadsafe

    def counted(*args):  # type: ignore[no-untyped-def]
        wakeups.append(1)
        return schedule(*args)

    loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
    return loop, wakeups


def post_from_thread(handoff: LoopHandoff, calls: list[tuple]) -> None:
    thread = threading.Thread(target=lambda: [handoff.post(*call) for call in calls])
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_a_burst_runs_in_order_after_one_wakeup() -> None:
    loop, wakeups = counting_loop()
    try:
        handoff, seen = LoopHandoff(loop), []
        post_from_thread(handoff, [(seen.append, i) for i in range(100)])
        assert seen == [] and len(wakeups) == 1
        loop.run_until_complete(asyncio.sleep(0))
        assert seen == list(range(100))
        post_from_thread(handoff, [(seen.append, "next")])  # the next burst wakes the loop again
        loop.run_until_complete(asyncio.sleep(0))
        assert seen[-1] == "next" and len(wakeups) == 2
    finally:
        loop.close()


def test_a_failing_call_does_not_drop_the_others(caplog: pytest.LogCaptureFixture) -> None:
    loop, _ = counting_loop()
    try:
        handoff, seen = LoopHandoff(loop), []

        def broken(value: int) -> None:
            raise ValueError(value)

        post_from_thread(handoff, [(seen.append, 1), (broken, 2), (seen.append, 3)])
        loop.run_until_complete(asyncio.sleep(0))
        assert seen == [1, 3]
        assert "a handed-off call failed" in caplog.text
    finally:
        loop.close()


def test_a_closed_loop_refuses_and_forgets() -> None:
    loop, _ = counting_loop()
    handoff = LoopHandoff(loop)
    loop.close()
    with pytest.raises(RuntimeError):
        handoff.post(print, "never")
    with pytest.raises(RuntimeError):  # not swallowed as "a wake-up is on its way"
        handoff.post(print, "never")
