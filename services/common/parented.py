"""Children that die with the process that started them, started without a ``preexec_fn``.

``parented(command)`` wraps a command so that, on Linux, the kernel SIGTERMs it when this
process dies (``PR_SET_PDEATHSIG``), even by SIGKILL. The wrapper is this file run as a script
(``python -I -S``, a few milliseconds): it asks for the signal, checks its parent is still the
one that started it, and execs the command in its own place (same pid).

Why not a ``preexec_fn``: with one, ``subprocess`` forks instead of vforking, and a fork runs
gRPC's fork handlers in the child, which may start a poller thread that dies on the epoll fd
``close_fds`` closes before the exec (SIGABRT, grpc/grpc#43055). Without one, ``subprocess``
vforks and no fork handler runs.

This file imports nothing of verst's: the wrapper runs it with ``-I -S``.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Sequence

_PR_SET_PDEATHSIG = 1


def parented(command: Sequence[str], parent_pid: int | None = None) -> list[str]:
    """``command`` wrapped to die with ``parent_pid`` (this process by default): start it
    with ``subprocess`` and no ``preexec_fn``; its pid is the command's."""
    if not command:
        raise ValueError("parented: an empty command")
    pid = os.getpid() if parent_pid is None else parent_pid
    return [sys.executable, "-I", "-S", __file__, str(pid), "--", *map(str, command)]


def die_with_parent(parent_pid: int) -> None:
    """In the child: ask the kernel to SIGTERM it when ``parent_pid`` dies; exit at once if it
    already has (its parent is no longer that process)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)


def main(argv: Sequence[str]) -> None:
    """``PARENT_PID -- COMMAND [ARGS...]``: die with PARENT_PID, then become COMMAND."""
    if len(argv) < 3 or argv[1] != "--" or not argv[0].isdigit():
        sys.exit(f"usage: {sys.argv[0]} PARENT_PID -- COMMAND [ARGS...]")
    die_with_parent(int(argv[0]))
    try:
        os.execvp(argv[2], list(argv[2:]))
    except OSError as error:
        sys.exit(f"cannot run {argv[2]}: {error}")


if __name__ == "__main__":
    main(sys.argv[1:])
