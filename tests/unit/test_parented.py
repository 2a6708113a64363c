"""services/common/parented.py: a wrapped command keeps its pid, dies with the process that
started it, and is started by a vfork that runs no fork handler (gRPC's among them)."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.common.parented import parented

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


def gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_the_command_runs_in_the_wrappers_place() -> None:
    child = subprocess.run(
        parented([sys.executable, "-c", "import os; print(os.getpid(), os.getppid())"]),
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    pid, ppid = map(int, child.stdout.split())
    assert ppid == os.getpid()
    assert pid != os.getpid()


def test_the_pid_popen_holds_is_the_commands() -> None:
    process = subprocess.Popen(
        parented([sys.executable, "-c", "import os; print(os.getpid())"]), stdout=subprocess.PIPE, text=True
    )
    out, _ = process.communicate(timeout=30)
    assert int(out) == process.pid


def test_the_command_dies_with_its_starter_even_by_sigkill() -> None:
    starter_code = (
        "import subprocess, sys, time\n"
        "from services.common.parented import parented\n"
        "child = subprocess.Popen(parented(['sleep', '120']))\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    starter = subprocess.Popen([sys.executable, "-c", starter_code], stdout=subprocess.PIPE, text=True)
    try:
        sleeper = int(starter.stdout.readline())  # type: ignore[union-attr]
        time.sleep(0.3)  # the wrapper has exec'd sleep by now (or is about to: the signal holds across it)
        assert not gone(sleeper, timeout_s=0.1)
        starter.send_signal(signal.SIGKILL)
        starter.wait(timeout=10)
        assert gone(sleeper), "the command outlived the process that started it"
    finally:
        starter.kill()
        starter.wait(timeout=10)


def test_a_starter_already_gone_means_no_command() -> None:
    """A parent pid that is not its parent (it died before the prctl): exit, do not run on."""
    marker = "ran"
    child = subprocess.run(
        parented([sys.executable, "-c", f"print({marker!r})"], parent_pid=1),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert child.returncode == 1
    assert marker not in child.stdout


FORK_HANDLER_COUNT = """
import os, subprocess, sys
from services.common.parented import parented
read_end, write_end = os.pipe()
os.set_blocking(read_end, False)
os.register_at_fork(after_in_child=lambda: os.write(write_end, b"x"))
def handled() -> int:
    try:
        return len(os.read(read_end, 16))
    except BlockingIOError:
        return 0
subprocess.run(parented(["true"]), check=True, timeout=30)
print(handled())
subprocess.run(["true"], check=True, timeout=30, preexec_fn=lambda: None)
print(handled())
"""


def test_a_parented_start_runs_no_fork_handler() -> None:
    """With a ``preexec_fn`` the same start runs them (so the check can see one); parented, none.
    In a process of its own: a fork handler cannot be unregistered."""
    counted = subprocess.run([sys.executable, "-c", FORK_HANDLER_COUNT], capture_output=True, text=True,
                             timeout=60, check=True)  # fmt: skip
    assert counted.stdout.split() == ["0", "1"]


def test_a_bad_wrapper_call_says_how_to_call_it() -> None:
    script = parented(["true"])[:4]  # python -I -S parented.py
    bad = subprocess.run([*script, "not-a-pid", "--", "true"], capture_output=True, text=True, timeout=30)
    assert bad.returncode != 0
    assert "usage" in bad.stderr
    with pytest.raises(ValueError, match="empty command"):
        parented([])


def test_a_missing_command_is_named() -> None:
    missing = subprocess.run(parented(["/nonexistent/verst-x"]), capture_output=True, text=True, timeout=30)
    assert missing.returncode != 0
    assert "/nonexistent/verst-x" in missing.stderr


def preexec_calls(root: Path) -> list[str]:
    """``file:line`` of every call passing ``preexec_fn`` under ``root``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and any(k.arg == "preexec_fn" for k in node.keywords):
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}")
    return found


def test_no_service_starts_a_process_with_a_preexec_fn(tmp_path: Path) -> None:
    """Every service process holds gRPC: its children start parented, never forked."""
    assert preexec_calls(ROOT / "services") == []
    (tmp_path / "bad.py").write_text("import subprocess\nsubprocess.Popen(['true'], preexec_fn=print)\n")
    assert preexec_calls(tmp_path) == [f"{tmp_path.name}/bad.py:2"]
