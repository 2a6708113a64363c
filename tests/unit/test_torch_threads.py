"""serial_torch: torch work off the engine's worker thread runs on one core, so that the worker's
team of OpenMP threads stays the only one (a second team puts every team to sleep between kernels)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import pytest
import torch

from services.rollout.torch.model import serial_torch

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")


def native_threads_started_by(work: Callable[[], None]) -> int:
    """How many OS threads of this process ``work`` started, run on a fresh Python thread
    (counted before that thread ends: OpenMP retires a thread's team when the thread exits)."""
    before = set(os.listdir("/proc/self/task"))
    during: set[str] = set()

    def run() -> None:
        work()
        during.update(os.listdir("/proc/self/task"))

    worker = threading.Thread(target=run)
    worker.start()
    worker.join(30)
    return len(during - before - {str(worker.native_id)})


def parallel_op(threads: int, serial: bool, seen: list[int]) -> Callable[[], None]:
    """A matmul big enough for torch to run it in parallel, on ``threads`` threads."""

    def work() -> None:
        torch.set_num_threads(threads)
        big = torch.randn(256, 256)
        if serial:
            with serial_torch():
                seen.append(torch.get_num_threads())
                (big @ big).sum()
        else:
            (big @ big).sum()
        seen.append(torch.get_num_threads())

    return work


def test_serial_torch_runs_a_threads_ops_without_a_team_of_its_own() -> None:
    before = torch.get_num_threads()
    try:
        seen: list[int] = []
        # The same op outside the context starts OpenMP threads (so this test can fail) ...
        assert native_threads_started_by(parallel_op(2, serial=False, seen=seen)) >= 1
        # ... inside it, none; the thread's count comes back afterwards.
        assert native_threads_started_by(parallel_op(2, serial=True, seen=seen)) == 0
        assert seen == [2, 1, 2]
    finally:
        torch.set_num_threads(before)
