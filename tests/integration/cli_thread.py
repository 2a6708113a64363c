"""`verst <argv>` run in a thread of the test's process, for commands that block while they follow
a job (watch, logs --follow), and a bounded wait for it to end."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from services.cli import main


def run_cli(argv: list[str]) -> tuple[threading.Thread, dict[str, Any]]:
    """`verst <argv>` in a daemon thread; its exit status lands in the dict under "status"."""
    outcome: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: outcome.setdefault("status", main(argv)), daemon=True)
    thread.start()
    return thread, outcome


async def ended(thread: threading.Thread, deadline_s: float = 30.0) -> bool:
    """Whether the thread ends within ``deadline_s`` (polled without blocking the event loop)."""
    deadline = time.monotonic() + deadline_s
    while thread.is_alive() and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return not thread.is_alive()
