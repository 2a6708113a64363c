"""Stale build locks of torch's JIT-compiled extensions, which DeepSpeed loads at start.

On a CPU, ``deepspeed.init_distributed`` loads its shared-memory communication op through
``torch.utils.cpp_extension.load``, which takes a lock *file* (a "baton") in the extension's
build directory for every load, even when nothing needs rebuilding, and deletes it afterwards.
A trainer killed with SIGKILL inside that window leaves the file behind, and every later load
on the host waits for it forever. So verst's processes load extensions under an fcntl lock of
their own (the kernel releases it when its holder dies): whoever holds it knows that no verst
process is building, and that any baton left in the build root is stale.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import filelock

log = logging.getLogger(__name__)

LOCK_TIMEOUT_S = 600.0
"""Longest wait for another verst process to finish loading (a first build takes ~30 s)."""
GUARD_FILE = "verst-extensions.lock"
BATON_FILE = "lock"
"""The name torch.utils.file_baton gives the lock in an extension's build directory."""


def build_root() -> Path:
    """Where torch builds JIT extensions (TORCH_EXTENSIONS_DIR, else its cache directory)."""
    override = os.environ.get("TORCH_EXTENSIONS_DIR")
    if override:
        return Path(override)
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root())


def remove_stale_batons(root: Path) -> list[Path]:
    """Delete the batons under ``root`` (an extension directory at most two levels down); only
    safe while holding the guard. Returns what was deleted."""
    removed = []
    for baton in [*root.glob(f"*/{BATON_FILE}"), *root.glob(f"*/*/{BATON_FILE}")]:
        if baton.is_file():
            baton.unlink(missing_ok=True)
            removed.append(baton)
    return removed


@contextmanager
def extension_build_guard(timeout_s: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """Hold the guard and clear stale batons; load JIT extensions inside it."""
    root = build_root()
    root.mkdir(parents=True, exist_ok=True)
    guard = filelock.FileLock(str(root / GUARD_FILE))
    try:
        guard.acquire(timeout=timeout_s)
    except filelock.Timeout:
        raise TimeoutError(
            f"another process held {root / GUARD_FILE} for {timeout_s:.0f}s while loading torch extensions"
        ) from None
    try:
        for baton in remove_stale_batons(root):
            log.warning("removed a stale torch extension build lock %s (its process was killed)", baton)
        yield
    finally:
        guard.release()
