"""A build lock left by a killed trainer no longer hangs every later trainer on the host."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from services.trainer import extension_locks
from services.trainer.extension_locks import GUARD_FILE, extension_build_guard


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    return tmp_path


def test_a_stale_baton_is_removed_under_the_guard(root: Path) -> None:
    stale = root / "py311_cpu" / "deepspeed_shm_comm" / "lock"
    stale.parent.mkdir(parents=True)
    stale.touch()
    built = stale.parent / "deepspeed_shm_comm.so"
    built.touch()
    with extension_build_guard(timeout_s=5):
        assert not stale.exists()
    assert built.exists()  # only the lock goes


HOLDER = """
import sys, time
from services.trainer.extension_locks import extension_build_guard
with extension_build_guard(timeout_s=5):
    print("holding", flush=True)
    time.sleep(60)
"""


def test_the_guard_excludes_other_processes_and_dies_with_its_holder(
    root: Path, python: str, python_env: dict[str, str]
) -> None:
    env = python_env | {"TORCH_EXTENSIONS_DIR": str(root)}
    holder = subprocess.Popen([python, "-c", HOLDER], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=GUARD_FILE), extension_build_guard(timeout_s=0.5):
            pass
        assert time.monotonic() - started < 5
        holder.kill()  # SIGKILL: the kernel drops its fcntl lock with the process
        holder.wait(10)
        with extension_build_guard(timeout_s=5):
            pass
    finally:
        holder.kill()
        holder.wait(10)


def test_the_build_root_follows_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.utils.cpp_extension import get_default_build_root

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    assert extension_locks.build_root() == Path(get_default_build_root())
