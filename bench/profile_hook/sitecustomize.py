"""cProfile of chosen verst services over a window that bench/control_plane.py picks (--profile).

Python imports this module at start-up when its directory is on PYTHONPATH. In a process run as
``python -m services.<name>`` with ``<name>`` in ``VERST_BENCH_PROFILE`` (comma-separated), SIGUSR1
starts profiling the main thread (the event loop: what runs in worker threads is not seen) and
SIGUSR2 stops it and writes the stats to ``$VERST_BENCH_PROFILE_DIR/<name>-<n>.prof``, the n-th
window. Any other process is left alone.
"""

from __future__ import annotations

import itertools
import os
import signal
from pathlib import Path
from typing import Any


def _service() -> str:
    """``<name>`` of ``python -m services.<name>``, else ""."""
    try:
        args = Path("/proc/self/cmdline").read_bytes().split(b"\0")
    except OSError:
        return ""
    for flag, module in itertools.pairwise(args):
        if flag == b"-m" and module.startswith(b"services."):
            return module.decode().removeprefix("services.")
    return ""


class _Windows:
    """Profiles one window at a time: SIGUSR1 begins it, SIGUSR2 ends and writes it."""

    def __init__(self, name: str, out_dir: Path) -> None:
        self.name = name
        self.out_dir = out_dir
        self.count = 0
        self.profile: Any = None

    def start(self, signum: int, frame: object) -> None:
        import cProfile

        self.profile = cProfile.Profile()
        self.profile.enable()

    def stop(self, signum: int, frame: object) -> None:
        if self.profile is None:
            return
        self.profile.disable()
        self.count += 1
        self.profile.dump_stats(str(self.out_dir / f"{self.name}-{self.count}.prof"))
        self.profile = None


_NAME = _service()
if _NAME and _NAME in os.environ.get("VERST_BENCH_PROFILE", "").split(","):
    _WINDOWS = _Windows(_NAME, Path(os.environ.get("VERST_BENCH_PROFILE_DIR", ".")))
    signal.signal(signal.SIGUSR1, _WINDOWS.start)
    signal.signal(signal.SIGUSR2, _WINDOWS.stop)
